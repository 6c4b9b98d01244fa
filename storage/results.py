"""What the tuner publishes and the store hands back: plain, typed, validated dataclasses."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from kernel import DEFAULT_KERNEL, AutotuneError, Problem, ServingProblem, TableEntry
from kernel.registry import registered_kernel
from kernel.resolve import RETIRED_TIMINGS, installed_versions, stale_versions

METHODS: tuple[str, ...] = ("device", "interpret", "replay")
# How a run was timed (autotune.timing): the whole step's device time from a profiler trace, a
# compiled loop's time per run, or host wall time around each call; and the retired methods,
# which older results recorded (stale: kernel.resolve.RETIRED_TIMINGS).
CURRENT_TIMINGS: tuple[str, ...] = ("step_profile", "loop", "wallclock")
TIMINGS: tuple[str, ...] = (*CURRENT_TIMINGS, *RETIRED_TIMINGS)


def unknown_timing(requested: str) -> str | None:
    """Why ``requested`` is no timing method to time with (a retired one says why it was
    retired), naming the ones to choose; None for ``auto`` or a current method."""
    if requested in ("auto", *CURRENT_TIMINGS):
        return None
    retired = f" (retired: it timed {RETIRED_TIMINGS[requested]})" if requested in RETIRED_TIMINGS \
        else ""
    return (f"unknown timing method {requested!r}{retired}; choose one of auto, "
            f"{', '.join(CURRENT_TIMINGS)}")
ROOFLINE_BOUNDS: tuple[str, ...] = ("compute", "memory")
# kernel_median_ms: the part of the winner's median its named kernels took (step_profile
# timing of a kernel that names its pallas_calls; None otherwise), a breakdown that ranks nothing.
# What each measurement must be, as (above 0 rather than at least 0, at most, said): a time,
# and a speedup (a ratio of times), is above 0; a spread or a throughput may be 0; a fraction
# of the roofline (kernel.roofline: the least time the device's peaks allow over the measured
# one) is above 0 and at most 1.
_POSITIVE = (True, math.inf, "a finite number above 0")
_AT_LEAST_0 = (False, math.inf, "a finite number of at least 0")
MEASUREMENT_RANGES: dict[str, tuple[bool, float, str]] = {
    "median_ms": _POSITIVE, "iqr_ms": _AT_LEAST_0, "default_median_ms": _POSITIVE,
    "speedup": _POSITIVE, "achieved_tflops": _AT_LEAST_0,
    "kernel_median_ms": _POSITIVE,
    "roofline_fraction": (True, 1.0, "above 0 and at most 1 (the least time the device's "
                                     "peaks allow over the measured one)")}
MEASUREMENT_FIELDS = tuple(MEASUREMENT_RANGES)
# The names a lookup table gives them (kernel.table.TableEntry), said in errors.
TABLE_NAMES = {"median_ms": "time_ms", "default_median_ms": "default_time_ms"}
PROVENANCE_FIELDS = ("trials", "method", "timing", "roofline_bound", "jax_version",
                     "jaxlib_version", "libtpu_version", "study", "device_index", "compositions")
# What a lookup table's entry carries besides its timings (kernel.table.TableEntry.provenance).
TABLE_PROVENANCE = ("platform", "iqr_ms", "achieved_tflops", "roofline_fraction",
                    "kernel_median_ms",
                    *PROVENANCE_FIELDS)


class StorageError(AutotuneError):
    """Base of the errors storage raises on bad input; messages name the field and the fix."""


class ResultError(StorageError):
    """A tuned result is malformed or its config is illegal for its problem."""


class SchemaError(StorageError):
    """The database has no schema, or an older one; ``autotune db upgrade`` fixes it."""


def default_platform(device_kind: str) -> str:
    """JAX's platform name for a device kind: the kernel targets TPUs, or the CPU (interpret)."""
    return "cpu" if device_kind.lower() == "cpu" else "tpu"


def installed_kernel_version(kernel: str = DEFAULT_KERNEL) -> str:
    """The installed version of kernel ``kernel`` (the registry is jax-free to import)."""
    return registered_kernel(kernel).version


# This process's jax, jaxlib and libtpu versions, read once (rendering a page asks per row).
_installed_versions = functools.cache(installed_versions)


@dataclass(frozen=True)
class ConfigKey:
    """What a tuned config is stored under: kernel, device and problem."""

    kernel: str
    kernel_version: str
    device_kind: str
    platform: str
    problem: Problem | ServingProblem  # the kernel's problem type

    def to_dict(self) -> dict[str, Any]:
        """Flat: the kernel and device fields, then the problem fields (``KEY_FIELDS``)."""
        return {**{name: getattr(self, name) for name in KEY_TEXT_FIELDS},
                **self.problem.to_dict()}

    def columns(self) -> dict[str, Any]:
        """As stored: the kernel and device fields, then ``problem_columns`` (``KEY_FIELDS``)."""
        return {**{name: getattr(self, name) for name in KEY_TEXT_FIELDS},
                **problem_columns(self.problem)}


