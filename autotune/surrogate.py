"""A random-forest surrogate over a space's legal configs (SMAC-style), used by the ``tpe``
searcher to pick which fresh legal config to measure next.

The legal set of a tuning space is small enough to enumerate (the flash spaces hold hundreds of
configs, the measured landscapes up to 18k), so the acquisition function is evaluated on every
legal config not yet taken instead of being optimised by local search: the pick is always legal
and never a repeat. Spaces too large to enumerate are represented by a uniform random sample of
their legal configs.

Features: a numeric parameter is its value (log2 when its values are positive and span a factor
of 8 or more: tile sizes), scaled to [0, 1]; any other parameter is one-hot. The target is
log(time); a failed config counts as the worst time measured, so the forest learns to avoid the
regions that fail. Expected improvement uses the mean and spread of the trees' predictions.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

import numpy as np
from scipy.stats import norm
from sklearn.ensemble import RandomForestRegressor

from autotune.space import Config, Key, Space

_ENUMERATE_MAX = 1_000_000  # combinations above which the legal set is sampled, not enumerated
_SAMPLED_CANDIDATES = 20_000
_TREES = 64


class ForestSurrogate:
    """Fits a random forest to measured configs and ranks the untaken legal configs by
    expected improvement. ``seed`` makes the forest (and a sampled candidate set)
    reproducible."""

    def __init__(self, space: Space, seed: int | None = None) -> None:
        self._space = space
        self._rng = random.Random(seed)
        self._candidates: list[Config] | None = None
        self._features: np.ndarray | None = None
        self._index: dict[Key, int] = {}

    def _legal(self) -> list[Config]:
        space = self._space
        if space.size <= _ENUMERATE_MAX:
            return [c for c in space.configs() if space.is_legal(c)]
        taken: set[Key] = set()
        for _ in range(_SAMPLED_CANDIDATES):
            config = space.random_legal(self._rng, taken)
            if config is None:
                break
            taken.add(space.key(config))
        return [dict(zip(space.names, key, strict=True)) for key in taken]

    def _ensure_candidates(self) -> None:
        if self._candidates is not None:
            return
        self._candidates = self._legal()
        self._index = {self._space.key(c): i for i, c in enumerate(self._candidates)}
        self._features = self.encode(self._candidates)

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
        """The untaken legal config of highest expected improvement over the best time in
        ``outcomes`` (config key -> time, None for a failure). None when every legal config is
        taken or nothing succeeded yet."""
        self._ensure_candidates()
        assert self._candidates is not None and self._features is not None
        names = self._space.names
        pairs = [(dict(zip(names, key, strict=True)), t) for key, t in outcomes.items()]
        times = [t for _, t in pairs if t is not None]
        free = [i for i, c in enumerate(self._candidates) if self._space.key(c) not in taken]
        if not times or not free:
            return None
        worst = math.log(max(times))
        x = self.encode([c for c, _ in pairs])
        y = np.asarray([worst if t is None else math.log(t) for _, t in pairs])
        forest = RandomForestRegressor(n_estimators=_TREES, max_features=0.8,
                                       random_state=self._rng.randrange(2**31))
        forest.fit(x, y)
        cand = self._features[free]
        per_tree = np.stack([tree.predict(cand) for tree in forest.estimators_])
        mean, spread = per_tree.mean(axis=0), per_tree.std(axis=0) + 1e-9
        gain = math.log(min(times)) - mean
        z = gain / spread
        improvement = gain * norm.cdf(z) + spread * norm.pdf(z)
        return dict(self._candidates[free[int(np.argmax(improvement))]])
