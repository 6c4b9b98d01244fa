"""The tuning pipeline on this machine's CPU (the kernel runs in TPU interpret mode).

End to end: ``autotune tune --json`` in a subprocess prints one JSON line per trial and one
summary per problem, and the published winner is what the real service then answers, with its
provenance; ``--shapes`` tunes every problem of a file and a bad file is refused before anything
is written. In process: every failure class a measurement can end in (compile error, VMEM OOM
from the real Mosaic compiler, runtime error, wrong result, compile timeout) is kept on its
trial without ending the study, illegal configs never reach the measurer, and the confirmation
step keeps the default unless a candidate beats it beyond the noise.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import jax
import numpy as np
import optuna
import pytest
import yaml

from autotune.failures import ChipStateCorrupted, Status, classify_compile_error
from autotune.measure import Measurer, Timing, relative_error, same_bits
from autotune.search import search
from autotune.searchspace import Space
from autotune.trials import Measurement
from autotune.tune import choose_winner, kernel_space
from conftest import problem_flags, run_cli, sqlite_copy
from kernel import FlashConfig, Problem, device_target, get_kernel
from kernel.aot import compile_for_target
from storage import Store
from storage.results import MIN_TIME_MS

FLASH = get_kernel("flash").discover()

TINY = Problem(batch=1, q_heads=1, kv_heads=1, q_len=256, kv_len=256, head_dim=128,
               dtype="float32", causal=False, mode="fwd")
TINY_GQA = Problem(batch=1, q_heads=2, kv_heads=1, q_len=256, kv_len=256, head_dim=128,
                   dtype="float32", causal=True, mode="fwd")
SUMMARY_KEYS = {"problem", "best_config", "best_time_ms", "default_time_ms", "speedup",
                "measured", "failures"}
WIDE = {"COLUMNS": "400"}  # Rich wraps error boxes at the terminal width (80 in a pipe)


def parse_json_lines(stdout: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Trial lines and summary lines of ``autotune tune --json`` (every stdout line is JSON)."""
    lines = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    return ([line for line in lines if not line.get("summary")],
            [line for line in lines if line.get("summary")])


def lookup_params(problem: Problem, device_kind: str = "cpu") -> dict[str, Any]:
    fields = {name: value for name, value in problem.to_dict().items() if value is not None}
    return {"kernel": "flash", "device_kind": device_kind, **fields,
            "causal": str(fields["causal"]).lower()}


# --- end to end ---


TINY_TUNE_FLAGS = ("tune", "--kernel", "flash", *problem_flags(TINY), "--json")


