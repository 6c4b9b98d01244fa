"""A tuning study as plain data: what ``autotune tune`` stored in Optuna (trial layout:
:mod:`storage.studies`), read once and drawn by :mod:`present.plots` and the templates."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.storages import BaseStorage

from kernel import DEFAULT_KERNEL, get_kernel
from kernel.problem import Problem, ProblemError
from present.text import first_line
from storage.studies import OK, is_measurement, trial_status

# One letter per failure class in the landscape; other classes get their first letter.
FAILURE_LETTERS = {"compile_error": "C", "vmem_oom": "V", "runtime_error": "R",
                   "wrong_result": "W", "timeout": "T", "corrupts_state": "X"}


def failure_letter(status: str) -> str:
    return FAILURE_LETTERS.get(status, status[:1].upper() or "?")


@dataclass(frozen=True)
class Point:
    """One measured config: ``status`` is ``ok`` (then ``value_ms`` is its time) or a
    failure class (then ``error`` is the first line of the message, if any)."""

    number: int
    params: dict[str, Any]
    status: str
    value_ms: float | None
    compile_s: float | None
    error: str | None


@dataclass(frozen=True)
class Confirmed:
    """A config re-measured against the default after the search, round by round;
    ``config_label``: the config as its kernel labels it everywhere (``FlashConfig.label``:
    ``q256 kv128/128 ... dkv128x256/depth3``, as the summary's winner)."""

    params: dict[str, Any]
    samples_ms: tuple[float, ...]
    median_ms: float
    iqr_ms: float
    is_default: bool
    is_winner: bool
    config_label: str

    @property
    def label(self) -> str:
        return (self.config_label + (" (default)" if self.is_default else "")
                + (" (winner)" if self.is_winner else ""))


@dataclass(frozen=True)
class StudyData:
    """One tuning study: its searched space, its measured configs in order, and the
    confirmation of the winner (empty if the run stopped before it)."""

    name: str
    kernel: str  # the tuned kernel's registry name
    problem: Problem | None
    device_kind: str | None
    space: dict[str, list[Any]]  # declared values of each searched field
    points: tuple[Point, ...]
    confirmation: tuple[Confirmed, ...]
    winner_params: dict[str, Any] | None = None  # the winner's searched fields, if known

    @classmethod
    def load(cls, storage: BaseStorage, name: str, kernel: str | None = None,
             winner: Mapping[str, Any] | None = None) -> StudyData | None:
        """The study ``name``, or None if the storage has none of that name."""
        try:
            study = optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            return None
        return cls.from_study(study, kernel, winner)

    @classmethod
    def from_study(cls, study: optuna.Study, kernel: str | None = None,
                   winner: Mapping[str, Any] | None = None) -> StudyData:
        """The study's data; ``kernel``: the tuned kernel's name when known (a stored
        winner's), else the study's ``kernel`` attr, else the default kernel; ``winner``: the
        stored winner's config fields, else the confirmation's winner (a table imported from
        another database can store a winner this study's confirmation did not choose). Raises
        ConfigError when a confirmed config is not one of the kernel's."""
        trials = sorted((t for t in study.get_trials(deepcopy=False) if is_measurement(t)),
                        key=lambda t: t.number)
        points = tuple(Point(
            number=t.number, params=dict(t.params), status=trial_status(t),
            value_ms=t.value if trial_status(t) == OK else None,
            compile_s=t.user_attrs.get("compile_s"),
            error=first_line(str(t.user_attrs["error"])) if t.user_attrs.get("error") else None)
            for t in trials)
        attrs = study.user_attrs
        space = {n: list(v) for n, v in attrs.get("params", {}).items()}
        for point in points:  # a study stored without its declared space: the values seen
            for n, v in point.params.items():
                if v not in space.setdefault(n, []):
                    space[n] = sorted([*space[n], v])
        try:
            problem = Problem.from_dict(attrs["problem"]) if "problem" in attrs else None
        except ProblemError:
            problem = None
        searched = [n for n in space if len(space[n]) > 1] or list(space)
        kernel = kernel or attrs.get("kernel", DEFAULT_KERNEL)
        mode = problem.mode if problem else "fwd_bwd"
        confirmed = attrs.get("confirmation", [])
        winner = dict(winner) if winner is not None else next(
            (c["config"] for c in confirmed if c["is_winner"]), None)
        confirmation = tuple(Confirmed(
            params={n: c["config"][n] for n in searched if n in c["config"]},
            samples_ms=tuple(c["samples_ms"]), median_ms=c["median_ms"], iqr_ms=c["iqr_ms"],
            is_default=bool(c["is_default"]), is_winner=c["config"] == winner,
            config_label=get_kernel(kernel).config_from_dict(c["config"]).label(mode))
            for c in confirmed)
        return cls(name=study.study_name, kernel=kernel, problem=problem,
                   device_kind=attrs.get("device_kind"), space=space, points=points,
                   confirmation=confirmation, winner_params=None if winner is None else
                   {n: winner[n] for n in searched if n in winner})

    @property
    def ok(self) -> list[Point]:
        return [p for p in self.points if p.status == OK]

    @property
    def failed(self) -> list[Point]:
        return [p for p in self.points if p.status != OK]

    def curve(self) -> list[float | None]:
        """The best time after each measured config (None until one succeeded)."""
        out: list[float | None] = []
        best = None
        for point in self.points:
            if point.value_ms is not None and (best is None or point.value_ms < best):
                best = point.value_ms
            out.append(best)
        return out

    def winner(self) -> Confirmed | None:
        """The winner's confirmation, if this study confirmed it."""
        return next((c for c in self.confirmation if c.is_winner), None)

    def search_point(self, confirmed: Confirmed) -> Point | None:
        """A confirmed config's measurement during the search, if it was measured."""
        return next((p for p in self.points if p.status == OK
                     and all(p.params.get(n) == v for n, v in confirmed.params.items())), None)

    def default_point(self) -> Point | None:
        """The default config's measurement during the search, if it was measured."""
        default = next((c for c in self.confirmation if c.is_default), None)
        return None if default is None else self.search_point(default)

    def outcomes(self) -> Counter[str]:
        """Measured configs per status, ``ok`` first, then failure classes by count."""
        counts = Counter(p.status for p in self.points)
        return Counter({OK: counts.pop(OK, 0), **dict(counts.most_common())})

    def errors(self) -> list[tuple[str, str, int]]:
        """(failure class, first line of the error, how many configs) per distinct error."""
        counts = Counter((p.status, p.error) for p in self.failed if p.error)
        return [(status, error, n) for (status, error), n in
                sorted(counts.items(), key=lambda item: (item[0][0], -item[1]))]
