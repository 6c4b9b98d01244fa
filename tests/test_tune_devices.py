"""``autotune tune --devices``: one worker process per device, sharing one database.

On CPU, for real: two worker processes tune a two-problem shapes file (both publish, no config
is measured twice); one killed with SIGKILL mid-run leaves its problem to the other, and a rerun
has nothing left to measure. The environment a TPU or GPU worker gets is checked as data.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import textwrap
import time
from pathlib import Path

import optuna
import pytest

from autotune.devices import (
    DeviceSelectionError,
    LocalDevices,
    cpu_devices,
    measuring_index_problem,
    parse_devices,
    select_devices,
    worker_env,
)
from conftest import AUTOTUNE, problem_flags, run_cli
from kernel import ConfigError, Problem
from storage import Store, upgrade
from storage.studies import is_measurement

PROBLEMS = [Problem(1, 1, 1, 256, 256, 128, "float32", causal, "fwd") for causal in (False, True)]
TRIALS = 3
# The kill test's budget: long enough that under a loaded CI machine the second worker, slower
# to start, measures before the first has done both problems alone (with 3 it once had not).
KILL_TRIALS = 8
# The two tests below need the second worker to measure, so its start-up must be shorter than the
# first worker's problems: the suite's shared compilation cache (tests/conftest.py) made the
# first worker's compiles hits, and it once did both problems alone. Their CLI runs compile.
OWN_COMPILES = {"JAX_COMPILATION_CACHE_DIR": ""}


def shapes_file(tmp_path: Path) -> Path:
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps([p.to_dict() for p in PROBLEMS]))
    return path


def tune_args(tmp_path: Path, db: str, trials: int = TRIALS) -> list[str]:
    return ["tune", "--kernel", "flash", "--shapes", str(shapes_file(tmp_path)), "--devices",
            "2", "--trials", str(trials), "--db", db, "--json"]


def studies(db: str) -> dict[str, list[optuna.trial.FrozenTrial]]:
    return {name: optuna.load_study(study_name=name, storage=db).get_trials(deepcopy=False)
            for name in optuna.get_all_study_names(db)}


def assert_each_problem_tuned_once(db: str, budget: int = TRIALS) -> None:
    """Both problems published, each study at its budget, no config measured twice."""
    by_study = studies(db)
    assert len(by_study) == len(PROBLEMS)
    for name, trials in by_study.items():
        measured = [json.dumps(t.params, sort_keys=True) for t in trials if is_measurement(t)]
        assert len(measured) == budget == len(set(measured)), (name, sorted(measured))
    with Store(db) as store:
        entries, _ = store.list({}, limit=None)
    assert sorted(e.result.problem.label() for e in entries) == sorted(
        p.label() for p in PROBLEMS)
    assert {e.result.device_index for e in entries} <= {0, 1}


def test_two_workers_tune_a_shapes_file(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'tune.db'}"
    done = run_cli(*tune_args(tmp_path, db), timeout=400, env=OWN_COMPILES)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    summaries = [line for line in lines if line.get("summary")]
    # Each problem is published once, by the last worker searching it: which one that is
    # depends on timing (a worker done with its own problem joins the other's study).
    assert len(summaries) == 2 and {s["device_index"] for s in summaries} <= {0, 1}
    assert {line["device"] for line in lines if "trial" in line} == {0, 1}
    workers = {t.user_attrs["worker"] for trials in studies(db).values() for t in trials
               if is_measurement(t)}
    assert len(workers) == 2, workers
    assert_each_problem_tuned_once(db)


def running_worker_pid(db_file: Path, job: subprocess.Popen, log: Path) -> int:
    """The process id of a worker that is measuring a config, once both workers measured."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert job.poll() is None, log.read_text()[-3000:]
        try:
            with sqlite3.connect(f"file:{db_file}?mode=ro", uri=True, timeout=5) as db:
                rows = db.execute(
                    "SELECT t.state, a.value_json FROM trials t JOIN trial_user_attributes a "
                    "ON a.trial_id = t.trial_id AND a.key = 'worker'").fetchall()
        except sqlite3.OperationalError:  # no tables yet
            rows = []
        finished = {w for state, w in rows if state in ("COMPLETE", "PRUNED")}
        running = [w for state, w in rows if state == "RUNNING"]
        if len(finished) == 2 and running:
            return int(json.loads(running[0]).rsplit(":", 1)[1])
        time.sleep(0.1)
    pytest.fail(f"the two workers did not both measure in time:\n{log.read_text()[-3000:]}")