@pytest.fixture(scope="module")
def tuned_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One finished ``autotune tune --shapes [TINY, TINY_GQA] --trials 2 --json``: its SQLite
    file and stdout. Each test works on its own copy of the file (``sqlite_copy``); those that
    rerun TINY's tune find it finished."""
    shapes = tmp_path_factory.mktemp("tuned_pair") / "shapes.yaml"
    shapes.write_text(yaml.safe_dump([TINY.to_dict(), TINY_GQA.to_dict()]))
    path = shapes.parent / "tune.db"
    done = run_cli("tune", "--kernel", "flash", "--shapes", str(shapes), "--trials", "2",
                   "--db", f"sqlite:///{path}", "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    return path, done.stdout


def _tiny_summary(tuned_pair: tuple[Path, str]) -> dict[str, Any]:
    """TINY's summary line of the finished tune (its study, its best config)."""
    [summary] = [s for s in parse_json_lines(tuned_pair[1])[1]
                 if s["problem"] == TINY.to_dict()]
    return summary


def test_tune_json_publishes_the_winners_the_service_returns(
        tmp_path: Path, tuned_pair: tuple[Path, str], start_server: Any) -> None:
    """``--shapes`` with two problems: per-trial JSON lines, one summary per problem, and each
    winner published with its provenance. (The problem flags are the path the reliability
    tests drive.)"""
    db = sqlite_copy(tuned_pair[0], tmp_path)
    trials, summaries = parse_json_lines(tuned_pair[1])
    assert [t["problem"] for t in trials] == [TINY.to_dict()] * 2 + [TINY_GQA.to_dict()] * 2
    assert [s["problem"] for s in summaries] == [TINY.to_dict(), TINY_GQA.to_dict()]
    assert len({s["study"] for s in summaries}) == 2
    server = start_server(db)
    for index, (problem, summary) in enumerate(zip((TINY, TINY_GQA), summaries, strict=True)):
        check_tuned(problem, trials[2 * index:2 * index + 2], summary, db, server.url)


def check_tuned(problem: Problem, trials: list[dict[str, Any]], summary: dict[str, Any],
                db: str, url: str) -> None:
    """One problem's trial lines and summary agree with each other, with the study's
    confirmation record, and with what the service returns for the problem."""
    assert len({json.dumps(t["config"], sort_keys=True) for t in trials}) == len(trials)
    for trial in trials:
        assert trial["status"] == "ok", trial
        assert trial["time_ms"] > 0 and trial["compile_s"] > 0 and trial["max_error"] < 2e-3
    assert SUMMARY_KEYS <= summary.keys()
    assert (summary["measured"], summary["failures"]) == (len(trials), {})
    assert (summary["device_kind"], summary["method"]) == ("cpu", "interpret")
    # auto times by wall clock on a CPU, and an interpret-mode time has no roofline.
    assert (summary["timing"], summary["timing_note"]) == ("wallclock", None)
    assert summary["achieved_tflops"] is summary["roofline_fraction"] is None
    assert all(trial["timing"] == "wallclock" for trial in trials)
    best = FlashConfig.from_dict(summary["best_config"])
    base = FLASH.default_config(problem, "cpu")
    assert best == base or best in [base.replace(**t["config"]) for t in trials]
    assert summary["speedup"] == pytest.approx(summary["default_time_ms"]
                                               / summary["best_time_ms"])

    # The confirmation samples are kept on the study: default, top candidates, the winner.
    confirmation = optuna.load_study(study_name=summary["study"],
                                     storage=db).user_attrs["confirmation"]
    [winner] = [c for c in confirmation if c["is_winner"]]
    [default] = [c for c in confirmation if c["is_default"]]
    assert FlashConfig.from_dict(winner["config"]) == best
    assert FlashConfig.from_dict(default["config"]) == base
    assert all(len(c["samples_ms"]) == 5 for c in confirmation)  # TuneOptions.confirm_rounds
    assert (winner["median_ms"], default["median_ms"]) == (summary["best_time_ms"],
                                                          summary["default_time_ms"])

    # The real service on the same database answers with exactly that config.
    found = httpx.get(f"{url}/v1/configs/lookup", params=lookup_params(problem))
    assert found.status_code == 200, found.text
    assert found.json()["match"] == "exact"
    assert found.json()["config"] == summary["best_config"]
    [entry] = httpx.get(f"{url}/v1/configs",
                        params={"device_kind": "cpu", "study": summary["study"]}).json()["items"]
    assert (entry["method"], entry["timing"]) == ("interpret", "wallclock")
    assert entry["achieved_tflops"] is entry["roofline_fraction"] is entry["roofline_bound"] is None
    assert entry["trials"] == len(trials)
    assert entry["jax_version"] == importlib.metadata.version("jax")
    assert entry["jaxlib_version"] == importlib.metadata.version("jaxlib")
    assert entry["libtpu_version"] == importlib.metadata.version("libtpu")
    assert (entry["median_ms"], entry["default_median_ms"]) == (summary["best_time_ms"],
                                                                summary["default_time_ms"])


@pytest.mark.parametrize(("problems", "expected"), [
    ([TINY.to_dict(), {"batch": 1, "q_heads": 1, "q_len": 256}], "problem 1: missing problem "
     "field(s): head_dim"),
    ([TINY.to_dict(), {**TINY.to_dict(), "dtype": "float64"}], "problem 1: dtype must be one of"),
    ([{**TINY.to_dict(), "causal": "maybe"}], "problem 0: causal must be a boolean"),
    ([TINY.to_dict(), 5], "problem 1: a problem must be a JSON object"),
    ({"batch": 1}, "must hold a non-empty list of problems"),
    ([{**TINY.to_dict(), 1: 2, "foo": 3}], "problem 0: unknown problem field(s) [1, 'foo']"),
])
def test_bad_shapes_file_is_refused_before_anything_is_written(
        tmp_path: Path, problems: Any, expected: str) -> None:
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text(yaml.safe_dump(problems, sort_keys=False))  # YAML keys of mixed types
    database = tmp_path / "tune.db"
    done = run_cli("tune", "--shapes", str(shapes), "--db", f"sqlite:///{database}", env=WIDE)
    assert done.returncode == 2
    assert expected in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not database.exists()


def test_a_problem_repeated_in_a_shapes_file_is_tuned_and_published_once(
        tmp_path: Path) -> None:
    tiny = Problem(batch=1, q_heads=1, kv_heads=1, q_len=128, kv_len=128, head_dim=64)
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text(yaml.safe_dump([tiny.to_dict(), {"batch": 1, "q_heads": 1, "q_len": 128,
                                                       "head_dim": 64}]))
    db = f"sqlite:///{tmp_path / 'tune.db'}"
    done = run_cli("tune", "--kernel", "flash", "--shapes", str(shapes), "--trials", "1",
                   "--db", db, "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    _, summaries = parse_json_lines(done.stdout)
    assert [s["problem"] for s in summaries] == [tiny.to_dict()]
    assert done.stderr.count("problem(s) 1 (= 0) repeat earlier ones") == 1


def _trial_states(db: str, study: str) -> list[tuple[str, Any]]:
    """Each trial's state and timing attribute: what a refused run must leave as it was."""
    return [(t.state.name, t.user_attrs.get("timing"))
            for t in optuna.load_study(study_name=study, storage=db).trials]


def test_a_study_name_of_another_problem_is_refused(tmp_path: Path,
                                                    tuned_pair: tuple[Path, str]) -> None:
    """``--study`` reused for another problem: exit 2 naming the fix, nothing measured or
    published for it, the first problem's study untouched."""
    db, shared = sqlite_copy(tuned_pair[0], tmp_path), _tiny_summary(tuned_pair)["study"]
    before = _trial_states(db, shared)  # the default and one more measured
    assert [state for state, _ in before].count("COMPLETE") == 2
    other = dataclasses.replace(TINY, q_heads=2, kv_heads=2)
    done = run_cli("tune", "--kernel", "flash", *problem_flags(other), "--trials", "3",
                   "--study", shared, "--db", db, timeout=300)
    assert done.returncode == 2, done.stderr
    assert f"study '{shared}' holds a search of another problem" in done.stderr
    study = optuna.load_study(study_name=shared, storage=db)
    assert _trial_states(db, shared) == before
    assert study.user_attrs["problem"] == TINY.to_dict()
    with Store(db) as store:
        found = store.lookup("flash", "cpu", other)
        assert found is None or found[1] != "exact"


def test_a_new_kernel_version_searches_again_in_a_study_of_its_own(
        tmp_path: Path, tuned_pair: tuple[Path, str]) -> None:
    """After a release bumps the kernel's version (a config may mean something else), a rerun
    searches in a new study, seeded with the old winner, instead of resuming the old version's
    study, whose budget is met, and publishing its trials under the new version."""
    db = sqlite_copy(tuned_pair[0], tmp_path)
    bumped = subprocess.run(  # the same install, its flash kernel at version 2
        [sys.executable, "-c", "import sys; from kernel import get_kernel; "
         "type(get_kernel('flash')).version = '2'; from autotune.cli import app; "
         "sys.argv = ['autotune', *sys.argv[1:]]; app()", *TINY_TUNE_FLAGS, "--trials",
         "2", "--db", db], capture_output=True, text=True, timeout=300)
    assert bumped.returncode == 0, bumped.stderr
    old, (trials, [new]) = _tiny_summary(tuned_pair), parse_json_lines(bumped.stdout)
    assert len(trials) == 2 and new["study"] != old["study"]
    assert any(trial["config"].items() <= old["best_config"].items() for trial in trials)
    assert optuna.load_study(study_name=new["study"], storage=db).user_attrs[
        "kernel_version"] == "2"
    with Store(db) as store:
        entries, _ = store.list(limit=None)
    assert {(e.result.kernel_version, e.result.study) for e in entries
            if e.result.problem == TINY} == {(FLASH.version, old["study"]), ("2", new["study"])}


def test_a_tune_prints_no_optuna_log_and_a_forward_result_no_backward_fields(
        tmp_path: Path) -> None:
    """Issue 46 item 11: Optuna's ``A new study created`` line is not ours to print, and a
    ``fwd`` result's config shows only the fields the forward uses."""
    db = f"sqlite:///{tmp_path / 'tune.db'}"
    done = run_cli("tune", "--kernel", "flash", *problem_flags(TINY), "--trials", "1", "--db",
                   db, env={"COLUMNS": "250"}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "A new study created" not in done.stdout + done.stderr
    [best] = [line for line in done.stdout.splitlines() if " best " in line]
    assert " depth" in best and "dkv" not in best and " dq" not in best, best


def test_a_study_name_of_another_timing_method_is_refused(
        tmp_path: Path, tuned_pair: tuple[Path, str]) -> None:
    """Times taken by another timing method are not comparable: ``--study`` reused with
    another ``--timing`` exits 2 naming it, and the study keeps only its own method's trials
    (the finished tune's, timed by wallclock, this CPU's default)."""
    db, mine = sqlite_copy(tuned_pair[0], tmp_path), _tiny_summary(tuned_pair)["study"]
    before = _trial_states(db, mine)
    done = run_cli(*TINY_TUNE_FLAGS, "--study", mine, "--db", db, "--trials", "3", "--timing",
                   "loop", timeout=300)
    assert done.returncode == 2, done.stderr
    assert f"study '{mine}' holds a search of another timing" in done.stderr
    assert _trial_states(db, mine) == before
    study = optuna.load_study(study_name=mine, storage=db)
    assert [t.user_attrs.get("timing") for t in study.trials
            if t.state == optuna.trial.TrialState.COMPLETE] == ["wallclock", "wallclock"]


@pytest.mark.parametrize("name", ["x" * 300, "a\tb"])
def test_a_study_name_that_cannot_be_stored_is_refused_before_searching(tmp_path: Path,
                                                                         name: str) -> None:
    """The study name is stored with the result: one it cannot hold exits 2 before any trial,
    not with a traceback after the whole search (nothing published)."""
    db = f"sqlite:///{tmp_path / 'tune.db'}"
    done = run_cli("tune", "--kernel", "flash", *problem_flags(TINY), "--trials", "1",
                   "--study", name, "--db", db, "--json", timeout=300)
    assert done.returncode == 2, done.stderr
    assert "study must be at most 256 characters" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not done.stdout.strip()


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_a_seed_numpy_refuses_is_refused_in_one_line_before_anything_runs(
        tmp_path: Path, seed: str) -> None:
    """Issue 62 item 7: ``--seed -1`` or a seed past 2**32 printed numpy's 74-line traceback
    after the setup; now it exits 2 naming --seed, as TuneOptions refuses it."""
    db = tmp_path / "tune.db"
    done = run_cli("tune", "--kernel", "flash", *problem_flags(TINY), "--trials", "1",
                   "--seed", seed, "--db", f"sqlite:///{db}", env=WIDE)
    assert done.returncode == 2, done.stderr
    [said] = [line for line in done.stderr.splitlines() if "seed" in line]
    assert f"Invalid value for --seed: seed must be None or an integer from 0 to 2**32 - 1 " \
           f"(the sampler's random seed), got {seed}" in said
    assert "Traceback" not in done.stderr and not db.exists()


def test_demo_on_a_database_holding_a_faster_result_checks_the_served_config(
        tmp_path: Path) -> None:
    """A database that already holds a faster result for the demo's problem keeps it
    (publish "kept"), and the service serves it: the demo checks the traced config against
    what is stored, not against this run's winner, and succeeds."""
    from autotune.commands.demo import DEMO_PROBLEM
    from storage import TunedResult, upgrade

    db = f"sqlite:///{tmp_path / 'demo.db'}"
    upgrade(db)
    default = FLASH.default_config(DEMO_PROBLEM, device_target("cpu", "cpu"))
    stored = default.replace(block_q=128, block_kv=128, block_kv_compute=128)
    with Store(db) as store:
        store.publish(TunedResult(device_kind="cpu", problem=DEMO_PROBLEM, config=stored,
                                  median_ms=MIN_TIME_MS, method="interpret"))
    done = run_cli("demo", "--trials", "2", "--db", db, env={"COLUMNS": "250"}, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stored: kept" in done.stdout and f"config {stored.label('fwd')}" in done.stdout
    # Issue 75 item 4: the winner printed is not the one served; the demo says why.
    assert f"the stored {stored.label('fwd')} (0.000 ms) stays, and is what the service " \
           "serves: this run's winner is not faster than it beyond the noise" in done.stdout


def test_a_rerun_that_keeps_the_stored_entry_keeps_its_study_confirmation(
        tmp_path: Path, tuned_pair: tuple[Path, str]) -> None:
    """The stored entry names its study, whose confirmation marks the stored winner (the
    report's and the pages' plots show it): a rerun of that study whose winner loses to the
    entry ("kept") leaves that confirmation as it was."""
    db = sqlite_copy(tuned_pair[0], tmp_path)
    flags = [*TINY_TUNE_FLAGS, "--db", db]
    summary = _tiny_summary(tuned_pair)
    with Store(db) as store:  # the entry as if its run had timed it far faster, no spread
        (entry, _), = [store.lookup("flash", "cpu", TINY)]
        # With the first run's IQR kept, the rerun (3 trials to 2) won as better measured
        # whenever its median fell inside that IQR with a tighter one of its own: a first run
        # timed on a loaded CPU (IQR of milliseconds) and a quieter rerun replaced the entry.
        store.publish(dataclasses.replace(entry.result, median_ms=MIN_TIME_MS, iqr_ms=0.0),
                      force=True)
    study = optuna.load_study(study_name=summary["study"], storage=db)
    confirmed = study.user_attrs["confirmation"]
    rerun = run_cli(*flags, "--trials", "3", timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    trials, [resumed] = parse_json_lines(rerun.stdout)
    assert len(trials) == 1 and resumed["measured"] == 3  # more trials resume the search
    assert resumed["publish"] == "kept"
    study = optuna.load_study(study_name=summary["study"], storage=db)
    assert study.user_attrs["confirmation"] == confirmed


def test_the_progress_counts_the_study_wide_budget_on_a_resume(tmp_path: Path) -> None:
    """``--trials`` is study-wide, so the bar's count is too: a resume to 3 of a study that
    measured 2 ends at 3 of 3, not 1 of 3. Its "x vs default" uses the default's time the
    first run measured, which the resume does not measure again."""
    from autotune.progress import TuneProgress
    from autotune.tune import TuneOptions, tune
    from storage import upgrade

    class Recording(TuneProgress):
        def on_trial(self, result, best, default_ms) -> None:  # noqa: ANN001
            self.defaults.append(default_ms)
            super().on_trial(result, best, default_ms)

    db = f"sqlite:///{tmp_path / 'tune.db'}"
    upgrade(db)
    runs = []
    with Store(db) as store:
        for trials in (2, 3):
            with Recording(TINY, trials) as progress:
                progress.defaults = []
                summary = tune(TINY, store, db, TuneOptions(trials=trials), observer=progress,
                               kernel_name="flash")
            assert progress.measured == summary.measured == trials
            runs.append(progress.defaults)
    first, resume = runs
    assert len(first) == 2 and len(resume) == 1
    assert first[0] is not None and resume == [first[0]]


def test_the_progress_shows_trials_per_minute_and_the_time_left() -> None:
    from autotune.progress import TuneProgress

    progress = TuneProgress(TINY, 10)
    assert "trials/min" not in progress._status(None, None)  # no pace before a trial
    progress._pace.start -= 60  # three trials in the last minute, seven to go
    for _ in range(3):
        progress._pace.tick()
    progress.measured = 3
    assert "3.0 trials/min, ~2.3 min left" in progress._status(None, None)


def test_timing_that_cannot_time_here_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """An unknown method, and the retired ``profile`` (the named kernels only): exit 2 with
    the way out, and nothing published."""
    db = f"sqlite:///{tmp_path / 'tune.db'}"
    flags = ["--batch", "1", "--q-heads", "1", "--q-len", "256", "--head-dim", "128",
             "--dtype", "float32", "--trials", "2", "--db", db]
    unknown = run_cli("tune", *flags, "--timing", "stopwatch", env=WIDE)
    assert unknown.returncode == 2
    assert ("unknown timing method 'stopwatch'; choose one of auto, step_profile, loop, "
            "wallclock") in unknown.stderr
    profile = run_cli("tune", *flags, "--timing", "profile", env=WIDE, timeout=300)
    assert profile.returncode == 2, profile.stderr
    assert ("'profile' (retired: it timed the named kernels only, not the whole step); "
            "choose one of auto, step_profile") in profile.stderr
    assert "Traceback" not in profile.stderr + profile.stdout
    assert not (tmp_path / "tune.db").exists()  # refused before anything was written


# --- failure classes, in process ---


@pytest.fixture(scope="module")
def tiny_base() -> FlashConfig:
    """The default config of TINY with a 128 compute block, so both kv blocks are legal."""
    return FLASH.default_config(TINY, "cpu").replace(
        block_kv_compute=128)


def _trace_time_failure(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    raise ValueError("injected: block shape rejected while tracing")


def _device_fault(x: Any) -> Any:
    raise RuntimeError("injected: kernel fault while running")


def _faulty_run(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return jax.pure_callback(_device_fault, jax.ShapeDtypeStruct(q.shape, q.dtype), q)


# (block_q, block_kv, pipeline_depth) -> what its build does; other combinations are illegal.
BEHAVIOUR = {(128, 128, 1): Status.COMPILE_ERROR, (128, 256, 1): Status.RUNTIME_ERROR,
             (256, 128, 1): Status.WRONG_RESULT, (256, 256, 1): Status.VMEM_OOM,
             (256, 256, 2): Status.OK}


def _faulty_build(problem: Problem, config: FlashConfig) -> Any:
    """The measured function of ``config``, failing as BEHAVIOUR says (for real: the VMEM OOM
    comes from compiling for a deviceless v5e with a 256 KiB scoped VMEM limit)."""
    behaviour = BEHAVIOUR[(config.block_q, config.block_kv, config.pipeline_depth)]
    if behaviour == Status.COMPILE_ERROR:
        return _trace_time_failure
    if behaviour == Status.RUNTIME_ERROR:
        return _faulty_run
    if behaviour == Status.WRONG_RESULT:  # a plausible kernel bug: masks a non-causal problem
        return FLASH.build(Problem.from_dict({**problem.to_dict(), "causal": True}), config)
    if behaviour == Status.VMEM_OOM:
        compile_for_target(FLASH, problem, config, "v5e",
                           compiler_options={"xla_tpu_scoped_vmem_limit_kib": 256})
    return FLASH.build(problem, config)


def _trials_by_status(study: optuna.Study) -> dict[str, list[optuna.trial.FrozenTrial]]:
    out: dict[str, list[optuna.trial.FrozenTrial]] = {}
    for trial in study.get_trials(deepcopy=False):
        out.setdefault(trial.user_attrs.get("status"), []).append(trial)
    return out


def test_every_failure_class_is_kept_on_its_trial_and_the_study_goes_on(
        tiny_base: FlashConfig) -> None:
    space = Space({"block_q": [128, 256], "block_kv": [128, 256], "pipeline_depth": [1, 2]},
                  lambda c: (c["block_q"], c["block_kv"], c["pipeline_depth"]) in BEHAVIOUR)
    storage = optuna.storages.InMemoryStorage()
    measurer = Measurer(TINY, tiny_base, FLASH, build=_faulty_build, min_time_s=0.01)
    try:
        result = search(space, measurer, storage=storage, study_name="failures",
                        sampler="grid", trials=10)
    finally:
        measurer.close()
    assert result.stop_reason == "exhausted"  # every legal config measured, none crashed
    assert result.measured == len(BEHAVIOUR)
    study = optuna.load_study(study_name="failures", storage=storage)
    by_status = _trials_by_status(study)
    for key, status in BEHAVIOUR.items():
        [trial] = [t for t in by_status[status]
                   if (t.params["block_q"], t.params["block_kv"], t.params["pipeline_depth"])
                   == key]
        if status == Status.OK:
            assert trial.state == optuna.trial.TrialState.COMPLETE and trial.value > 0
            assert trial.user_attrs["max_error"] < 2e-3
            continue
        assert trial.state == optuna.trial.TrialState.PRUNED and trial.value is None
        assert trial.user_attrs["error"], trial.user_attrs
    errors = {status: by_status[status][0].user_attrs["error"] for status in BEHAVIOUR.values()
              if status != Status.OK}
    assert "block shape rejected while tracing" in errors[Status.COMPILE_ERROR]
    assert "CompileTimeScopedVmemOom" in errors[Status.VMEM_OOM]
    assert "CpuCallback error" in errors[Status.RUNTIME_ERROR]
    assert "over tolerance" in errors[Status.WRONG_RESULT]
    # Compiled failures say how long the compile took; a build that never compiled cannot.
    assert by_status[Status.WRONG_RESULT][0].user_attrs["compile_s"] > 0
    assert result.best is not None and result.best.config == {
        "block_q": 256, "block_kv": 256, "pipeline_depth": 2}


# The "chip" every run of _stateful_build reads: a config at pipeline depth 1 gives its own
# result right and then leaves it corrupt, as depth 4 did on a v5e (pallas-facts §10).
_CHIP = {"offset": 0.0}


def _reads_chip(out: Any) -> Any:
    return np.asarray(out + _CHIP["offset"], out.dtype)


def _corrupts_chip(out: Any) -> Any:
    result = _reads_chip(out)
    _CHIP["offset"] = 1.0
    return result


def _stateful_build(problem: Problem, config: FlashConfig) -> Any:
    attend = FLASH.build(problem, config)
    hook = _corrupts_chip if config.pipeline_depth == 1 else _reads_chip

    def run(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        out = attend(q, k, v)
        return jax.pure_callback(hook, jax.ShapeDtypeStruct(out.shape, out.dtype), out)
    return run


def test_a_config_that_corrupts_the_chip_is_caught_by_the_canary_and_ends_the_search(
        tiny_base: FlashConfig) -> None:
    space = Space({"block_q": [128, 256], "pipeline_depth": [1, 2]})
    storage = optuna.storages.InMemoryStorage()
    _CHIP["offset"] = 0.0
    measurer = Measurer(TINY, tiny_base, FLASH, build=_stateful_build, min_time_s=0.01)
    try:
        with pytest.raises(ChipStateCorrupted, match="run the same command again"):
            search(space, measurer, storage=storage, study_name="canary", sampler="grid",
                   trials=4)
    finally:
        measurer.close()
    corrupting = _trials_by_status(optuna.load_study(study_name="canary", storage=storage))[
        Status.CORRUPTS_STATE]
    # Its own result was right: the canary, not the gate, caught it, right after it ran.
    assert [t.params["pipeline_depth"] for t in corrupting] == [1]
    assert "changed since the search began" in corrupting[0].user_attrs["error"]


def test_a_chip_left_corrupt_by_the_end_of_the_confirmation_publishes_nothing(
        tiny_base: FlashConfig) -> None:
    """Issue 54: the canary runs once more after the confirmation. A config that passed the
    search and the confirmation's gate but corrupts the device while it is timed there raises
    ChipStateCorrupted instead of handing the confirmed times on to be published."""
    runs = {"count": 0, "corrupt_at": math.inf}

    def corrupts_late(out: Any) -> Any:
        runs["count"] += 1
        if runs["count"] >= runs["corrupt_at"]:
            _CHIP["offset"] = 1.0
        return _reads_chip(out)

    def build(problem: Problem, config: FlashConfig) -> Any:
        attend = FLASH.build(problem, config)
        hook = corrupts_late if config.block_q == 128 else _reads_chip
        return lambda q, k, v: jax.pure_callback(
            hook, jax.ShapeDtypeStruct(q.shape, q.dtype), attend(q, k, v))

    _CHIP["offset"] = 0.0
    late = tiny_base.replace(block_q=128)
    measurer = Measurer(TINY, tiny_base, FLASH, build=build, min_time_s=0.01)
    try:
        assert measurer({}).ok and measurer({"block_q": 128}).ok
        assert len(measurer.confirm([tiny_base, late], rounds=1)) == 2  # a clean chip
        runs["corrupt_at"] = runs["count"] + 2  # past the gate's run: its first timed run
        with pytest.raises(ChipStateCorrupted, match="after the confirmation of 2 configs"):
            measurer.confirm([tiny_base, late], rounds=2)
    finally:
        _CHIP["offset"] = 0.0
        measurer.close()


def test_a_default_that_is_not_bit_reproducible_is_no_canary(tiny_base: FlashConfig) -> None:
    """A kernel whose two runs differ (atomics on a GPU) would make every config look like a
    corruption: its default is no canary, and the search goes on."""
    runs = iter(range(1000))

    def jittery(out: Any) -> Any:
        return np.asarray(out + next(runs) * 1e-7, out.dtype)

    def build(problem: Problem, config: FlashConfig) -> Any:
        attend = FLASH.build(problem, config)
        return lambda q, k, v: jax.pure_callback(
            jittery, jax.ShapeDtypeStruct(q.shape, q.dtype), attend(q, k, v))

    measurer = Measurer(TINY, tiny_base, FLASH, build=build, min_time_s=0.01)
    try:
        assert all(measurer({"block_q": q}).ok for q in (128, 256))
        assert measurer._canary_taken and measurer._canary is None
    finally:
        measurer.close()


def test_the_confirmation_runs_the_kept_programs_of_the_fastest_configs(
        tiny_base: FlashConfig) -> None:
    """The fastest measured configs' compiled programs (and the default's, the canary's) are
    kept for the confirmation: it compiles nothing again; at most ``keep_best`` are held."""
    builds: list[FlashConfig] = []

    def counted(problem: Problem, config: FlashConfig) -> Any:
        builds.append(config)
        return FLASH.build(problem, config)

    # Three configs other than the default, so the kept ones and the default are distinct.
    configs = [config for q in (128, 256) for d in (1, 2)
               if (config := tiny_base.replace(block_q=q, pipeline_depth=d)) != tiny_base]
    assert len(configs) == 3
    measurer = Measurer(TINY, tiny_base, FLASH, build=counted, min_time_s=0.01, keep_best=2)
    try:
        for config in configs:
            assert measurer({"block_q": config.block_q,
                             "pipeline_depth": config.pipeline_depth}).ok
        assert len(measurer._kept) == 2
        built = len(builds)
        timings = measurer.confirm([tiny_base, *measurer._kept], rounds=1)
    finally:
        measurer.close()
    assert len(timings) == 3 and len(builds) == built


def test_vmem_oom_from_the_real_compiler_is_classified(tiny_base: FlashConfig) -> None:
    limit_kib = 256
    assert FLASH.is_legal(TINY, tiny_base, "v5e")  # the rules accept it at the real limit
    with pytest.raises(Exception) as raised:
        compile_for_target(FLASH, TINY, tiny_base, "v5e",
                           compiler_options={"xla_tpu_scoped_vmem_limit_kib": limit_kib})
    assert classify_compile_error(str(raised.value)) == Status.VMEM_OOM
    # The same config compiles under the real limit: the failure is the VMEM limit, nothing else.
    assert compile_for_target(FLASH, TINY, tiny_base, "v5e") > 0


def test_compile_timeout_is_a_failed_trial(tiny_base: FlashConfig) -> None:
    space = Space({"block_q": [256]})
    measurer = Measurer(TINY, tiny_base, FLASH, compile_timeout_s=0.01)
    try:
        result = search(space, measurer, sampler="grid", trials=1)
    finally:
        measurer.close()
    [trial] = result.trials
    assert trial.measurement.status == Status.TIMEOUT
    assert "compile took longer than 0.01 s" in trial.measurement.attrs["error"]
    assert result.best is None and result.stop_reason == "budget"


def test_a_hung_compile_does_not_time_out_the_configs_after_it(tiny_base: FlashConfig) -> None:
    """A compile that overruns its limit keeps its thread (threads cannot be interrupted); the
    next config must still get a compile slot instead of queueing behind it and timing out."""
    from kernel import reference_attention

    release = threading.Event()

    def build(problem: Problem, config: FlashConfig) -> Any:
        if config.block_q == 128:
            release.wait(timeout=120)  # stands in for a compiler that does not return
        return reference_attention  # passes the gate, compiles in about a second

    measurer = Measurer(TINY, tiny_base, FLASH, build=build, pool_size=1, compile_timeout_s=4,
                             min_runs=1, min_time_s=0.0)
    try:
        result = search(Space({"block_q": [128, 256]}), measurer, sampler="grid", trials=2)
    finally:
        release.set()
        measurer.close()
    assert [(t.config["block_q"], t.measurement.status) for t in result.trials] == [
        (128, Status.TIMEOUT), (256, Status.OK)]


def test_illegal_configs_never_reach_the_measurer() -> None:
    """Plain Optuna TPE proposes illegal configs (a compute block larger than its kv block);
    the engine must record them as ``illegal`` without measuring them."""
    device = jax.devices()[0]
    target = device_target(device.platform, device.device_kind)
    space, base = kernel_space(FLASH, TINY, target)
    # The XLA reference passes the correctness gate and is the same program for every config
    # (compiled once), so the study can measure the whole legal space cheaply; plain TPE
    # proposes many illegal configs on the way.
    from kernel import reference_attention

    measurer = Measurer(TINY, base, FLASH, build=lambda p, c: reference_attention,
                             min_runs=1, min_time_s=0.0)
    seen: list[FlashConfig] = []

    def counting(params: dict[str, Any]) -> Measurement:
        seen.append(measurer.config(params))
        return measurer(params)

    legal = [c for c in space.configs() if space.is_legal(c)]
    storage = optuna.storages.InMemoryStorage()
    try:
        result = search(space, counting, storage=storage, study_name="illegal",
                        sampler="plain-tpe", trials=len(legal), seed=0)
    finally:
        measurer.close()
    assert result.measured == len(legal) == len(seen) == len(set(seen))
    assert all(FLASH.is_legal(TINY, config, target)
               for config in seen)
    study = optuna.load_study(study_name="illegal", storage=storage)
    illegal = _trials_by_status(study).get("illegal", [])
    assert illegal, "plain TPE proposed no illegal config; the test space is too easy"
    assert all(not space.is_legal(t.params) for t in illegal)


# --- confirmation ---


def _timing(*samples: float) -> Timing:
    return Timing(tuple(samples))


@pytest.fixture
def configs() -> tuple[FlashConfig, FlashConfig]:
    default = FlashConfig(block_q=256, block_kv=256, block_kv_compute=256)
    return default, default.replace(block_q=128)


def test_winner_within_noise_keeps_the_default(configs: tuple[FlashConfig, ...]) -> None:
    default, candidate = configs
    timings = {default: _timing(1.00, 1.02, 0.98, 1.01, 0.99),
               candidate: _timing(0.99, 1.01, 0.97, 1.00, 0.98)}  # 1% faster: below the floor
    assert choose_winner(timings, default) == default
    noisy = {default: _timing(1.0, 1.4, 0.8, 1.2, 0.9),  # IQR 0.4 ms
             candidate: _timing(0.8, 0.85, 0.75, 0.8, 0.8)}  # 0.2 ms faster: inside the IQR
    assert choose_winner(noisy, default) == default


def test_clearly_faster_candidate_wins(configs: tuple[FlashConfig, ...]) -> None:
    default, candidate = configs
    timings = {default: _timing(1.00, 1.02, 0.98, 1.01, 0.99),
               candidate: _timing(0.50, 0.51, 0.49, 0.50, 0.52)}
    assert choose_winner(timings, default) == candidate
    slower = {default: timings[default], candidate: _timing(2.0, 2.1, 1.9, 2.0, 2.0)}
    assert choose_winner(slower, default) == default


def test_confirmation_leaves_out_configs_that_fail_here(tiny_base: FlashConfig) -> None:
    """A default that fails on the device (wrong result, or no compile) is never published:
    confirmation times only working configs, and then the fastest of them wins."""
    from kernel import reference_attention

    wrong, broken, good = (tiny_base, tiny_base.replace(block_q=128),
                           tiny_base.replace(block_kv=128))
    builds = {wrong: lambda q, k, v: q, broken: _trace_time_failure,
              good: lambda q, k, v: reference_attention(q, k, v)}
    measurer = Measurer(TINY, tiny_base, FLASH, build=lambda problem, config: builds[config])
    try:
        timings = measurer.confirm([wrong, broken, good], rounds=3)
    finally:
        measurer.close()
    assert list(timings) == [good] and len(timings[good].samples_ms) == 3
    assert choose_winner(timings, wrong) == good


def test_shapes_that_are_not_text_and_a_database_password_are_named_safely(
        tmp_path: Path) -> None:
    shapes = tmp_path / "shapes.yaml"
    shapes.write_bytes(b"\xff\xfe- batch: 1\n")
    done = run_cli("tune", "--shapes", str(shapes), "--kernel", "xla")
    message = " ".join(done.stderr.replace("│", " ").split())  # unwrap rich's error panel
    assert done.returncode == 2 and "is not UTF-8 text (byte 0)" in message, message
    assert "Traceback" not in done.stderr
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"schema_version": 1, "kernel": "flash", "kernel_version": "1",
                                 "device_kind": "cpu", "entries": []}))
    for db, shown in (("postgresql+psycopg://tuner:hunter2@127.0.0.1:1/autotune",
                       "tuner:***@127.0.0.1:1"),  # issue 75 item 11h: and in the query
                      ("postgresql+psycopg://tuner@127.0.0.1:1/autotune?password=hunter2",
                       "autotune?password=***")):
        for args in (["tune", *problem_flags(TINY), "--kernel", "xla"], ["db", "upgrade"],
                     ["import", str(table)]):
            done = run_cli(*args, "--db", db)
            assert done.returncode in (1, 2) and shown in done.stderr, (args, done.stderr)
            assert "hunter2" not in done.stderr


def test_a_problem_larger_than_the_device_is_refused_with_its_size(tmp_path: Path) -> None:
    """Issue 55 item 13: a captured 1M-token, 64-batch problem was allocated (512 GiB) and
    recorded as a runtime error; its operands are checked against the device's memory
    first, and the problem is refused naming both sizes, before anything is allocated."""
    from autotune.choice import choose_kernel
    from autotune.tune import TuneOptions, tune
    from kernel import ConfigError
    from storage import upgrade

    huge = Problem(batch=1024, q_heads=64, kv_heads=8, q_len=1 << 20, kv_len=1 << 20,
                   head_dim=128)  # q 16 TiB, k and v 2 TiB each: inputs and 3 outputs
    db = f"sqlite:///{tmp_path / 'tune.db'}"
    upgrade(db)
    with Store(db) as store:
        with pytest.raises(ConfigError, match=r"needs 69,632\.00 GiB on the device \(inputs "
                                              r"20,480\.00, expected outputs 16,384\.00"):
            tune(huge, store, db, TuneOptions(trials=1), kernel_name="flash")
        with pytest.raises(ConfigError, match=r"GiB on the device .* the cpu device has"):
            choose_kernel(huge, store, db, ["flash", "xla"], TuneOptions(trials=1))
        assert store.list(limit=None)[1] == 0


def test_nothing_to_publish_says_what_was_confirmed(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 55 item 13: a problem whose every config failed said "the default and the best
    3 measured" when none (or one) was measured."""
    from autotune.tune import NothingToPublish, TuneOptions, tune
    from storage import upgrade

    monkeypatch.setattr(Measurer, "prepare", lambda self, params: None)
    monkeypatch.setattr(Measurer, "__call__", lambda self, params: Measurement.failure(
        Status.RUNTIME_ERROR, error="broken"))
    monkeypatch.setattr(Measurer, "confirm", lambda self, configs, rounds: {})
    db = f"sqlite:///{tmp_path / 'tune.db'}"
    upgrade(db)
    with Store(db) as store, pytest.raises(NothingToPublish) as error:
        tune(TINY, store, db, TuneOptions(trials=1), kernel_name="flash")
    assert "(the default; none of the 1 measured passed)" in str(error.value)
    assert error.value.failures == {Status.RUNTIME_ERROR: 1}


def test_a_rerun_of_a_finished_tune_measures_and_publishes_nothing(
        tmp_path: Path, tuned_pair: tuple[Path, str]) -> None:
    """Issue 55 item 2: the same ``autotune tune`` on the same database measured nothing new
    but confirmed the winner again and could replace it; a finished problem (its budget
    reached, nothing measured since its confirmation) is kept as it is; ``--force`` confirms
    it again. (That more trials then resume the search: the rerun of
    ``test_a_rerun_that_keeps_the_stored_entry_keeps_its_study_confirmation``.)"""
    db = sqlite_copy(tuned_pair[0], tmp_path)
    flags = [*TINY_TUNE_FLAGS, "--db", db]
    summary = _tiny_summary(tuned_pair)
    with Store(db) as store:
        (entry, _), = [store.lookup("flash", "cpu", TINY)]
    again = run_cli(*flags, "--trials", "2", timeout=300)
    assert again.returncode == 0, again.stderr
    assert [json.loads(line) for line in again.stdout.splitlines()] == [
        {"problem": TINY.to_dict(),
         "kept": "already tuned under the installed versions; kept (--force tunes it again)"}]
    with Store(db) as store:
        assert store.lookup("flash", "cpu", TINY) == (entry, "exact")
        assert store.history(entry.result.key) == []
    forced = run_cli(*flags, "--trials", "2", "--force", timeout=300)
    assert forced.returncode == 0, forced.stderr
    trials, [confirmed] = parse_json_lines(forced.stdout)
    assert trials == [] and confirmed["study"] == summary["study"]


def test_a_confirmation_again_replaces_the_entry_only_beyond_the_noise(
        sqlite_db_url: str) -> None:
    """Issue 55 item 2: a confirmation that times the same winner 1% faster within its
    spread replaced the published entry; ``beyond_noise`` (what the tuner publishes with)
    keeps it unless the new time beats it by more than both spreads and 1%."""
    from storage import TunedResult

    config = FLASH.default_config(TINY, device_target("cpu", "cpu"))
    stored = TunedResult(device_kind="cpu", problem=TINY, config=config, median_ms=1.0,
                         iqr_ms=0.1)
    with Store(sqlite_db_url) as store:
        store.publish(stored)
        close = dataclasses.replace(stored, median_ms=0.95, iqr_ms=0.02)
        assert store.publish(close, beyond_noise=True).status == "kept"
        assert store.publish(dataclasses.replace(close, median_ms=0.85),
                             beyond_noise=True).status == "replaced"
        assert store.publish(dataclasses.replace(close, median_ms=0.84)).status == "replaced"


def test_a_forced_confirmation_replaces_an_entry_timed_alike_only_beyond_the_noise(
        sqlite_db_url: str) -> None:
    """Issue 55 item 2: ``--force`` confirms a finished problem again, and replaced its
    entry whatever the times; an entry timed alike (same timing method and versions) is
    replaced only beyond the noise of both, one timed under other versions anyway."""
    from autotune.tune import TuneOptions, tune

    forced = TuneOptions(trials=1, confirm_rounds=2, force=True)
    with Store(sqlite_db_url) as store:
        tune(TINY, store, sqlite_db_url, forced, kernel_name="xla")
        (entry, _), = [store.lookup("xla", "cpu", TINY)]
        fast = dataclasses.replace(entry.result, median_ms=MIN_TIME_MS, iqr_ms=0.0)
        store.publish(fast, force=True)  # as if its confirmation had timed it far faster
        assert tune(TINY, store, sqlite_db_url, forced, kernel_name="xla").publish == "kept"
        assert store.lookup("xla", "cpu", TINY)[0].result == fast
        store.publish(dataclasses.replace(fast, jax_version="0.4.1"), force=True)
        assert tune(TINY, store, sqlite_db_url, forced, kernel_name="xla").publish == \
            "replaced"
        assert store.lookup("xla", "cpu", TINY)[0].result.median_ms > MIN_TIME_MS


def test_the_default_is_compiled_once_for_the_canary_and_its_trial(
        tiny_base: FlashConfig) -> None:
    """The default's program, compiled for the canary, is the one its trial measures: a search
    that starts with the default compiled it twice (seconds a config on a TPU)."""
    builds: list[FlashConfig] = []

    def counted(problem: Problem, config: FlashConfig) -> Any:
        builds.append(config)
        return FLASH.build(problem, config)

    measurer = Measurer(TINY, tiny_base, FLASH, build=counted, min_time_s=0.01)
    try:
        measurer.prepare({})  # as the search does when it claims the default
        assert measurer({}).ok
        assert measurer({"pipeline_depth": 1}).ok
        measurer.confirm([tiny_base], rounds=1)
    finally:
        measurer.close()
    assert builds == [tiny_base, tiny_base.replace(pipeline_depth=1)]


def test_the_gate_and_the_canary_compare_on_the_device_as_in_float64() -> None:
    """The gate's error and the canary's comparison reduce on the device (three scalars or
    one boolean come back, not model-sized outputs) and agree with float64 on the host."""
    key_a, key_b = jax.random.split(jax.random.key(0))
    want = (jax.random.normal(key_a, (2, 64, 32), jax.numpy.bfloat16),
            jax.random.normal(key_b, (2, 64, 32), jax.numpy.float32))
    got = (want[0] * 1.01, want[1] + 1e-3)
    host = relative_error([np.asarray(x) for x in got], [np.asarray(x) for x in want])
    assert relative_error(got, want) == pytest.approx(host, rel=1e-6) and host > 1e-4
    assert relative_error((got[0].at[1, 2, 3].set(np.nan), got[1]), want) == float("inf")
    nan = want[0].at[0, 0, 0].set(np.nan)
    assert same_bits((nan, want[1]), (nan, want[1]))  # bit for bit, a NaN included
    assert not same_bits(want, (want[0], want[1].at[1, 1, 1].add(1e-6)))
    zeros = jax.numpy.zeros(3)
    assert not same_bits(zeros, -zeros)  # equal as numbers, not bit for bit


def test_configs_claimed_ahead_follow_the_sampler_and_the_hosts_share() -> None:
    """A learning sampler claims AHEAD (more cost it quality); random and grid claim what
    the process's share of the host compiles at once: a thread per two cores, 2 GiB each."""
    from autotune.measure import AHEAD, claims_ahead

    gib = 2**30
    assert claims_ahead(True, cores=64, memory=512 * gib, workers=1) == AHEAD
    assert claims_ahead(False, cores=13, memory=40 * gib, workers=1) == 5  # a TPU v5e VM
    assert claims_ahead(False, cores=64, memory=8 * gib, workers=1) == 3  # memory bounds
    assert claims_ahead(False, cores=64, memory=512 * gib, workers=4) == 7  # --devices 4
    assert claims_ahead(False, cores=2, memory=8 * gib, workers=1) == AHEAD
    assert claims_ahead(False, cores=16, memory=None, workers=1) == 7


def test_the_devices_workers_share_the_hosts_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    from autotune.devices import HOST_WORKERS
    from autotune.measure import claims_ahead

    monkeypatch.setenv(HOST_WORKERS, "4")
    assert claims_ahead(False, cores=64, memory=2**40) == 7
    monkeypatch.setenv(HOST_WORKERS, "four")
    assert claims_ahead(False, cores=64, memory=2**40) == 31


@pytest.mark.parametrize(("sampler", "ahead"), [("random", 7), ("grid", 7), ("tpe", 2)])
def test_a_tune_compiles_as_many_ahead_as_its_sampler_and_host_allow(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sampler: str, ahead: int) -> None:
    from autotune.devices import HOST_WORKERS
    from autotune.tune import TuneJob, TuneOptions
    from storage import upgrade

    monkeypatch.setattr("os.cpu_count", lambda: 16)
    monkeypatch.setattr("autotune.measure.host_memory_bytes", lambda: 64 * 2**30)
    monkeypatch.delenv(HOST_WORKERS, raising=False)
    db = f"sqlite:///{tmp_path / 'tune.db'}"
    upgrade(db)
    with Store(db) as store:
        job = TuneJob(TINY, store, db, TuneOptions(trials=1, sampler=sampler),
                      kernel_name="flash")
        try:
            assert (job.ahead, job.measurer.pool_size) == (ahead, ahead + 1)
        finally:
            job.close()
