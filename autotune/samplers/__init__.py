"""The samplers of the search, one module each, behind one factory (:func:`create_sampler`).

- ``tpe`` (default): our searcher, plain TPE's proposals made free plus a forest surrogate
  (:mod:`autotune.samplers.engine`). Three proposals in five are what Optuna's plain
  ``TPESampler`` would ask next, but its illegal and already-measured proposals are answered in
  memory (pruned, or the measured outcome) instead of costing a trial
  (:mod:`autotune.samplers.plain_tpe`). The other two are the untaken legal config of lowest
  confidence bound under a random forest fitted to the measurements
  (:mod:`autotune.samplers.forest`): it exploits interactions (tile x vector width, flags that
  only pay together) that TPE's densities model poorly (TPE here is multivariate on every
  Optuna, and still stalls in the convolution landscapes' plateaus: plain TPE in
  bench/search/replay.py), while TPE keeps exploring. The mix was chosen on the measured landscapes
  (bench/search/replay.py, 20 seeds): forest-only and half-forest searches stall in the deceptive
  plateaus of the convolution landscapes (a flag whose typical configs are slow but whose best
  config is the optimum), a third of forest picks is too few to help on gemm; two in five did
  best overall. When ``RESTART_AFTER`` measured configs in a row bring no new best, the best
  config since the last restart is polished to a local optimum (its one-step neighbours
  measured, sizes also doubled and halved) and TPE's view starts afresh (its densities had
  settled in one basin), and warm-start seeds are measured first but modelled by neither TPE nor
  the forest (:class:`autotune.samplers.engine.EngineSampler`). Every variant of this mix that
  was measured, with its figures and why it was kept or rejected:
  ``bench/search/searcher-variants.md``.
- ``random``: uniformly random legal unmeasured configs.
- ``grid``: every legal config in lexicographic order of the declared values.
- ``plain-tpe``: the baseline, Optuna's ``TPESampler`` with Optuna 5's defaults on every
  Optuna (:func:`autotune.samplers.plain_tpe.tpe_sampler`) over one categorical per parameter;
  the search tells an illegal proposal as pruned and answers a repeated one from the study,
  both free.
"""

from __future__ import annotations

from typing import Literal

from optuna.samplers import BaseSampler

from autotune.samplers.engine import EngineSampler
from autotune.samplers.plain_tpe import tpe_sampler
from autotune.searchspace import Space

SamplerName = Literal["tpe", "random", "grid", "plain-tpe"]
SAMPLERS: tuple[str, ...] = ("tpe", "random", "grid", "plain-tpe")
# The samplers whose next config depends on the measured ones (random and grid pick theirs
# whatever was measured), so that claiming more ahead can cost them search quality.
LEARNING_SAMPLERS: tuple[str, ...] = ("tpe", "plain-tpe")


def create_sampler(name: str, space: Space, seed: int | None) -> BaseSampler:
    """The sampler ``name`` (one of :data:`SAMPLERS`) over ``space``."""
    if name == "plain-tpe":
        return tpe_sampler(seed)
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")
    return EngineSampler(space, name, seed)
