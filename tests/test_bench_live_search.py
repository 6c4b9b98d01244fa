"""``bench/live_search.py``: each searcher run for real in its own study (here flash
interpreted on a CPU), resumed where a time limit cut it, and scored against the best config
any run measured."""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_kernel_tuner_landscape import ROOT, _python

SCRIPT = str(ROOT / "bench" / "live_search.py")
PROBLEM = ("--", "--batch", "1", "--q-heads", "2", "--q-len", "256", "--head-dim", "64",
           "--causal", "--mode", "fwd_bwd")


def test_every_sampler_runs_in_its_own_study_and_is_scored(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'live.db'}"
    common = ("--db", db, "--kernel", "flash", "--seeds", "1")
    done = _python(SCRIPT, "run", *common, "--trials", "3", *PROBLEM, timeout=600)
    assert done.returncode == 0, done.stderr
    ran = done.stdout.splitlines()
    assert ran == [f"live-flash-{s}-0: exit 0, 3 measured" for s in ("tpe", "plain-tpe", "random")]
    again = _python(SCRIPT, "run", *common, "--trials", "3", *PROBLEM, timeout=600)
    assert again.returncode == 0 and again.stdout == "", again.stdout  # all finished: nothing
    scored = _python(SCRIPT, "score", *common, "--budgets", "1,3", timeout=300)
    assert scored.returncode == 0, scored.stderr
    report = json.loads(scored.stdout)
    assert report["seeds"] == [0] and report["configs_measured"] >= 3
    for budget in ("1", "3"):
        for stats in report["budgets"][budget]["scores"].values():
            assert 0 < stats["median"] <= 1  # against the best any run measured
    assert set(report["budgets"]["3"]["ours_minus"]) == {"plain TPE", "random"}


def test_scoring_before_any_run_says_what_to_do(tmp_path: Path) -> None:
    done = _python(SCRIPT, "score", "--db", f"sqlite:///{tmp_path / 'none.db'}", "--kernel",
                   "flash", timeout=120)
    assert done.returncode == 1
    assert "run `run` first" in done.stderr and "Traceback" not in done.stderr
