"""Patience (issue 63 item 3): ``--patience 10`` stops a tune after 10 measured configs without
a faster one, says so, and counts as finished for a rerun; without it (the default, off: why,
docs/tuning.md) a tune measures all its trials. Real tunes of the flash kernel on this machine's CPU (interpret mode),
each on a study whose first configs are written into its SQLite file, so where its best lies is
known: one measured for real (the default), then one far faster than anything a CPU runs, then
``PATIENCE - 1`` slower ones."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from autotune.tune import TuneOptions, kernel_space, tune
from conftest import problem_flags, run_cli
from kernel import Problem, device_target, get_kernel
from storage import Store, upgrade

TINY = Problem(batch=1, q_heads=1, kv_heads=1, q_len=256, kv_len=256, head_dim=128,
               dtype="float32", causal=False, mode="fwd")  # 24 legal flash configs
STUDY = "patience"
PATIENCE = 10  # what docs/tuning.md suggests on a chip whose defaults were tuned
WIDE = {"COLUMNS": "400"}  # Rich wraps error boxes at the terminal width (80 in a pipe)


def _study_with_an_early_best(tmp_path: Path) -> str:
    """A database whose study ``STUDY`` holds the default measured (by a real one-trial tune)
    and after it a config timed 1e-6 ms, then ``PATIENCE - 1`` timed 1e6 ms: the next
    config measured is the PATIENCE-th without a faster one. Its URL."""
    db = f"sqlite:///{tmp_path / 'tune.db'}"
    upgrade(db)
    with Store(db) as store:
        tune(TINY, store, db, TuneOptions(trials=1, study=STUDY),
             kernel_name="flash")
    space, base = kernel_space(get_kernel("flash").discover(), TINY, device_target("cpu", "cpu"))
    default = tuple(getattr(base, name) for name in space.names)
    others = [c for c in space.legal_configs() if space.key(c) != default]
    study = optuna.load_study(study_name=STUDY, storage=db)
    for number, config in enumerate(others[:PATIENCE]):
        study.add_trial(optuna.trial.create_trial(
            params=dict(config), distributions=space.distributions,
            value=1e-6 if number == 0 else 1e6, user_attrs={"status": "ok"}))
    return db


def _json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def test_a_tune_with_patience_stops_after_ten_configs_without_a_faster_one_and_stays_finished(
        tmp_path: Path) -> None:
    """``autotune tune --trials 30 --patience 10`` stops once 10 measured configs brought none
    faster than the best, with ``stop_reason`` ``patience``, and the same command again keeps
    it, measuring nothing (before, it confirmed the winner again: the study had not reached
    --trials)."""
    db = _study_with_an_early_best(tmp_path)
    command = ["tune", "--kernel", "flash", *problem_flags(TINY), "--trials", "30",
               "--patience", str(PATIENCE), "--study", STUDY, "--db", db, "--json"]
    done = run_cli(*command, timeout=300)
    assert done.returncode == 0, done.stderr
    *trials, summary = _json_lines(done.stdout)
    assert len(trials) == 1, trials  # the 10th after the best
    assert (summary["stop_reason"], summary["patience"], summary["measured"]) == (
        "patience", PATIENCE, 2 + PATIENCE)
    again = run_cli(*command, timeout=300)
    assert again.returncode == 0, again.stderr
    assert _json_lines(again.stdout) == [
        {"problem": TINY.to_dict(),
         "kept": "already tuned under the installed versions; kept (--force tunes it again)"}]


def test_a_default_tune_measures_all_its_trials(tmp_path: Path) -> None:
    """Patience is off by default: the study above, where ``--patience 10`` stops at once, is
    searched to its budget."""
    db = _study_with_an_early_best(tmp_path)
    trials = 4 + PATIENCE
    done = run_cli("tune", "--kernel", "flash", *problem_flags(TINY), "--trials", str(trials),
                   "--study", STUDY, "--db", db, "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    *measured, summary = _json_lines(done.stdout)
    assert len(measured) == 3
    assert (summary["stop_reason"], summary["patience"], summary["measured"]) == (
        "budget", None, trials)


@pytest.mark.parametrize(("patience", "refusal"), [
    ("0", "greater than or equal to 1"), ("-1", "greater than or equal to 1"),
    ("1.5", "Input should be a valid integer")])
def test_the_cli_refuses_a_patience_that_is_no_count_in_one_line(
        tmp_path: Path, patience: str, refusal: str) -> None:
    """``--patience 0``: exit 2, one line naming the option and what it takes, before the
    database is opened."""
    done = run_cli("tune", "--kernel", "flash", *problem_flags(TINY), "--patience", patience,
                   "--db", f"sqlite:///{tmp_path / 'never.db'}", env=WIDE, timeout=60)
    assert done.returncode == 2
    [line] = [line for line in done.stderr.splitlines() if "Invalid value" in line]
    assert "--patience" in line and refusal in line, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "never.db").exists()
