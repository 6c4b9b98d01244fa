"""The random-forest surrogate of the ``tpe`` searcher: features, legality and untaken picks,
and that its pick is a good config, not an arbitrary one."""

from __future__ import annotations

import math
import random

import numpy as np
import optuna
import pytest

import autotune.samplers.forest as surrogate
import autotune.searchspace as searchspace
from autotune.samplers.forest import ForestSurrogate
from autotune.search import search
from autotune.searchspace import Space
from autotune.trials import Measurement

optuna.logging.set_verbosity(optuna.logging.WARNING)

PARAMS = {"tile": [8, 16, 32, 64, 128, 256], "unroll": [1, 2, 3, 4], "layout": ["row", "col"],
          "fixed": [7]}


def _legal(config) -> bool:
    return config["tile"] * config["unroll"] <= 512


def _time(config) -> float:
    """Best at tile 64, unroll 3, col; the layout only pays with a large unroll."""
    bonus = 0.6 if config["layout"] == "col" and config["unroll"] >= 3 else 0.0
    return 1.0 + (math.log2(config["tile"]) - 6) ** 2 + (config["unroll"] - 3) ** 2 - bonus


@pytest.fixture
def space():
    return Space(PARAMS, _legal)


def test_features_log_scale_wide_numbers_linear_narrow_one_hot_strings_drop_constants(space):
    rows = ForestSurrogate(space).encode([
        {"tile": 8, "unroll": 1, "layout": "row", "fixed": 7},
        {"tile": 64, "unroll": 4, "layout": "col", "fixed": 7},
    ])
    # tile: log2 8..256 -> 0 and 3/5; unroll: 1..4 linear -> 0 and 1; layout one-hot (row, col).
    np.testing.assert_allclose(rows, [[0.0, 0.0, 1.0, 0.0], [0.6, 1.0, 0.0, 1.0]])


def test_no_pick_before_a_success_or_when_everything_is_taken(space):
    forest = ForestSurrogate(space, seed=0)
    some = {space.key(c): None for c in space.configs() if _legal(c)}
    assert forest.propose({}, set()) is None
    assert forest.propose(dict(list(some.items())[:5]), set()) is None  # failures only
    everything = set(some)
    outcomes = {k: 1.0 for k in list(everything)[:3]}
    assert forest.propose(outcomes, everything) is None


def _measured(space, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    legal = [c for c in space.configs() if _legal(c)]
    return {space.key(c): _time(c) for c in rng.sample(legal, n)}


def test_picks_are_legal_untaken_and_find_the_optimum_early(space):
    legal = [c for c in space.configs() if _legal(c)]
    optimum = min(_time(c) for c in legal)
    for seed in range(3):
        outcomes = _measured(space, 8, seed)
        forest = ForestSurrogate(space, seed=seed)
        for _ in range(10):
            pick = forest.propose(outcomes, set(outcomes))
            assert pick is not None and _legal(pick) and space.key(pick) not in outcomes
            outcomes[space.key(pick)] = _time(pick)
        # 18 of the 44 legal configs: a random order holds the optimum 41% of the time.
        assert min(outcomes.values()) == optimum, seed


def test_failures_steer_the_pick_away_from_the_failing_region(space):
    outcomes = _measured(space, 12, 0)
    failing = {space.key(c): None for c in space.configs() if _legal(c) and c["tile"] == 64}
    taken = set(outcomes) | set(failing)
    pick = ForestSurrogate(space, seed=0).propose({**outcomes, **failing}, taken - set(failing))
    assert pick is not None and pick["tile"] != 64


def test_a_space_too_large_to_enumerate_is_sampled(space, monkeypatch):
    monkeypatch.setattr(searchspace, "ENUMERATE_MAX", 10)
    monkeypatch.setattr(surrogate, "_SAMPLED_CANDIDATES", 20)
    outcomes = _measured(space, 8, 1)
    pick = ForestSurrogate(space, seed=1).propose(outcomes, set(outcomes))
    assert pick is not None and _legal(pick) and space.key(pick) not in outcomes


def test_tpe_searcher_takes_two_forest_picks_in_five_after_five_measurements(space, monkeypatch):
    picks: list[dict] = []
    original = ForestSurrogate.propose

    def recording(self, outcomes, taken):
        pick = original(self, outcomes, taken)
        picks.append(pick)
        return pick

    monkeypatch.setattr(ForestSurrogate, "propose", recording)
    calls: list[tuple] = []

    def measure(config):
        calls.append(space.key(config))
        return Measurement(_time(config))

    result = search(space, measure, sampler="tpe", trials=16, seed=3)
    assert result.measured == 16 == len(set(calls))
    assert len(picks) == 5  # the proposals after 5, 6, 10, 11 and 15 measurements
    assert all(p is not None and space.key(p) in calls for p in picks)