def test_a_killed_worker_s_problem_is_taken_over(tmp_path: Path) -> None:
    db_file = tmp_path / "tune.db"
    db, log = f"sqlite:///{db_file}", tmp_path / "tune.log"
    with log.open("w") as sink:
        job = subprocess.Popen([*AUTOTUNE, *tune_args(tmp_path, db, KILL_TRIALS)], stdout=sink,
                               stderr=subprocess.STDOUT, env={**os.environ, **OWN_COMPILES})
    try:
        victim = running_worker_pid(db_file, job, log)
        subprocess.run(["kill", "-9", str(victim)], check=True)
        job.wait(timeout=400)
    finally:
        if job.poll() is None:
            job.kill()
    output = log.read_text()
    assert job.returncode == 0, output[-3000:]
    assert "died (signal 9)" in output and "goes to another worker" in output
    assert "Traceback" not in output
    assert_each_problem_tuned_once(db, KILL_TRIALS)
    released = [t for trials in studies(db).values() for t in trials
                if t.user_attrs.get("status") == "orphan"]
    assert released and all(t.user_attrs["worker"].endswith(f":{victim}") for t in released)

    rerun = run_cli(*tune_args(tmp_path, db, KILL_TRIALS), timeout=400)  # nothing to measure
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert [sorted(json.loads(line)) for line in rerun.stdout.splitlines()] == [
        ["kept", "problem"]] * 2


# Loaded by every Python process of the test below (PYTHONPATH): once autotune.measure is
# imported, the first config measured after the default leaves the "chip" corrupt (the canary's
# first output no longer matches) in the first process that gets there (a marker file).
CORRUPTING_SITE = textwrap.dedent("""
    import importlib.abc, importlib.util, os, sys

    def corrupt_once(module):
        original = module.Measurer._canary_after

        def canary_after(self, config, measurement):
            marker = os.environ["CORRUPT_MARKER"]
            if config != self.base and not os.path.exists(marker):
                open(marker, "w").write(str(os.getpid()))
                program, first = self._canary
                self._canary = (program, [x + 1 for x in first])  # what a left copy does
            return original(self, config, measurement)

        module.Measurer._canary_after = canary_after

    class Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "autotune.measure":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module
            spec.loader.exec_module = lambda module: (run(module), corrupt_once(module))
            return spec

    sys.meta_path.insert(0, Hook())
""")


def test_a_worker_whose_device_goes_corrupt_is_replaced_by_a_fresh_process(
        tmp_path: Path) -> None:
    """Issue 54: a config that leaves the chip corrupt ends its worker (nothing more runs right
    in that process); a fresh process takes the device over and the study goes on: the config
    is recorded ``corrupts_state`` and never published, the budget is filled, no config is
    measured twice."""
    site, marker = tmp_path / "site", tmp_path / "corrupted-by"
    site.mkdir()
    (site / "sitecustomize.py").write_text(CORRUPTING_SITE)
    db = f"sqlite:///{tmp_path / 'tune.db'}"
    done = run_cli("tune", "--kernel", "flash", *problem_flags(PROBLEMS[1]), "--devices", "0,",
                   "--trials", str(TRIALS), "--db", db, "--json", timeout=400,
                   env={"PYTHONPATH": str(site), "CORRUPT_MARKER": str(marker)})
    assert done.returncode == 0, done.stderr[-3000:]
    said = " ".join(done.stderr.split())  # as wrapped by the console
    assert "never published; a fresh worker process takes over the device (1 of at most 5)" \
        in said
    assert "Traceback" not in said and "run the same command" not in said
    [trials] = studies(db).values()
    measured = [t for t in trials if is_measurement(t)]
    assert len(measured) == TRIALS == len({json.dumps(t.params) for t in measured})
    [corrupting] = [t for t in measured if t.user_attrs["status"] == "corrupts_state"]
    processes = {t.user_attrs["process"] for t in measured}
    assert len(processes) == 2 and marker.read_text() in corrupting.user_attrs["worker"]
    [summary] = [json.loads(line) for line in done.stdout.splitlines() if "best_config" in line]
    assert summary["best_config"] != {**summary["best_config"], **corrupting.params}


