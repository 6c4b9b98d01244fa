"""``autotune tune`` under failure and concurrency, in real subprocesses on real databases.

A job killed (SIGTERM, as a batch limit does) while it measures a config, started again,
resumes the same Optuna study: no finished trial is lost, no config is measured twice, and the
winner is published. Two jobs started together on the same empty database (SQLite file, and
PostgreSQL) and the same ``--study`` share one study-wide budget: both finish, neither reports
"database is locked", and every config is measured once.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest

from autotune.claims import CLAIM_WAIT_S
from storage.studies import NOT_MEASURED
from conftest import AUTOTUNE, problem_flags, run_cli
from kernel.problem import Problem
from storage import Store

TINY = Problem(batch=1, q_heads=1, kv_heads=1, q_len=256, kv_len=256, head_dim=128,
               dtype="float32", causal=False, mode="fwd")


def tune_args(db: str, study: str, trials: int) -> list[str]:
    return ["tune", "--kernel", "flash", *problem_flags(TINY), "--trials", str(trials), "--db", db,
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


def signal_mid_measurement(tmp_path: Path, study: str, trials: int, finished: int,
                           signum: int) -> tuple[str, Path, subprocess.Popen]:
    """Starts ``autotune tune`` on a new SQLite file and sends it ``signum`` once ``finished``
    trials are finished and another is being measured: (database URL, log, the ended job)."""
    db_file, log = tmp_path / "tune.db", tmp_path / "first.log"
    db = f"sqlite:///{db_file}"
    job = start(tune_args(db, study, trials), log)
    try:
        wait_mid_measurement(db_file, finished, job, log)
    finally:
        job.send_signal(signum)
        job.wait(timeout=120)
    return db, log, job


def test_a_kill_mid_study_then_a_rerun_resumes_and_fills_the_budget(tmp_path: Path) -> None:
    """Killed by SIGTERM, what batch limits send: the tune has no handler for it, so the job
    ends as under SIGKILL, running none of its code, and the rerun resumes it the same way."""
    study, trials, kill = "killed", 4, signal.SIGTERM
    db, _, first = signal_mid_measurement(tmp_path, study, trials, 2, kill)
    assert first.returncode == -kill
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
    # compile ahead) stayed RUNNING; their process is gone, so the rerun gave them back
    # (``orphan``) and measured in their place. Only a claim killed while it was being
    # created, before its ``process`` attr was written, cannot be told from a live one: it
    # stays RUNNING until the heartbeat's grace period, holding its config and slot if its
    # params and ``worker`` attr were written.
    running = optuna.load_study(study_name=study, storage=db).get_trials(
        deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    assert not [t for t in running if "process" in t.user_attrs], running
    names = next(iter(before.values())).params.keys()
    held = [t for t in running  # part of its params, or no worker attr: no slot
            if t.params.keys() >= names and "worker" in t.user_attrs]
    assert not {config_key(t) for t in held} & set(keys)
    assert len(after) + len(held) == trials
    [summary] = summaries(rerun.stdout)
    assert summary["study"] == study and summary["measured"] == len(after)

    with Store(db) as store:
        entry, match = store.lookup("flash", "cpu", TINY)
    assert match == "exact"
    assert entry.result.config.to_dict() == summary["best_config"]
    assert entry.result.study == study


def test_a_claim_whose_job_died_recording_it_is_given_back_on_a_rerun(tmp_path: Path) -> None:
    """Issue 75 item 11e: a tune killed by a full disk right after Optuna's ``ask`` (the seed's
    trial RUNNING with its params, but neither the claim's attrs nor its release written)
    held the seed and a slot of the budget on a rerun: ``--trials 3`` measured 2, never the
    seed. The job dies here at its first write of a trial's attr, as it did there."""
    db = f"sqlite:///{tmp_path / 'tune.db'}"
    dying = ("import os, sys, optuna.trial\n"
             "optuna.trial.Trial.set_user_attr = lambda *args: os._exit(3)\n"
             "from autotune.__main__ import main\n"
             "main()\n")
    died = subprocess.run([sys.executable, "-c", dying, *tune_args(db, "died", 3)],
                          capture_output=True, text=True, timeout=300)
    assert died.returncode == 3, died.stderr
    [claim] = optuna.load_study(study_name="died", storage=db).get_trials(
        deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    assert claim.user_attrs == {"seed": True} and claim.params
    time.sleep(CLAIM_WAIT_S)  # as old as a claim whose attrs never came
    rerun = run_cli(*tune_args(db, "died", 3), timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    measured = measured_trials(db, "died")
    assert len(measured) == 3
    assert any(t.user_attrs.get("seed") and t.params == claim.params for t in measured)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def fresh_db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database (no tables at all): both jobs create the schema as they start."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tune.db'}"
    return request.getfixturevalue("postgres_databases")()


def test_two_jobs_share_one_study(fresh_db: str, tmp_path: Path) -> None:
    study, trials = "shared", 8  # long enough that the later-starting job joins (CI is loaded)
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


def test_ctrl_c_says_how_to_resume_and_releases_the_job_claims(tmp_path: Path) -> None:
    study, trials = "ctrl-c", 3
    db, log, job = signal_mid_measurement(tmp_path, study, trials, 1, signal.SIGINT)
    assert job.returncode == 130
    output = log.read_text()
    assert "Traceback" not in output
    said = [line for line in output.splitlines() if "interrupt" in line.lower()]
    assert len(said) == 1 and said[0] == output.splitlines()[-1], output[-3000:]
    assert f"resume study '{study}'" in said[0]
    loaded = optuna.load_study(study_name=study, storage=db).get_trials(deepcopy=False)
    assert not [t for t in loaded if t.state == optuna.trial.TrialState.RUNNING]
    released = [t for t in loaded if t.user_attrs.get("status") == "interrupted"]
    assert released and all(t.state == optuna.trial.TrialState.FAIL for t in released)
    before = measured_trials(db, study)

    rerun = run_cli(*tune_args(db, study, trials), timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    after = measured_trials(db, study)
    keys = [config_key(t) for t in after]
    assert len(after) == trials == len(set(keys))  # the released slots were measured now
    assert {t.number for t in before} <= {t.number for t in after}


@pytest.mark.postgres
def test_kill_9_during_confirmation_then_publish_leaves_nothing_half_written(
        postgres_databases: Any, tmp_path: Path) -> None:
    """The first job is killed while it confirms, the second while its publishing transaction
    has locked the stored entry and waits (on a lock this test holds) to archive it; the third
    publishes. The stored entry changes only with that third job, whole."""
    from sqlalchemy import create_engine, text

    from kernel.registry import get_kernel
    from storage import TunedResult, normalize_url, upgrade

    db, study, trials = postgres_databases(), "killed-late", 3
    upgrade(db)
    slow = TunedResult(device_kind="cpu", problem=TINY, median_ms=1e6, method="interpret",
                       config=get_kernel("flash").default_config(TINY))
    with Store(db) as store:
        store.publish(slow)
    locker = create_engine(normalize_url(db))
    held, watch = locker.connect(), locker.connect().execution_options(
        isolation_level="AUTOCOMMIT")  # pg_stat_activity is fixed for a transaction
    held.execute(text("LOCK TABLE autotune_config_history IN ACCESS EXCLUSIVE MODE"))
    try:
        confirming = start(tune_args(db, study, trials), tmp_path / "confirming.log")
        try:
            while len([line for line in (tmp_path / "confirming.log").read_text().splitlines()
                       if line.startswith('{"problem"')]) < trials:
                assert confirming.poll() is None, (tmp_path / "confirming.log").read_text()
                time.sleep(0.05)
        finally:
            confirming.send_signal(signal.SIGKILL)
            confirming.wait()
        publishing = start(tune_args(db, study, trials), tmp_path / "publishing.log")
        try:
            while not watch.execute(text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND datname = current_database()")).scalar():
                assert publishing.poll() is None, (tmp_path / "publishing.log").read_text()
                time.sleep(0.05)
        finally:
            publishing.send_signal(signal.SIGKILL)
            publishing.wait()
    finally:
        held.rollback()
        held.close()
        watch.close()
        locker.dispose()
    with Store(db) as store:
        entry, _ = store.lookup("flash", "cpu", TINY)
        assert entry.result.median_ms == slow.median_ms and not store.history(entry.result.key)
    # The publishing job recorded its study whole (confirmation included) before publishing,
    # so no entry ever names a study without its confirmation.
    assert optuna.load_study(study_name=study, storage=db).user_attrs["confirmation"]

    done = run_cli(*tune_args(db, study, trials), timeout=300)
    assert done.returncode == 0, done.stderr
    [summary] = summaries(done.stdout)
    assert summary["publish"] == "replaced" and summary["measured"] == trials
    with Store(db) as store:
        entry, _ = store.lookup("flash", "cpu", TINY)
        assert entry.result.config.to_dict() == summary["best_config"]
        assert entry.result.median_ms == summary["best_time_ms"]
        [archived] = store.history(entry.result.key)
    assert (archived.reason, archived.result.median_ms) == ("replaced", slow.median_ms)
    confirmed = optuna.load_study(study_name=study, storage=db).user_attrs["confirmation"]
    assert [c["config"] for c in confirmed if c["is_winner"]] == [summary["best_config"]]
