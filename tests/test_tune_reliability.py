"""``autotune tune`` under failure and concurrency, in real subprocesses on real databases.

A job killed with SIGKILL while it measures a config, started again, resumes the same Optuna
study: no finished trial is lost, no config is measured twice, and the winner is published. Two jobs
started together on the same empty database (SQLite file, and PostgreSQL) and the same
``--study`` share one study-wide budget: both finish, neither reports "database is locked",
and every config is measured once.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import optuna
import pytest

from storage.studies import NOT_MEASURED
from conftest import AUTOTUNE, problem_flags, run_cli
from kernel.problem import Problem
from storage import Store

TINY = Problem(batch=1, q_heads=1, kv_heads=1, q_len=256, kv_len=256, head_dim=128,
               dtype="float32", causal=False, mode="fwd")


def tune_args(db: str, study: str, trials: int) -> list[str]:
    return ["tune", *problem_flags(TINY), "--trials", str(trials), "--db", db,
            "--study", study, "--json"]


def start(args: list[str], log: Path) -> subprocess.Popen:
    """``autotune ARGS`` in the background, stdout and stderr to ``log``."""
    with log.open("w") as sink:
        return subprocess.Popen([*AUTOTUNE, *args], stdout=sink, stderr=subprocess.STDOUT)


def measured_trials(db: str, study: str) -> list[optuna.trial.FrozenTrial]:
    """The study's finished measurements (not illegal/duplicate/surplus bookkeeping trials)."""
    loaded = optuna.load_study(study_name=study, storage=db)
    return [t for t in loaded.get_trials(deepcopy=False) if t.state.is_finished()
            and t.state != optuna.trial.TrialState.FAIL
            and t.user_attrs.get("status") not in NOT_MEASURED]


def config_key(trial: optuna.trial.FrozenTrial) -> str:
    return json.dumps(trial.params, sort_keys=True)


def summaries(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines()
            if line.startswith("{") and json.loads(line).get("summary")]


def wait_mid_measurement(db_file: Path, finished: int, process: subprocess.Popen, log: Path,
                         timeout: float = 180) -> None:
    """Polls the SQLite file (read-only, plain sqlite3, so the poller never creates or migrates
    tables under the job) until ``finished`` trials are finished and another one is running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the job ended early:\n{log.read_text()}"
        try:
            with sqlite3.connect(f"file:{db_file}?mode=ro", uri=True, timeout=5) as connection:
                states = dict(connection.execute(
                    "SELECT state, count(*) FROM trials GROUP BY state").fetchall())
            if states.get("COMPLETE", 0) + states.get("PRUNED", 0) >= finished and states.get(
                    "RUNNING", 0):
                return
        except sqlite3.OperationalError:  # no database or no trials table yet
            pass
        time.sleep(0.1)
    pytest.fail(f"no trial running after {finished} finished within {timeout} s:\n"
                f"{log.read_text()}")


def test_kill_9_mid_study_then_rerun_resumes(tmp_path: Path) -> None:
    db_file = tmp_path / "tune.db"
    db, study, trials = f"sqlite:///{db_file}", "killed", 5
    log = tmp_path / "first.log"
    first = start(tune_args(db, study, trials), log)
    try:
        wait_mid_measurement(db_file, 2, first, log)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL
    before = {t.number: t for t in measured_trials(db, study)}
    assert len(before) >= 2

    rerun = run_cli(*tune_args(db, study, trials), timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    after = measured_trials(db, study)
    keys = [config_key(t) for t in after]
    assert len(keys) == len(set(keys)), f"a config was measured twice: {sorted(keys)}"
    by_number = {t.number: t for t in after}
    for number, trial in before.items():  # every finished trial survived, unchanged
        assert by_number[number].params == trial.params
        assert by_number[number].value == trial.value
        assert by_number[number].user_attrs["status"] == trial.user_attrs["status"]
    rerun_lines = [json.loads(line) for line in rerun.stdout.splitlines()
                   if line.startswith("{") and "trial" in json.loads(line)]
    assert rerun_lines, "the rerun measured nothing: it did not resume the study"
    assert {json.dumps(line["config"], sort_keys=True) for line in rerun_lines}.isdisjoint(
        config_key(t) for t in before.values())
    # The killed job's claims (the config it was measuring, and the next one it had claimed to
    # compile ahead) stay RUNNING until their heartbeat is older than the grace period
    # (storage.studies.get_storage); until then they hold their configs and slots of the budget.
    running = optuna.load_study(study_name=study, storage=db).get_trials(
        deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    assert 1 <= len(running) <= 2
    assert not {config_key(t) for t in running} & set(keys)
    assert len(after) + len(running) == trials
    [summary] = summaries(rerun.stdout)
    assert summary["study"] == study and summary["measured"] == len(after)

    with Store(db) as store:
        entry, match = store.lookup("flash", "cpu", TINY)
    assert match == "exact"
    assert entry.result.config.to_dict() == summary["best_config"]
    assert entry.result.study == study


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def fresh_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database (no tables at all): both jobs create the schema as they start."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tune.db'}"
    return request.getfixturevalue("postgres_databases")()


def test_two_jobs_share_one_study(fresh_db: str, tmp_path: Path) -> None:
    study, trials = "shared", 5
    logs = [tmp_path / f"job{i}.log" for i in range(2)]
    jobs = [start(tune_args(fresh_db, study, trials), log) for log in logs]
    try:
        for job in jobs:
            job.wait(timeout=300)
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
                job.wait()
    outputs = [log.read_text() for log in logs]
    for job, output in zip(jobs, outputs, strict=True):
        assert job.returncode == 0, output
        assert "database is locked" not in output
        assert "Traceback" not in output
    measured = measured_trials(fresh_db, study)
    keys = [config_key(t) for t in measured]
    assert len(keys) == len(set(keys)), f"a config was measured twice: {sorted(keys)}"
    assert len(measured) == trials  # the budget is study-wide, not per job
    assert len({t.user_attrs["worker"] for t in measured}) == 2  # both jobs measured
    done = [summaries(output) for output in outputs]
    # Each job reports the study's measurements when its search stopped (the other job's last
    # trial may still have been running then).
    assert all(len(s) == 1 and 1 <= s[0]["measured"] <= trials for s in done)
    assert {s[0]["publish"] for s in done} <= {"inserted", "replaced", "kept"}
    with Store(fresh_db) as store:
        entry, match = store.lookup("flash", "cpu", TINY)
    assert match == "exact" and entry.result.study == study
    assert entry.result.config.to_dict() in [s[0]["best_config"] for s in done]