# A problem as stored: its fields, an attention problem's window as two columns. "None" is
# stored as a value no problem has (NO_WINDOW, NO_SOFTCAP), not as NULL: SQL unique keys treat
# NULLs as distinct, so a nullable key column would let two rows hold the same key.
WINDOW_COLUMNS = ("window_left", "window_right")
NO_WINDOW = -1
NO_SOFTCAP = 0.0


def columns_of(problem_type: type) -> tuple[str, ...]:
    """The columns a problem type is stored in: its fields, an attention window as two."""
    return tuple(column for f in dataclasses.fields(problem_type)
                 for column in (WINDOW_COLUMNS if (problem_type, f.name) == (Problem, "window")
                                else (f.name,)))


PROBLEM_COLUMNS = columns_of(Problem)
SERVING_COLUMNS = columns_of(ServingProblem)


def problem_columns(problem: Problem | ServingProblem) -> dict[str, Any]:
    """A problem's column values (``columns_of`` its type), in their order."""
    values = problem.to_dict()
    if isinstance(problem, Problem):
        values.update(zip(WINDOW_COLUMNS, problem.window or (NO_WINDOW, NO_WINDOW),
                          strict=True))
    elif problem.window is None:
        values["window"] = NO_WINDOW
    values["softcap"] = NO_SOFTCAP if problem.softcap is None else problem.softcap
    return {name: values[name] for name in columns_of(type(problem))}


def problem_from_columns(get: Callable[[str], Any],
                         problem_type: type = Problem) -> Problem | ServingProblem:
    """The problem of a row, from its column getter (the inverse of ``problem_columns``)."""
    values = {name: get(name) for name in columns_of(problem_type)}
    softcap = values.pop("softcap")
    if problem_type is Problem:
        window = tuple(values.pop(name) for name in WINDOW_COLUMNS)
    else:
        window = values.pop("window")
    return problem_type(**values, window=None if window in (NO_WINDOW, (NO_WINDOW,) * 2)
                        else window, softcap=None if softcap == NO_SOFTCAP else softcap)


# The key's own text fields (before its problem): with the problem's columns, the one
# declaration of what a result is stored and looked up under.
KEY_TEXT_FIELDS = tuple(f.name for f in dataclasses.fields(ConfigKey) if f.name != "problem")
KEY_FIELDS = (*KEY_TEXT_FIELDS, *PROBLEM_COLUMNS)
SERVING_KEY_FIELDS = (*KEY_TEXT_FIELDS, *SERVING_COLUMNS)


# The longest value each text field may hold (the column sizes of storage.models).
TEXT_LIMITS = {"kernel": 64, "kernel_version": 64, "device_kind": 128, "platform": 32,
               "method": 16, "timing": 16, "roofline_bound": 16, "jax_version": 64,
               "jaxlib_version": 64, "libtpu_version": 64,
               "study": 256, "failure": 64}
# Control characters (PostgreSQL cannot store NUL) and lone UTF-16 surrogates (not encodable).
_NOT_TEXT = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")
# The largest integer both SQLite and PostgreSQL (INTEGER: 32-bit signed) columns hold.
MAX_STORED_INT = 2**31 - 1


