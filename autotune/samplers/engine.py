"""The engine sampler: proposes legal configs the study has not taken (``tpe``, ``random``,
``grid``; see :mod:`autotune.samplers`)."""

from __future__ import annotations

import random
from collections.abc import Iterable

from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial

from autotune.samplers.forest import ForestSurrogate
from autotune.samplers.plain_tpe import STALL, PlainTPEView
from autotune.searchspace import Config, Key, Space
from autotune.trials import LIVE, OK, SEED_ATTR, is_measurement, trial_status

FOREST_PICKS, FOREST_CYCLE = 2, 5  # ``tpe``: two proposals in five are the forest's
FOREST_AFTER = 5  # measured configs before the forest's first pick
RESTART_AFTER = 30  # measured configs in a row without a new best before TPE starts afresh


class EngineSampler(BaseSampler):
    """Proposes legal configs the study has not taken: ``tpe``, ``random`` or ``grid``.

    ``tpe``: after ``FOREST_AFTER`` measurements, ``FOREST_PICKS`` proposals in every
    ``FOREST_CYCLE`` are the forest surrogate's; the others are plain TPE's
    (:class:`PlainTPEView`). When TPE has no fresh proposal, a uniformly random legal one is
    taken. ``exhausted`` says that the last trial found no legal config left.

    Two rules keep one unlucky start from deciding the whole search:

    - **Restarts.** TPE's densities follow its best configs, so once it settles in a basin
      its proposals stay there, and a basin that is not the optimum's holds it for the whole
      budget (convolution-A100: 3 seeds in 20 kept 0.64-0.68 of the optimum for 200
      configs). After ``RESTART_AFTER`` measured configs in a row without a new best (counted
      from the later of the last new best and the last restart), the search first polishes
      the best config measured since the last restart: it measures its untaken neighbours
      (:meth:`Space.neighbours`), following any new best, until that config is a local
      optimum, so each basin the search leaves is left at its best (pnpoly: the optimum is one
      flag away from configs within 1% of it, and half the block of a local optimum;
      convolution-A100: the basin a restart finds is often not the first one's). Then TPE's
      view is rebuilt empty with a new seed: it samples its own random start again and models
      what the search measures from then on, the forest's picks included. The forest keeps
      the whole history, and nothing is measured twice. ``restarts`` counts them. The escapes
      come through the forest's picks: a restarted view that modelled only its own proposals
      kept 0.685 of convolution-A100's optimum at 200 configs in the 10th percentile, against
      0.931. A Latin-hypercube start in place of TPE's random one (what Kernel Tuner's
      diff_evo measures at these budgets: its population outnumbers them) did worse too
      (bench/search/replay.py's summed median, mean and 10th percentile: 49.673 against 49.886).
    - **Warm-start seeds are a hedge, not a prior.** Seeds (configs a neighbouring problem
      found best) are measured first and can be the answer, but neither model learns from
      them: both count only the search's own measurements, so the search after the seeds is
      the cold search, shifted by their number. Letting the models learn from them anchored
      TPE (and through the forest's picks, TPE again) in the seeds' basin: a bet on transfer
      that pays big or loses big. With distinct seeds (``replay --warm-from``, 20 seeds,
      median score@50): A4000 -> W6600 1.000 learning vs 0.834 not; A4000 -> A100 0.674
      learning vs 0.875 not (cold 0.875), the seeds scoring 0.67 there, in a basin apart from
      the optimum, and nothing at the third trial tells the two cases apart.
    """

    def __init__(self, space: Space, mode: str, seed: int | None) -> None:
        self._space = space
        self._rand = random.Random(seed)
        listed = space.legal_configs() if mode == "grid" else None  # in configs() order
        self._grid = (None if mode != "grid" else iter(listed) if listed is not None
                      else space.configs())
        self._tpe = PlainTPEView(space, seed) if mode == "tpe" else None
        self._forest = ForestSurrogate(space, seed) if mode == "tpe" else None
        self._seed = seed
        self._restarted_at = 0  # own measurements when TPE's view was last rebuilt
        self._polishing = False  # stalled: measuring the best config's neighbours
        self.restarts = 0
        self.exhausted = False

    def infer_relative_search_space(self, study, trial):  # noqa: ANN001, ANN201
        return {n: d for n, d in self._space.distributions.items() if not d.single()}

    def sample_relative(self, study, trial, search_space):  # noqa: ANN001, ANN201
        if "fixed_params" in trial.system_attrs:  # an enqueued seed
            return {}
        others = [t for t in study._get_trials(deepcopy=False, states=LIVE, use_cache=False)
                  if t.number != trial.number]
        names = set(self._space.names)  # a trial being claimed may lack some params yet
        taken = {self._space.key(t.params) for t in others if t.params.keys() >= names}
        config = self._propose(others, taken)
        self.exhausted = config is None
        return {} if config is None else {n: config[n] for n in search_space}

    def sample_independent(self, study, trial, param_name, param_distribution):  # noqa
        # Reached only for single-valued parameters or when the space is exhausted.
        return self._space.params[param_name][0]

    def _propose(self, others: list[FrozenTrial], taken: set[Key]) -> Config | None:
        space = self._space
        if self._grid is not None:
            for config in self._grid:
                if space.key(config) not in taken and space.is_legal(config):
                    return config
            return None
        if self._tpe is None or self._forest is None or _sparse(space):
            return space.random_legal(self._rand, taken)
        own = sorted((t for t in others if is_measurement(t) and not t.user_attrs.get(SEED_ATTR)),
                     key=lambda t: t.number)
        outcomes = {space.key(t.params): t.value if trial_status(t) == OK else None
                    for t in own}
        if self._stalled(own):
            epoch = (space.key(t.params) for t in own[self._restarted_at:])  # since the restart
            config = self._polish({key: outcomes[key] for key in epoch}, taken)
            self._polishing = config is not None
            if config is not None:
                return config
            self._restart(len(own), outcomes.keys())
        config = None
        if len(outcomes) >= FOREST_AFTER and len(outcomes) % FOREST_CYCLE < FOREST_PICKS:
            config = self._forest.propose(outcomes, taken)
        return (config or self._tpe.propose(outcomes, taken)
                or space.random_legal(self._rand, taken))

    def _stalled(self, own: list[FrozenTrial]) -> bool:
        """Polishing, or no new best in the last ``RESTART_AFTER`` of the search's own
        measurements ``own`` (in order) since the last restart."""
        best, last_best = None, 0
        for i, t in enumerate(own, 1):
            if trial_status(t) == OK and (best is None or t.value < best):
                best, last_best = t.value, i
        return self._polishing or len(own) - max(last_best, self._restarted_at) >= RESTART_AFTER

    def _polish(self, outcomes: dict[Key, float | None], taken: set[Key]) -> Config | None:
        """An untaken neighbour of the fastest config in ``outcomes``, or None when there is
        none (the best is a local optimum)."""
        times = [(t, key) for key, t in outcomes.items() if t is not None]
        if not times:
            return None
        best = dict(zip(self._space.names, min(times, key=lambda p: p[0])[1], strict=True))
        return next((c for c in self._space.neighbours(best)
                     if self._space.key(c) not in taken), None)

    def _restart(self, measured: int, known: Iterable[Key]) -> None:
        """Rebuilds TPE's view empty, with a fresh seed (see class doc), after ``measured`` own
        measurements of the configs ``known``."""
        self.restarts += 1
        self._restarted_at = measured
        seed = None if self._seed is None else self._seed + 1000 * self.restarts  # fresh stream
        self._tpe = PlainTPEView(self._space, seed, known=known)


def _sparse(space: Space) -> bool:
    """Whether the legal configs are listed and so few among the combinations that plain TPE,
    proposing over the combinations, would expect under one legal config in the ``STALL``
    free proposals it may spend (a sparse landscape: 2 records of 2.56e10 combinations):
    then each would cost ``STALL`` asks, and the models learn nothing from illegal ones."""
    listed = space.legal_configs()
    return listed is not None and len(listed) * STALL < space.size
