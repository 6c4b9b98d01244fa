"""The trial and measurement contract between the search and what it measures and reports.

A measure function returns a :class:`Measurement` for a config; the search stores it on an
Optuna trial (layout: :mod:`storage.studies`, whose ``OK``, ``NOT_MEASURED``,
``trial_status`` and ``is_measurement`` are re-exported here) and hands back
:class:`TrialResult` objects. Read by ``measure``, ``landscape``, ``tune``, ``progress`` and the
samplers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from autotune.searchspace import Config, Space
from storage.studies import FINISHED, NOT_MEASURED, OK, is_measurement, trial_status

# A kernel without tunable fields (``xla``): its search's stop reason, and its phase
NOTHING_TO_SEARCH = "one config: nothing to search"
ONE_CONFIG_PHASE = "no tunable fields: its one config timed"

__all__ = ["FAILURES", "FINISHED", "LIVE", "NOTHING_TO_SEARCH", "NOT_MEASURED", "OK",
           "ONE_CONFIG_PHASE", "SEED_ATTR", "Measure", "Measurement", "OnTrial", "TrialResult",
           "is_measurement", "trial_result", "trial_status"]

# Failure classes a measure function reports; any other non-"ok" string is accepted too.
FAILURES = ("compile_error", "vmem_oom", "runtime_error", "wrong_result", "timeout",
            "corrupts_state")
LIVE = (*FINISHED, TrialState.RUNNING)  # trials that hold their config
SEED_ATTR = "seed"  # user attr (True) of a trial that measures a warm-start seed


@dataclass(frozen=True)
class Measurement:
    """The outcome of measuring one config: ``value`` (time in ms, lower is better) when
    ``status`` is ``"ok"``, else ``value`` is None and ``status`` names the failure class.
    ``attrs`` (JSON-serialisable: compile_s, spread, error, ...) are stored on the trial."""

    value: float | None = None
    status: str = OK
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status == OK:
            if self.value is None or not math.isfinite(self.value):
                raise ValueError(f"an ok measurement needs a finite value, got {self.value!r}")
        elif self.value is not None:
            raise ValueError(f"a failed measurement ({self.status}) carries no value")
        if self.status in NOT_MEASURED:
            raise ValueError(f"status {self.status!r} is reserved for configs never measured")

    @property
    def ok(self) -> bool:
        return self.status == OK

    @classmethod
    def failure(cls, status: str, **attrs: Any) -> Measurement:
        return cls(None, status, attrs)


Measure = Callable[[Config], Measurement]


@dataclass(frozen=True)
class TrialResult:
    """One measured config of the study."""

    number: int  # Optuna trial number
    config: Config
    measurement: Measurement
    measure_s: float  # wall seconds spent in ``measure``

    @property
    def value(self) -> float | None:
        return self.measurement.value


OnTrial = Callable[[TrialResult, TrialResult | None], None]


def trial_result(space: Space, trial: FrozenTrial) -> TrialResult:
    """The measured trial ``trial`` of a study over ``space``, as a :class:`TrialResult`."""
    attrs = {k: v for k, v in trial.user_attrs.items() if k not in ("status", "measure_s")}
    status = trial_status(trial)
    measurement = Measurement(trial.value if status == OK else None, status, attrs)
    return TrialResult(trial.number, space.config(trial.params), measurement,
                       trial.user_attrs.get("measure_s", 0.0))
