"""A random-forest surrogate over a space's legal configs (SMAC-style), used by the ``tpe``
searcher (:mod:`autotune.samplers.engine`) to pick which fresh legal config to measure next.

The acquisition function is evaluated on the legal configs themselves instead of being
optimised by local search, so the pick is always legal and never a repeat. A space of up to
200k combinations is enumerated (``Space.legal_configs``; the measured landscapes: 10k-83k
combinations, up to 18k legal); a larger one (flash fwd_bwd: 373k combinations, 116k legal;
jax_tpu_flash: 12M) is represented by a uniform random sample of 5k legal configs, drawn once
per search, which keeps the first pick under a second; TPE's picks still reach the rest.

Features: a numeric parameter is its value (log2 when its values are positive and span a factor
of 8 or more: tile sizes), scaled to [0, 1]; any other parameter is one-hot. The target is
log(time); a failed config counts as the worst time measured, so the forest learns to avoid the
regions that fail. The pick minimises a lower confidence bound: the mean of the trees'
predictions minus their spread. Measured on the landscapes inside the ``tpe`` mix, it beat
expected improvement, which spent its picks polishing the incumbent's basin (convolution-A100
score@50 0.875 vs 0.813, gemm score@100 1.000 vs 0.982; medians of 20 seeds). A spread weight
that grew with the configs measured since the last new best (1 to 2 at a restart) only moved
bad seeds between landscapes: bench/search/replay.py's summed median, mean and 10th percentile +0.25
and +0.18 on seeds 0-19 and 20-39 of the development landscapes, -0.16 on the held-out ones.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from functools import cached_property

import numpy as np

from autotune.searchspace import Config, Key, Space

_SAMPLED_CANDIDATES = 5_000
_TREES = 64
_EXPLORATION = 1.0  # spreads of the trees' predictions taken off their mean


class ForestSurrogate:
    """Fits a random forest to measured configs and ranks the untaken legal configs by a lower
    confidence bound on their time. ``seed`` makes the forest (and a sampled candidate set)
    reproducible."""

    def __init__(self, space: Space, seed: int | None = None) -> None:
        self._space = space
        self._rng = random.Random(seed)
        # Imported here, not at module level: the service's pages import autotune.search (trial
        # statuses) and its install (the `serve` extra) has no scikit-learn. Not at the first
        # pick either: that import takes seconds on a loaded machine, inside a claim whose
        # params are not yet written, long enough for other workers to take it for an orphan
        # (autotune.claims.conflict), so the claim would yield its config and be wasted.
        from sklearn.ensemble import RandomForestRegressor

        self._regressor = RandomForestRegressor

    @cached_property
    def _candidates(self) -> tuple[list[Config], list[Key], np.ndarray]:
        """The legal configs scored at each pick (enumerated or sampled, see module doc), their
        keys and their features; built at the first pick."""
        space = self._space
        configs = space.legal_configs()
        if configs is None:
            configs, taken = [], set()
            for _ in range(_SAMPLED_CANDIDATES):
                config = space.random_legal(self._rng, taken)
                if config is None:
                    break
                configs.append(config)
                taken.add(space.key(config))
        return configs, [space.key(c) for c in configs], self.encode(configs)

    def encode(self, configs: Sequence[Config]) -> np.ndarray:
        """One feature row per config (see module doc)."""
        columns: list[np.ndarray] = []
        for name, values in self._space.params.items():
            if len(values) < 2:
                continue
            column = [c[name] for c in configs]
            if all(isinstance(v, int | float) for v in values):  # bool is an int
                low, high = min(values), max(values)
                x = np.asarray(column, dtype=float)
                if low > 0 and high / low >= 8:
                    x, low, high = np.log2(x), math.log2(low), math.log2(high)
                columns.append((x - low) / (high - low))
            else:
                columns.extend(np.asarray([v == value for v in column], dtype=float)
                               for value in values)
        if not columns:
            return np.zeros((len(configs), 1))
        return np.stack(columns, axis=1)

    def propose(self, outcomes: Mapping[Key, float | None], taken: set[Key]) -> Config | None:
        """The untaken legal config of lowest confidence bound, given ``outcomes`` (config key
        -> time, None for a failure). None when every legal config is taken or nothing
        succeeded yet."""
        configs, keys, features = self._candidates
        names = self._space.names
        pairs = [(dict(zip(names, key, strict=True)), t) for key, t in outcomes.items()]
        times = [t for _, t in pairs if t is not None]
        free = [i for i, key in enumerate(keys) if key not in taken]
        if not times or not free:
            return None
        worst = math.log(max(times))
        x = self.encode([c for c, _ in pairs])
        y = np.asarray([worst if t is None else math.log(t) for _, t in pairs])
        forest = self._regressor(n_estimators=_TREES, max_features=0.8,
                                 random_state=self._rng.randrange(2**31))
        forest.fit(x, y)
        # Each tree's own predict validates its input again, which costs as much as the
        # prediction on a large candidate set: the trees' arrays are asked directly, with the
        # float32 rows the trees were fitted on (the same numbers).
        free_features = np.ascontiguousarray(features[free], dtype=np.float32)
        per_tree = np.stack([tree.tree_.predict(free_features)[:, 0]
                             for tree in forest.estimators_])
        bound = per_tree.mean(axis=0) - _EXPLORATION * per_tree.std(axis=0)
        return dict(configs[free[int(np.argmin(bound))]])
