"""``bench/search/live_search.py``: each searcher run for real in its own study (here flash
interpreted on a CPU), resumed where a time limit cut it, and scored against the best config
any run measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.search import search
from autotune.searchspace import Space
from autotune.trials import Measurement
from bench.search import live_search
from bench.search.live_search import study_name
from bench.search.replay import SAMPLERS
from tests.test_kernel_tuner_landscape import ROOT, _python

SCRIPT = str(ROOT / "bench/search/live_search.py")
PROBLEM = ("--", "--batch", "1", "--q-heads", "1", "--q-len", "256", "--head-dim", "64",
           "--causal", "--mode", "fwd")  # forward only: an interpreted tune in half the time


def test_every_sampler_runs_in_its_own_study_and_is_scored(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``run`` and ``score`` called as the script calls them (its command line is
    test_scoring_before_any_run_says_what_to_do's); each tune a subprocess, as on a device."""
    db = f"sqlite:///{tmp_path / 'live.db'}"
    common = ("--db", db, "--kernel", "flash", "--seeds", "1")
    live_search.main(["run", *common, "--trials", "3", *PROBLEM])
    ran = capsys.readouterr().out.splitlines()
    assert ran == [f"live-flash-{s}-0: exit 0, 3 measured" for s in ("tpe", "plain-tpe", "random")]
    live_search.main(["run", *common, "--trials", "3", *PROBLEM])
    again = capsys.readouterr().out
    assert again == "", again  # all finished: nothing
    out = tmp_path / "score.json"
    live_search.main(["score", *common, "--budgets", "1,3", "--out", str(out)])
    report = json.loads(out.read_text())
    verdicts = capsys.readouterr().out.splitlines()[-2:]
    assert verdicts == [report["budgets"][b]["verdict"] for b in ("1", "3")]
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


def _scored(tmp_path: Path, capsys: pytest.CaptureFixture[str],
            warm_start: dict[str, int]) -> tuple[dict, list[str]]:
    """The score report and its two verdict lines (budgets 1 and 6) of every sampler's
    seed-0 study, searched for real by the search engine (6 configs) over a 64-config space
    timed ``block_q + block_kv`` ms, starting from ``warm_start`` as tune does."""
    db = f"sqlite:///{tmp_path / 'live.db'}"
    space = Space({"block_q": list(range(1, 9)), "block_kv": list(range(1, 9))})
    for sampler in SAMPLERS.values():
        search(space, lambda c: Measurement(float(c["block_q"] + c["block_kv"])), storage=db,
               study_name=study_name("flash", sampler, 0), sampler=sampler, trials=6,
               seeds=[warm_start], seed=0)
    report = live_search.main(["score", "--db", db, "--kernel", "flash", "--seeds", "1",
                               "--budgets", "1,6"])
    return report, capsys.readouterr().out.splitlines()[-2:]


def test_a_warm_start_that_holds_the_best_makes_the_searcher_choice_moot(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report, verdicts = _scored(tmp_path, capsys, {"block_q": 1, "block_kv": 1})  # 2 ms: fastest
    for stats in report["budgets"][6]["scores"].values():
        assert stats["median"] == 1  # every searcher the same: the scores tell nothing
    for beyond in report["budgets"][6]["beyond_seeds"].values():
        assert beyond["seeds_best_ms"] == [2.0] and beyond["own_beat_seeds"] == 0
        assert beyond["own_best_ms"][0] > 2 and beyond["ratio"][0] < 1
    assert report["budgets"][1]["beyond_seeds"]["ours"]["own_best_ms"] == [None]
    assert verdicts == [f"{b} trials: the seeds held the best in 1 of 1 seeds for every "
                        f"searcher: the searcher choice is moot at {b} trials here"
                        for b in (1, 6)]


def test_own_proposals_that_beat_the_warm_start_are_counted_with_their_gain(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report, verdicts = _scored(tmp_path, capsys, {"block_q": 8, "block_kv": 8})  # 16 ms: slowest
    for beyond in report["budgets"][6]["beyond_seeds"].values():
        assert beyond["seeds_best_ms"] == [16.0] and beyond["own_beat_seeds"] == 1
        assert beyond["ratio"] == [16 / beyond["own_best_ms"][0]] and beyond["ratio"][0] > 1
    assert verdicts[1].startswith("6 trials: own proposals beat the seeds' best in ours 1 of 1")