def check_text(name: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not any(c.isprintable() and not c.isspace() for c in value):
        raise ResultError(f"{name} must be a non-empty string with a visible character, got "
                          f"{value!r}")
    if value != value.strip():
        raise ResultError(f"{name} must not start or end with whitespace, got {value!r}; "
                          "strip it")
    if len(value) > TEXT_LIMITS[name] or _NOT_TEXT.search(value):
        shown = value[:40].encode("utf-8", "backslashreplace").decode("utf-8")
        raise ResultError(f"{name} must be at most {TEXT_LIMITS[name]} characters of text "
                          f"without control characters or lone surrogates, got {shown!r}")
    unseen = next((c for c in value if not c.isprintable()), None)
    if unseen is not None:  # a BOM, a zero-width or a no-break space: 'cpu' stored apart
        raise ResultError(f"{name} must be printable text, got {value[:40]!r}, which holds "
                          f"U+{ord(unseen):04X} ({unicodedata.name(unseen, 'unnamed')}): it "
                          "shows as nothing or as a plain space, so the name would read as "
                          "another; remove it")


def _measurement_in(value: Any, positive: bool, most: float) -> bool:
    """Whether ``value`` is a finite number (not a bool), above 0 (``positive``) or at least 0,
    and at most ``most``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return (value > 0 if positive else value >= 0) and value <= most


# No attention call on any device takes under 100 ns: a faster time is no measurement, and
# stored it would keep every real tune of its key out (a PUT of 5e-324 ms did).
MIN_TIME_MS = 1e-4


def implausible_time(result: TunedResult) -> str:
    """Why a time of ``result`` is no measurement ('' when none is), naming the floor."""
    for name in ("median_ms", "default_median_ms"):
        value = getattr(result, name)
        if value is not None and value < MIN_TIME_MS:
            table = f" (a table entry's {TABLE_NAMES[name]})"
            return (f"{name}{table} of {value!r} ms is below {MIN_TIME_MS} ms (100 ns), faster "
                    "than any attention call runs: it is no measurement; send the time measured")
    return ""


NOISE_FLOOR = 0.01  # a lead under 1% of the slower median is noise, however tight the spreads


def faster_beyond_noise(fast_ms: float, fast_iqr_ms: float | None, slow_ms: float,
                        slow_iqr_ms: float | None) -> bool:
    """Whether a median of ``fast_ms`` beats one of ``slow_ms`` beyond the noise of both
    measurements: by more than the larger of their spreads (IQR; None counts as 0) and
    NOISE_FLOOR of the slower."""
    return slow_ms - fast_ms > max(fast_iqr_ms or 0.0, slow_iqr_ms or 0.0,
                                   NOISE_FLOOR * slow_ms)


@dataclass(frozen=True)
class TunedResult:
    """One tuning outcome for one key: the winning config, its timings and provenance.

    ``median_ms`` is None only for results imported without timings; such a result never beats
    a measured one. Stored without a ``speedup``, it gets ``default_median_ms / median_ms``.
    """

    device_kind: str
    problem: Problem | ServingProblem  # of ``kernel``'s problem type
    config: Any  # a config of ``kernel`` (its ``TunableKernel.config_type``)
    median_ms: float | None
    iqr_ms: float | None = None
    default_median_ms: float | None = None
    speedup: float | None = None
    trials: int | None = None
    method: Literal["device", "interpret", "replay"] | None = None
    timing: Literal["step_profile", "loop", "wallclock", "profile"] | None = None
    # Against the device's roofline (kernel.roofline); None on a CPU or where peaks are unknown.
    achieved_tflops: float | None = None
    roofline_fraction: float | None = None
    roofline_bound: Literal["compute", "memory"] | None = None
    jax_version: str | None = None
    jaxlib_version: str | None = None
    libtpu_version: str | None = None
    study: str | None = None
    device_index: int | None = None  # which local device measured it (tune --devices)
    kernel_median_ms: float | None = None  # of median_ms, the named kernels' part
    # The batches a serving step's trials ran (TunableKernel.compositions); None: one call.
    compositions: list[dict[str, Any]] | None = field(default=None, hash=False)
    kernel: str = DEFAULT_KERNEL
    kernel_version: str = ""  # empty: the installed version of ``kernel``
    platform: str = ""  # empty: derived from device_kind

    def __post_init__(self) -> None:
        check_text("kernel", self.kernel)
        rules = registered_kernel(self.kernel)
        if not self.kernel_version:
            object.__setattr__(self, "kernel_version", rules.version)
        for name in ("kernel_version", "device_kind"):
            check_text(name, getattr(self, name))
        for name in ("jax_version", "jaxlib_version", "libtpu_version", "study"):
            check_text(name, getattr(self, name), optional=True)
        if not isinstance(self.problem, rules.problem_type):
            raise ResultError(f"kernel {self.kernel!r} takes a "
                              f"{rules.problem_type.__name__} as its problem, got "
                              f"{self.problem!r}; store its results under a kernel of that "
                              "problem type")
        if not isinstance(self.config, rules.config_type):
            raise ResultError(f"config of kernel {self.kernel!r} must be a "
                              f"{rules.config_type.__name__}, got {self.config!r}")
        for name, (positive, most, wanted) in MEASUREMENT_RANGES.items():
            value = getattr(self, name)
            if value is not None and not _measurement_in(value, positive, most):
                table = f" (a table entry's {TABLE_NAMES[name]})" if name in TABLE_NAMES else ""
                raise ResultError(f"{name}{table} must be {wanted}, got {value!r}")
        if self.compositions is not None and not (
                isinstance(self.compositions, list) and self.compositions
                and all(isinstance(c, dict) for c in self.compositions)):
            raise ResultError(f"compositions must be a non-empty list of JSON objects (the "
                              f"batches measured) or None, got {self.compositions!r}")
        for name in ("trials", "device_index"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_STORED_INT):
                raise ResultError(f"{name} must be an integer from 0 to {MAX_STORED_INT}, "
                                  f"got {value!r}")
        for name, allowed in (("method", METHODS), ("timing", TIMINGS),
                              ("roofline_bound", ROOFLINE_BOUNDS)):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ResultError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if not self.platform:
            object.__setattr__(self, "platform", default_platform(self.device_kind))
        check_text("platform", self.platform)

    @property
    def key(self) -> ConfigKey:
        return ConfigKey(self.kernel, self.kernel_version, self.device_kind, self.platform,
                         self.problem)

    def check_legal(self) -> None:
        """Raises ResultError for a time no measurement gives (``implausible_time``), or
        naming every rule of its kernel the config breaks for its problem
        (``TunableKernel.stored_violations``, as ``kernel.table.nearest_entry`` checks)."""
        implausible = implausible_time(self)
        if implausible:
            raise ResultError(implausible)
        broken = registered_kernel(self.kernel).stored_violations(self.problem, self.config)
        if broken:
            raise ResultError(f"config is illegal for {self.problem.label()}: "
                              + "; ".join(str(v) for v in broken))

    def beats(self, other: TunedResult, beyond_noise: bool = False) -> bool:
        """Strictly faster than ``other`` (``beyond_noise``: by more than the noise of both
        measurements, :func:`faster_beyond_noise`, or within it but better measured); a
        measured result beats an unmeasured one."""
        if self.median_ms is None:
            return False
        if other.median_ms is None or implausible_time(other):  # stored before the floor
            return True
        if beyond_noise:
            return faster_beyond_noise(self.median_ms, self.iqr_ms, other.median_ms,
                                       other.iqr_ms) or (
                self.measured_better(other) and not faster_beyond_noise(
                    other.median_ms, other.iqr_ms, self.median_ms, self.iqr_ms))
        return self.median_ms < other.median_ms

    def measured_better(self, other: TunedResult) -> bool:
        """Of a search of more configs (``trials``), with a tighter spread (``iqr_ms``): of
        two tunes of one key at once, the one of 1 trial and a 5.2 ms IQR, published first,
        kept the one of 4 trials out as within its noise."""
        return (None not in (self.trials, other.trials, self.iqr_ms, other.iqr_ms)
                and self.trials > other.trials and self.iqr_ms < other.iqr_ms)

    def stale_versions(self, installed: Mapping[str, str | None] | None = None) -> str:
        """Which of its recorded jax, jaxlib and libtpu versions differ from ``installed``
        (default: this environment's), as ``jax 0.9.0 (installed 0.10.2)``; '' when none do.
        A stale config is still legal, but may no longer be the fastest."""
        return stale_versions(self.measurements(), installed or _installed_versions())

    @property
    def kernel_share(self) -> float | None:
        """The fraction of the step's median its named kernels took (None where unmeasured)."""
        if self.kernel_median_ms is None or not self.median_ms:
            return None
        return self.kernel_median_ms / self.median_ms

    def measurements(self) -> dict[str, Any]:
        """Timings and provenance as plain fields (everything but key and config)."""
        return {name: getattr(self, name) for name in (*MEASUREMENT_FIELDS, *PROVENANCE_FIELDS)}

    def to_table_entry(self) -> TableEntry:
        provenance = {name: value for name in TABLE_PROVENANCE
                      if (value := getattr(self, name)) is not None}
        return TableEntry(problem=self.problem, config=self.config, time_ms=self.median_ms,
                          default_time_ms=self.default_median_ms, speedup=self.speedup,
                          provenance=provenance)

    @classmethod
    def from_table_entry(cls, entry: TableEntry, *, kernel: str, kernel_version: str,
                         device_kind: str) -> TunedResult:
        """A result from a lookup-table entry; provenance fields this format knows are read
        back, others are ignored."""
        known = {name: entry.provenance[name] for name in TABLE_PROVENANCE
                 if entry.provenance.get(name) is not None}
        return cls(kernel=kernel, kernel_version=kernel_version, device_kind=device_kind,
                   problem=entry.problem, config=entry.config, median_ms=entry.time_ms,
                   default_median_ms=entry.default_time_ms, speedup=entry.speedup, **known)


@dataclass(frozen=True)
class Entry:
    """A stored result with its timestamps (UTC)."""

    result: TunedResult
    created_at: datetime
    updated_at: datetime

    def to_dict(self) -> dict[str, Any]:
        """The wire shape: ``key``, ``config``, measurements and provenance, timestamps."""
        return {"key": self.result.key.to_dict(), "config": self.result.config.to_dict(),
                **self.result.measurements(), "created_at": self.created_at.isoformat(),
                "updated_at": self.updated_at.isoformat()}


@dataclass(frozen=True)
class PublishOutcome:
    """What a publish did: ``inserted`` a new key, ``replaced`` the stored result (now in
    history), or ``kept`` the stored one (the newcomer went to history)."""

    status: Literal["inserted", "replaced", "kept"]
    entry: Entry  # the result now stored under the key
    previous: TunedResult | None = None  # the result that was stored before, if any
