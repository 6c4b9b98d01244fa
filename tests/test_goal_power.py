"""``bench/search/goal_power.py``: how often one run meets issue 17's goal, for searchers of known
strength. The counting on made-up scores, then the script end to end on small landscapes."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from types import ModuleType

import pytest

from tests.test_bench_search import _landscapes
from tests.test_kernel_tuner_landscape import ROOT, _python

SCRIPT = ROOT / "bench/search/goal_power.py"


@pytest.fixture(scope="module")
def goal_power() -> ModuleType:
    spec = importlib.util.spec_from_file_location("goal_power", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _noisy(seeds: int, budgets: list[int], rng: random.Random, landscapes: int = 2) -> dict:
    """Landscapes whose score per seed is uniform in [0.5, 1], each budget drawn apart."""
    return {f"land{i}": {b: [rng.uniform(0.5, 1.0) for _ in range(seeds)] for b in budgets}
            for i in range(landscapes)}


def _power(goal_power: ModuleType, candidate: dict, baseline: dict, factor: float = 1.0, *,
           same_seeds: bool = True, tolerance: float = 0.0) -> dict:
    return goal_power.power(candidate, baseline, [10], factor, seeds=40, run=10, draws=200,
                            same_seeds=same_seeds, tolerance=tolerance, rng=random.Random(1))


def test_the_baseline_itself_on_the_same_seeds_meets_the_goal_in_every_run(
        goal_power: ModuleType) -> None:
    """Ties meet the goal ("at least"): every run of the baseline against itself passes."""
    scores = _noisy(40, [10], random.Random(0))
    assert _power(goal_power, scores, scores)["met"] == 1.0


def test_the_baseline_on_other_seeds_rarely_meets_it(goal_power: ModuleType) -> None:
    """An equal searcher on other seeds is short in each of the 18 statistics (six landscapes)
    about half the time: about 9 short per run, and seldom none."""
    scores = _noisy(40, [10], random.Random(0), landscapes=6)
    row = _power(goal_power, scores, scores, same_seeds=False)
    assert row["met"] < 0.05
    assert 6 <= row["short_median"] <= 12
    assert set(row["most_often_short"]) <= {f"land{i}@10 {stat}" for i in range(6)
                                             for stat in ("median", "mean", "p10")}


def test_the_candidate_is_read_at_factor_times_the_budget(goal_power: ModuleType) -> None:
    """A candidate worse than the baseline at B but better at 2B fails at 1x and passes at 2x."""
    rng = random.Random(0)
    baseline = _noisy(40, [10], rng)
    candidate = {name: {10: [s - 0.2 for s in row[10]], 20: [s + 0.2 for s in row[10]]}
                 for name, row in baseline.items()}
    assert _power(goal_power, candidate, baseline, 1.0)["met"] == 0.0
    assert _power(goal_power, candidate, baseline, 2.0)["met"] == 1.0


def test_a_shortfall_within_the_tolerance_meets_the_goal(goal_power: ModuleType) -> None:
    baseline = _noisy(40, [10], random.Random(0))
    candidate = {name: {10: [s - 0.001 for s in row[10]]} for name, row in baseline.items()}
    assert _power(goal_power, candidate, baseline)["met"] == 0.0
    assert _power(goal_power, candidate, baseline, tolerance=0.002)["met"] == 1.0


def test_the_script_reports_both_candidates_at_every_factor(tmp_path: Path) -> None:
    done = _python(str(SCRIPT), str(_landscapes(tmp_path / "lands")), "--seeds", "4", "--run",
                   "2", "--draws", "20", "--budgets", "3", "--factors", "2,1", "--jobs", "1",
                   "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    for label in ("plain TPE", "ours"):
        rows = report["power"][label]
        assert [row["factor"] for row in rows] == [1.0, 2.0]
        assert all(0.0 <= row["met"] <= 1.0 for row in rows)


@pytest.mark.parametrize(("args", "expected"), [
    (("--seeds", "30"), "--seeds 30 cannot hold two disjoint runs of --run 20; pass --seeds 40"),
    (("--factors", "0.5,1"), "argument --factors: 0.5 is below 1"),
    (("--factors", "1,x"), "argument --factors: '1,x' is not a list of numbers"),
])
def test_bad_arguments_are_refused_in_one_line(tmp_path: Path, args: tuple[str, ...],
                                               expected: str) -> None:
    done = _python(str(SCRIPT), str(_landscapes(tmp_path / "lands")), *args, timeout=120)
    assert done.returncode == 2
    assert expected in done.stderr and "Traceback" not in done.stderr, done.stderr