def test_each_worker_sees_only_its_device() -> None:
    tpu = [worker_env("tpu", index) for index in (0, 5)]
    assert [env["TPU_VISIBLE_CHIPS"] for env in tpu] == ["0", "5"]
    for env in tpu:
        assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == env["TPU_PROCESS_BOUNDS"] == "1,1,1"
        assert env["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1"
        assert env["TPU_PROCESS_ADDRESSES"] == f"localhost:{env['TPU_PROCESS_PORT']}"
    assert tpu[0]["TPU_PROCESS_PORT"] != tpu[1]["TPU_PROCESS_PORT"]
    assert worker_env("gpu", 3) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert worker_env("cpu", 1) == {"JAX_PLATFORMS": "cpu"}


def test_a_device_index_no_device_here_has_is_refused_before_anything_runs(
        tmp_path: Path) -> None:
    """Issue 62 item 7: ``TuneOptions(device_index=5)`` published provenance for a device the
    tune did not run on; now it names one this process measures on, or the tune refuses."""
    from autotune.choice import choose_kernel
    from autotune.tune import TuneOptions, tune

    db = f"sqlite:///{tmp_path / 'tune.db'}"
    upgrade(db)
    absent = TuneOptions(trials=1, device_index=cpu_devices())  # one past the last core
    message = rf"^device_index {cpu_devices()} names no cpu device: --devices names 0 to "
    with Store(db) as store:
        with pytest.raises(ConfigError, match=message):
            tune(PROBLEMS[0], store, db, absent, kernel_name="flash")
        with pytest.raises(ConfigError, match=message):
            choose_kernel(PROBLEMS[0], store, db, ["flash", "xla"], absent)
        assert store.list(limit=None)[1] == 0
    assert optuna.get_all_study_names(db) == []


def test_a_tpu_or_gpu_process_measures_on_device_0_or_the_one_it_sees_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TPU_VISIBLE_CHIPS", raising=False)
    assert measuring_index_problem(0, "tpu") == ""
    assert "(TPU_VISIBLE_CHIPS unset); leave device_index at 0, or tune on device 5 with " \
           "`autotune tune --devices 5,`" in measuring_index_problem(5, "tpu")
    monkeypatch.setenv("TPU_VISIBLE_CHIPS", worker_env("tpu", 5)["TPU_VISIBLE_CHIPS"])
    assert measuring_index_problem(5, "tpu") == ""  # a worker of --devices 5,
    assert "TPU_VISIBLE_CHIPS='5'" in measuring_index_problem(3, "tpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert measuring_index_problem(2, "cuda") == "" != measuring_index_problem(3, "gpu")


def test_device_selection() -> None:
    eight = LocalDevices("tpu", 8)
    assert select_devices(parse_devices("all"), eight) == tuple(range(8))
    assert select_devices(parse_devices("2"), eight) == (0, 1)
    assert select_devices(parse_devices("0,2,5"), eight) == (0, 2, 5)
    assert select_devices(parse_devices("7,"), eight) == (7,)
    with pytest.raises(DeviceSelectionError, match=r"device\(s\) 8.*indices 0 to 7"):
        select_devices(parse_devices("0,8"), eight)
    with pytest.raises(DeviceSelectionError, match="selects 100000000 devices.*count up to 8"):
        select_devices(parse_devices("100000000"), eight)  # not a MemoryError
    for bad in ("0", "-1", "two", "1,1", ","):
        with pytest.raises(DeviceSelectionError, match="use 'all', a count"):
            parse_devices(bad)


@pytest.mark.parametrize("selection", ["0,0", "99"])
def test_a_bad_selection_is_a_usage_error_that_creates_no_database(tmp_path: Path,
                                                                   selection: str) -> None:
    """Issue 75 item 11k: ``--devices 99`` (more than there are) created the database."""
    done = run_cli("tune", "--devices", selection, "--db", f"sqlite:///{tmp_path / 'x.db'}")
    assert done.returncode == 2 and "--devices" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x.db").exists()


def test_a_timing_that_cannot_time_here_is_a_usage_error_on_workers(tmp_path: Path) -> None:
    """As on one device: exit 2 naming the fix, not "every worker died"."""
    args = tune_args(tmp_path, f"sqlite:///{tmp_path / 'x.db'}")
    done = run_cli(*args, "--timing", "profile", timeout=300, env={"COLUMNS": "400"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "'profile' (retired: it timed the named kernels only" in done.stderr
    assert "died" not in done.stderr


@pytest.fixture(scope="module")
def exhausted(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two workers on a problem of four legal configs with ten trials (the space is exhausted
    first), as a user sees it (no --json): the database URL and the output."""
    db = f"sqlite:///{tmp_path_factory.mktemp('exhausted') / 'tune.db'}"
    done = run_cli("tune", "--kernel", "flash", "--q-len", "128", "--head-dim", "64",
                   "--q-heads", "1", "--dtype", "float32", "--trials", "10", "--devices", "2",
                   "--db", db, env={"COLUMNS": "200"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return db, done.stdout + done.stderr


def test_a_search_that_ends_before_its_budget_is_published_once(
        exhausted: tuple[str, str]) -> None:
    """Four legal configs and ten trials: the space is exhausted first. A worker done
    searching rejoined the other's study, and the two took turns for ever."""
    db, output = exhausted
    said = " ".join(output.split())  # as wrapped by the console
    assert said.count("; published: ") == 1, said
    assert "; 4 measured (stopped: every legal config), failures none;" in said, said
    [trials] = studies(db).values()
    assert len([t for t in trials if is_measurement(t)]) == 4
    with Store(db) as store:
        assert store.list({}, limit=None)[1] == 1


def test_a_kernel_choice_runs_on_two_workers(tmp_path: Path) -> None:
    """Each candidate kernel's study is one more study for the pool; once both are tuned, one
    worker confirms them against each other and publishes the choice, once."""
    db = f"sqlite:///{tmp_path / 'choice.db'}"
    done = run_cli("tune", "--kernels", "flash,xla,cudnn", "--q-len", "128", "--head-dim",
                   "64", "--q-heads", "1", "--dtype", "float32", "--trials", "2", "--devices",
                   "2", "--db", db, "--json", timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    [summary] = [line for line in lines if line.get("summary")]
    assert set(summary["tuned"]) == {"flash", "xla"} and summary["chosen_kernel"] in {"flash",
                                                                                    "xla"}
    assert summary["kernel_failures"] == {"cudnn": "illegal"}  # no target on a CPU: lost
    assert all(ms > 0 for name, ms in summary["kernels"].items() if name != "cudnn")
    with Store(db) as store:
        [(stored, _)] = store.lookup_choices([("cpu", Problem(1, 1, 1, 128, 128, 64,
                                                              "float32"))])
        tuned = {entry.result.kernel for entry in store.list({}, limit=None)[0]}
    assert stored.choice.kernel == summary["chosen_kernel"] and tuned == {"flash", "xla"}


def test_the_workers_rows_end_done_with_their_counts(exhausted: tuple[str, str]) -> None:
    """Issue 46 item 11: once every problem is published, each device's row reads ``done``
    with the configs it measured (was ``0/4 ... idle``)."""
    rows = [line for line in exhausted[1].splitlines() if line.startswith("device ")]
    counts = [int(re.search(r"done: (\d+) measured", row).group(1)) for row in rows]
    assert len(rows) == 2 and sum(counts) == 4, rows  # the space's 4 legal configs
    assert not any("idle" in row for row in rows), rows
