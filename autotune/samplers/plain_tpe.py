"""Plain TPE as it would run on a study, in one worker's memory, its wasted proposals free."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import optuna
from optuna.samplers import TPESampler
from optuna.trial import TrialState

from autotune.searchspace import Config, Key, Space

STALL = 2000  # consecutive free proposals after which plain TPE counts as stuck


def tpe_sampler(seed: int | None) -> TPESampler:
    """Optuna's ``TPESampler`` with Optuna 5's defaults, set explicitly: multivariate, with the
    constant liar. Optuna 4 defaults to independent per parameter without the liar, which is
    another search: on Optuna 4.9 with those defaults, our searcher scored 49.340 against 49.886
    in bench/search/replay.py's summed median, mean and 10th percentile (six landscapes, 20 seeds;
    convolution-A100 @50 median 0.668 against 0.875) and ran 40% longer. With these settings,
    Optuna 4.9 reproduces Optuna 5's scores in every cell, for the searcher and for its
    plain-TPE baseline."""
    with warnings.catch_warnings():  # both settings are experimental before Optuna 5
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return TPESampler(seed=seed, multivariate=True, constant_liar=True)


def quiet_create_study(**kwargs: Any) -> optuna.Study:
    """``optuna.create_study(**kwargs)`` without Optuna's ``A new study created ...`` line
    (our commands say what they search); Optuna's verbosity is restored after."""
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.create_study(**kwargs)
    finally:
        optuna.logging.set_verbosity(level)


class PlainTPEView:
    """Plain TPE as it would run on this study, kept in this worker's memory.

    Optuna's ``TPESampler`` (:func:`tpe_sampler`) asks in a private in-memory study.
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
        self._study = quiet_create_study(direction="minimize", sampler=tpe_sampler(seed))
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
