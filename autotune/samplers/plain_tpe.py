"""Plain TPE as it would run on a study, in one worker's memory, its wasted proposals free."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping

import optuna
from optuna.samplers import TPESampler
from optuna.trial import TrialState

from autotune.searchspace import Config, Key, Space

STALL = 2000  # consecutive free proposals after which plain TPE counts as stuck


class PlainTPEView:
    """Plain TPE as it would run on this study, kept in this worker's memory.

    Optuna's ``TPESampler`` asks in a private in-memory study, multivariate and with the
    constant liar: Optuna 5's defaults, set here so that Optuna 4 (whose defaults are
    independent per parameter, no liar) runs the searcher that was measured. Optuna 4.9 with
    its defaults scored worse in bench/search.py's summed median, mean and 10th percentile
    (49.340 against 49.886 on the six landscapes, 20 seeds; convolution-A100 @50 median 0.668
    against 0.875) and took 40% longer; with these settings it reproduces Optuna 5 exactly.
    A proposal that is illegal is told there as pruned, one already measured is told its
    measured outcome, one being measured elsewhere is failed (TPE ignores failed trials), and
    TPE is asked again: all of that is free, no real trial and no measurement. The first fresh
    legal proposal is returned; its real outcome is told when the study has it. Measurements
    that came from elsewhere (the forest, other workers, an earlier run of the study) are added
    as finished trials, so the view is rebuilt from the study on resume; those in ``known`` (a
    restarted view's past) are left out, except where TPE proposes them again.
    """

    def __init__(self, space: Space, seed: int | None, known: Iterable[Key] = ()) -> None:
        self._space = space
        level = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "new study" line for a view
        try:
            with warnings.catch_warnings():  # both are experimental before Optuna 5
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                sampler = TPESampler(seed=seed, multivariate=True, constant_liar=True)
            self._study = optuna.create_study(direction="minimize", sampler=sampler)
        finally:
            optuna.logging.set_verbosity(level)
        self._told: set[Key] = set(known)  # measured configs this view does not model
        self._asked: dict[Key, optuna.Trial] = {}

    def propose(self, outcomes: Mapping[Key, float | None], taken: set[Key]) -> Config | None:
        """A fresh legal config (not in ``taken``), or None when TPE keeps proposing known or
        illegal ones. ``outcomes``: every measured config's time, None for a failure."""
        space, study = self._space, self._study
        for key, value in outcomes.items():
            if key in self._told:
                continue
            self._told.add(key)
            trial = self._asked.pop(key, None)
            if trial is not None:
                study.tell(trial, value, state=_outcome_state(value))
            else:
                study.add_trial(optuna.trial.create_trial(
                    params=dict(zip(space.names, key, strict=True)),
                    distributions=space.distributions, value=value,
                    state=_outcome_state(value)))
        for _ in range(STALL):
            trial = study.ask(space.distributions)
            config = space.config(trial.params)
            key = space.key(config)
            if not space.is_legal(config):
                study.tell(trial, state=TrialState.PRUNED)
            elif key in outcomes:
                study.tell(trial, outcomes[key], state=_outcome_state(outcomes[key]))
            elif key in taken:
                study.tell(trial, state=TrialState.FAIL)
            else:
                self._asked[key] = trial
                return config
        return None


def _outcome_state(value: float | None) -> TrialState:
    """How a measured outcome is told to TPE: a time completes, a failure (None) is pruned."""
    return TrialState.PRUNED if value is None else TrialState.COMPLETE
