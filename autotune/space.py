"""A search space independent of any kernel: named parameters with ordered values, and a
legality predicate over whole configs.

The space also decides how Optuna sees each parameter. Numeric parameters are ordinal (an
integer range with a step, or a log range for powers of two), so TPE's Parzen estimator can
exploit neighbourhoods (64 is near 128); anything else is categorical. Optuna stores the real
values, so a dashboard shows ``block_q=512``, not an index.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

Config = dict[str, Any]
Key = tuple[Any, ...]

_RANDOM_TRIES = 2000  # rejection-sampling attempts before enumerating the legal set


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class _Param:
    """One parameter: its declared values (sorted when numeric) and its Optuna encoding."""

    name: str
    values: tuple[Any, ...]
    distribution: BaseDistribution
    log: bool  # numeric values projected to the nearest declared value in log scale

    @classmethod
    def build(cls, name: str, raw: Sequence[Any], ordinal: bool) -> _Param:
        values = tuple(raw)
        if not values:
            raise ValueError(f"parameter {name!r} has no values; declare at least one")
        if len(set(values)) != len(values):
            raise ValueError(f"parameter {name!r} repeats a value: {list(values)}")
        numeric = all(_is_number(v) for v in values)
        if len(values) == 1 or not (ordinal and numeric):
            for v in values:
                if not (v is None or isinstance(v, bool | int | float | str)):
                    raise ValueError(f"parameter {name!r}: value {v!r} is not a bool, number, "
                                     "string or None")
            return cls(name, values, CategoricalDistribution(values), False)
        values = tuple(sorted(values))
        low, high = values[0], values[-1]
        steps = {b - a for a, b in itertools.pairwise(values)}
        integral = all(isinstance(v, int) for v in values)
        if integral and len(steps) == 1:
            return cls(name, values, IntDistribution(low, high, step=steps.pop()), False)
        log = low > 0
        dist = IntDistribution(low, high, log=log) if integral else FloatDistribution(
            low, high, log=log)
        return cls(name, values, dist, log)

    def nearest(self, x: Any) -> Any:
        """The declared value nearest to a sampled one (exact for categorical values)."""
        if isinstance(self.distribution, CategoricalDistribution):
            return x
        scale = math.log if self.log else float
        return min(self.values, key=lambda v: abs(scale(v) - scale(x)))


class Space:
    """Named parameters, each with an ordered list of values, plus ``is_legal(config)``.

    ``ordinal=False`` makes every parameter categorical (how plain Optuna TPE sees a space).
    A config is a ``dict`` name -> value; configs compare by :meth:`key`.
    """

    def __init__(
        self,
        params: Mapping[str, Sequence[Any]],
        is_legal: Callable[[Config], bool] | None = None,
        *,
        ordinal: bool = True,
    ) -> None:
        if not params:
            raise ValueError("a search space needs at least one parameter")
        self._params = [_Param.build(name, values, ordinal) for name, values in params.items()]
        self._index = {p.name: p for p in self._params}
        self._is_legal = is_legal or (lambda config: True)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self._params]

    @property
    def params(self) -> dict[str, list[Any]]:
        """The declared values of each parameter (numeric ones sorted)."""
        return {p.name: list(p.values) for p in self._params}

    @property
    def size(self) -> int:
        """Number of combinations, legal or not."""
        return math.prod(len(p.values) for p in self._params)

    @property
    def distributions(self) -> dict[str, BaseDistribution]:
        return {p.name: p.distribution for p in self._params}

    def key(self, config: Mapping[str, Any]) -> Key:
        return tuple(config[name] for name in self.names)

    def contains(self, config: Mapping[str, Any]) -> bool:
        """Every parameter present with one of its declared values."""
        return all(p.name in config and config[p.name] in p.values for p in self._params)

    def is_legal(self, config: Mapping[str, Any]) -> bool:
        return self.contains(config) and bool(self._is_legal(dict(config)))

    def project(self, sampled: Mapping[str, Any]) -> Config:
        """The config of declared values nearest to Optuna-sampled ones (missing names take
        the first value: single-valued parameters are never sampled by TPE)."""
        return {p.name: p.nearest(sampled[p.name]) if p.name in sampled else p.values[0]
                for p in self._params}

    def configs(self) -> Iterator[Config]:
        """Every combination in lexicographic order of the declared values (legal or not)."""
        names = self.names
        for values in itertools.product(*(p.values for p in self._params)):
            yield dict(zip(names, values, strict=True))

    def random_legal(self, rng: random.Random, taken: set[Key]) -> Config | None:
        """A uniformly random legal config whose key is not in ``taken`` (None when none is
        left). Rejection sampling first; small legal fractions fall back to enumeration."""
        for _ in range(_RANDOM_TRIES):
            config = {p.name: rng.choice(p.values) for p in self._params}
            if self.key(config) not in taken and self.is_legal(config):
                return config
        left = [c for c in self.configs() if self.key(c) not in taken and self.is_legal(c)]
        return rng.choice(left) if left else None

    def neighbours(self, config: Mapping[str, Any]) -> list[Config]:
        """Configs one step away in one parameter's value list (legal or not)."""
        out = []
        for p in self._params:
            i = p.values.index(config[p.name])
            for j in (i - 1, i + 1):
                if 0 <= j < len(p.values):
                    out.append({**config, p.name: p.values[j]})
        return out
