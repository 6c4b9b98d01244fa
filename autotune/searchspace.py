"""A search space independent of any kernel: named parameters with ordered values, and a
legality predicate over whole configs.

Optuna sees every parameter as categorical, with the real values as choices (a dashboard shows
``block_q=512``). Measured on the landscapes (bench/search/replay.py), TPE did worse with numeric
parameters made ordinal (integer or log ranges): tile sizes are rugged, 32 can win while 48 and
64 lose, so neighbourhood smoothing misleads the Parzen estimator more than it helps.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from optuna.distributions import CategoricalDistribution

Config = dict[str, Any]
Key = tuple[Any, ...]

_RANDOM_TRIES = 2000  # rejection-sampling attempts before enumerating the legal set
ENUMERATE_MAX = 200_000  # combinations up to which ``legal_configs`` lists the legal set


class Space:
    """Named parameters, each with an ordered list of values, plus ``is_legal(config)``.

    A config is a ``dict`` name -> value; configs compare by :meth:`key`, the key of their
    canonical form (``canonical``: the values a config takes where some parameters leave others
    unused; identity by default), so the search measures each config once whatever an unused
    parameter was drawn as, and such a parameter does not shrink its branch of the space.
    """

    def __init__(
        self, params: Mapping[str, Sequence[Any]], is_legal: Callable[[Config], bool] | None = None,
        *, legal: Iterable[Key] | None = None,
        canonical: Callable[[Config], Config] | None = None,
    ) -> None:
        """``legal``: the keys of every legal config, where they are known as a list (a measured
        landscape's records): then ``is_legal`` is membership, and drawing or listing legal
        configs walks that list, never the product of the values (a sparse landscape may
        declare 1e10 combinations for a few records)."""
        if not params:
            raise ValueError("a search space needs at least one parameter")
        for name, values in params.items():
            if not values:
                raise ValueError(f"parameter {name!r} has no values; declare at least one")
            if len(set(values)) != len(values):
                raise ValueError(f"parameter {name!r} repeats a value: {list(values)}")
            for v in values:
                if not (v is None or isinstance(v, bool | int | float | str)):
                    raise ValueError(f"parameter {name!r}: value {v!r} is not a bool, number, "
                                     "string or None")
        self._values = {name: tuple(values) for name, values in params.items()}
        self._distributions = {name: CategoricalDistribution(values)
                               for name, values in self._values.items()}
        self._is_legal = is_legal or (lambda config: True)
        self._canonical = canonical or (lambda config: config)
        self._legal: list[Config] | None = None
        if legal is not None:
            self._legal = [dict(zip(self._values, key, strict=True)) for key in sorted(
                set(legal), key=lambda k: tuple(map(tuple.index, self._values.values(), k)))]
            keys = {self.key(config) for config in self._legal}
            self._is_legal = lambda config: self.key(config) in keys

    @property
    def names(self) -> list[str]:
        return list(self._values)

    @property
    def params(self) -> dict[str, list[Any]]:
        """The declared values of each parameter."""
        return {name: list(values) for name, values in self._values.items()}

    @property
    def size(self) -> int:
        """Number of combinations, legal or not."""
        return math.prod(len(values) for values in self._values.values())

    @property
    def distributions(self) -> dict[str, CategoricalDistribution]:
        return dict(self._distributions)

    def key(self, config: Mapping[str, Any]) -> Key:
        canonical = self.config(config)
        return tuple(canonical[name] for name in self.names)

    def contains(self, config: Mapping[str, Any]) -> bool:
        """Every parameter present with one of its declared values."""
        return all(name in config and config[name] in values
                   for name, values in self._values.items())

    def is_legal(self, config: Mapping[str, Any]) -> bool:
        return self.contains(config) and bool(self._is_legal(self.config(config)))

    def config(self, params: Mapping[str, Any]) -> Config:
        """The canonical config of an Optuna trial's params, in declaration order."""
        return self._canonical({name: params[name] for name in self._values})

    def configs(self) -> Iterator[Config]:
        """Every combination in lexicographic order of the declared values (legal or not)."""
        names = self.names
        for values in itertools.product(*self._values.values()):
            yield dict(zip(names, values, strict=True))

    def legal_configs(self) -> list[Config] | None:
        """Every legal config in the order of :meth:`configs`, listed once per space; None for
        a space of more than ``ENUMERATE_MAX`` combinations (measured landscapes: 10k-83k;
        flash fwd_bwd: 373k), where listing them would take too long, unless ``legal`` gave
        them."""
        if self._legal is None and self.size > ENUMERATE_MAX:
            return None
        if self._legal is None:
            self._legal = list({self.key(c): self.config(c) for c in self.configs()
                                if self.is_legal(c)}.values())
        return self._legal

    def neighbours(self, config: Mapping[str, Any]) -> Iterator[Config]:
        """The legal configs one step from ``config``: one parameter changed, a numeric one to a
        value declared next to its own (tile sizes are declared in order) or to twice or half
        its value, any other one to each of its other values. Doubling and halving are steps
        because hardware resources divide by sizes: halving a block doubles the blocks that
        fit, so a size and its double often perform alike where the values between do not
        (pnpoly: the optimum's block 448 is half of a local optimum's 896)."""
        own = self.key(config)
        for name, values in self._values.items():
            current = config[name]
            i = values.index(current)
            if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
                others = [values[j] for j in (i - 1, i + 1) if 0 <= j < len(values)]
                others += [v for v in values  # 0 is its own double: not a step
                           if v in (current * 2, current / 2) and v != current
                           and v not in others]
            else:
                others = [v for v in values if v != current]
            for value in others:
                neighbour = self.config({**config, name: value})
                if self.key(neighbour) != own and self.is_legal(neighbour):
                    yield neighbour

    def random_legal(self, rng: random.Random, taken: set[Key]) -> Config | None:
        """A random legal config whose key is not in ``taken`` (None when none is left), each
        parameter drawn uniformly (a value it leaves unused made canonical after). Rejection
        sampling first; small legal fractions fall back to enumeration (uniform over configs)."""
        for _ in range(_RANDOM_TRIES):
            drawn = {name: rng.choice(values) for name, values in self._values.items()}
            config = self.config(drawn)
            if self.key(config) not in taken and self.is_legal(config):
                return config
        legal = self.legal_configs()
        if legal is None:  # too many to list once: one pass over the combinations
            legal = [self.config(c) for c in self.configs() if self.is_legal(c)]
        left = [c for c in legal if self.key(c) not in taken]
        return rng.choice(left) if left else None
