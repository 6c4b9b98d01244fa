"""Lookup tables: tuned configs, and kernel choices, as plain versioned JSON a build can embed.

Pure Python (no jax): the service exports and imports the same format, and uses the same
nearest-match rules, as the kernel wrapper reading a pinned table. Schema 2 added ``choices``
(which kernel wins per problem on the table's device kind); schema 3 problems may carry a
``window``, a ``softcap`` and ``segmented``, schema 4 ones ``bottom_right`` too; schema 5
names the table's ``problem_type``: ``attention`` (``kernel.problem.Problem``, as every older
table's) or ``serving`` (``kernel.serving.ServingProblem``, the entries of a serving kernel).
Older tables still load (their problems have none of what came after them).
"""

from __future__ import annotations

import dataclasses
import heapq
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernel.errors import AutotuneError, TableError
from kernel.problem import FEATURE_FIELDS, Problem, finite_float, shown_number
from kernel.registry import KERNELS, get_kernel, is_registered, registered_kernel
from kernel.regular_file import FileTooLarge, NotARegularFile, read_regular_file
from kernel.serving import PROBLEM_TYPES

MiB = 1 << 20
# An export of 100k configs and 100k kernel choices, with provenance, is about 200 MiB; a
# larger file is no table.
MAX_TABLE_BYTES = 512 * MiB
TABLE_SCHEMA_VERSION = 5
# 1: configs only; 2: configs and kernel choices; 3: problems with window, softcap, segmented;
# 4: and bottom_right; 5: a problem_type
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4, 5)
# A table names its problem_type (PROBLEM_TYPES: by the problem type of its kernel,
# TunableKernel.problem_type) since this schema.
PROBLEM_TYPE_SINCE = 5
# The first schema whose problems may use each of FEATURE_FIELDS.
FEATURE_SINCE = {"window": 3, "softcap": 3, "segmented": 3, "bottom_right": 4}
assert set(FEATURE_SINCE) == set(FEATURE_FIELDS)


@dataclass(frozen=True)
class TableEntry:
    """One tuned result: the problem, the winning config, and how it was measured."""

    problem: Any  # of the table kernel's problem type (``TunableKernel.problem_type``)
    config: Any  # a config of the table's kernel (``TunableKernel.config_type``)
    time_ms: float | None = None
    default_time_ms: float | None = None
    speedup: float | None = None
    provenance: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"problem": self.problem.to_dict(), "config": self.config.to_dict(),
                "time_ms": self.time_ms, "default_time_ms": self.default_time_ms,
                "speedup": self.speedup, "provenance": dict(self.provenance)}

    @classmethod
    def from_dict(cls, data: Any, kernel: str) -> TableEntry:
        """An entry whose problem and config are kernel ``kernel``'s types."""
        if not isinstance(data, dict):
            raise TableError(f"an entry must be a JSON object, got {type(data).__name__}")
        for name in ("problem", "config"):
            if name not in data:
                raise TableError(f"entry is missing {name!r}")
        rules = registered_kernel(kernel)
        problem = rules.problem_type.from_dict(data["problem"])
        config = rules.config_from_dict(data["config"])
        numbers = {}
        for name in ("time_ms", "default_time_ms", "speedup"):
            numbers[name] = _milliseconds(name, data.get(name))
        return cls(problem=problem, config=config, provenance=read_provenance(data), **numbers)


def _milliseconds(name: str, value: Any) -> float | None:
    """``value`` if it is None or a finite non-negative number, else a ``TableError``."""
    if value is None:
        return None
    number = finite_float(value)
    if number is None or number < 0:
        raise TableError(f"{name} must be a non-negative number a float holds, got "
                         f"{shown_number(value)}")
    return value


def read_provenance(data: Mapping[str, Any]) -> dict[str, Any]:
    """The ``provenance`` object of an entry, a choice or a service answer ({} when absent)."""
    provenance = data.get("provenance") or {}
    if not isinstance(provenance, dict):
        raise TableError("provenance must be a JSON object")
    return provenance


@dataclass(frozen=True)
class KernelTiming:
    """One candidate kernel's confirmed outcome for a problem: its median and spread (IQR) in
    milliseconds, or the failure class that kept it out (``compile_error``, ...)."""

    median_ms: float | None = None
    iqr_ms: float | None = None
    failure: str | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.failure is not None:
            return {"failure": self.failure}
        return {"median_ms": self.median_ms, "iqr_ms": self.iqr_ms}

    @classmethod
    def from_dict(cls, data: Any, name: str) -> KernelTiming:
        if not isinstance(data, dict):
            raise TableError(f"candidate {name!r} must be a JSON object, got {data!r}")
        failure = data.get("failure")
        if failure is not None:
            if not isinstance(failure, str) or not failure:
                raise TableError(f"candidate {name!r}: failure must be a non-empty string")
            return cls(failure=failure)
        median = _milliseconds(f"candidate {name!r} median_ms", data.get("median_ms"))
        if median is None:
            raise TableError(f"candidate {name!r} needs a median_ms or a failure")
        return cls(median, _milliseconds(f"candidate {name!r} iqr_ms", data.get("iqr_ms")))


@dataclass(frozen=True)
class KernelChoice:
    """Which kernel runs ``problem`` on the table's device kind, with which config, and the
    evidence: every candidate's confirmed timing or failure. The chosen kernel may be unknown
    to this build (a table from a newer one): its config then stays raw fields, and the
    resolver runs the next best candidate it knows."""

    problem: Problem
    kernel: str
    config: Any  # a config of ``kernel`` if registered here, else its fields as a dict
    candidates: Mapping[str, KernelTiming] = field(default_factory=dict, hash=False,
                                                   compare=False)
    provenance: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def times_ms(self) -> dict[str, float | None]:
        """Each candidate's confirmed median (None: it failed)."""
        return {name: timing.median_ms for name, timing in self.candidates.items()}

    def ranked(self) -> list[str]:
        """The chosen kernel, then the other measured candidates, fastest first."""
        measured = sorted((name for name, t in self.candidates.items()
                           if t.median_ms is not None and name != self.kernel),
                          key=lambda name: self.candidates[name].median_ms)
        return [self.kernel, *measured]

    def config_dict(self) -> dict[str, Any]:
        return dict(self.config) if isinstance(self.config, Mapping) else self.config.to_dict()

    def to_dict(self) -> dict[str, Any]:
        return dict(problem=self.problem.to_dict(), kernel=self.kernel,
                    config=self.config_dict(),
                    candidates={name: t.to_dict() for name, t in self.candidates.items()},
                    provenance=dict(self.provenance))

    @classmethod
    def from_dict(cls, data: Any) -> KernelChoice:
        if not isinstance(data, dict):
            raise TableError(f"a choice must be a JSON object, got {type(data).__name__}")
        for name in _CHOICE_FIELDS:
            if name not in data:
                raise TableError(f"choice is missing {name!r}")
        kernel, raw_candidates = (data[name] for name in _CHOICE_FIELDS[1::2])
        if not isinstance(kernel, str) or not kernel:
            raise TableError(f"choice kernel must be a non-empty string, got {kernel!r}")
        if not isinstance(raw_candidates, dict):
            raise TableError("choice candidates must be a JSON object (kernel -> timing)")
        candidates = {name: KernelTiming.from_dict(raw, name)
                      for name, raw in raw_candidates.items()}
        if kernel not in candidates or candidates[kernel].median_ms is None:
            raise TableError(f"chosen kernel {kernel!r} must be a candidate with a median_ms")
        config = data["config"]
        if kernel in KERNELS:
            config = get_kernel(kernel).config_from_dict(config)
        elif not isinstance(config, dict):
            raise TableError(f"choice config must be a JSON object, got {config!r}")
        return cls(Problem.from_dict(data["problem"]), kernel, config, candidates,
                   read_provenance(data))


# A choice's required fields: problem, kernel, config, candidates (named through the class: a
# module of ``kernel`` spelling its own package's name as a string reads as an import of it).
_CHOICE_FIELDS = tuple(f.name for f in dataclasses.fields(KernelChoice)[:4])


@dataclass(frozen=True)
class LookupTable:
    """Tuned configs of one kernel on one device kind."""

    kernel: str
    kernel_version: str
    device_kind: str
    entries: tuple[TableEntry, ...]
    jax_version: str | None = None
    schema_version: int = TABLE_SCHEMA_VERSION
    choices: tuple[KernelChoice, ...] = ()  # kernel choices on ``device_kind`` (any kernel)
    # The entries of the other kernels its choices name, one table each (no choices), so that
    # a pinned table runs every choice it holds, and each choice's next best candidates, at
    # their tuned configs on nearby shapes too. Optional: a build that predates it reads the
    # table without them.
    others: tuple[LookupTable, ...] = ()
    # The kernels of ``others`` items this build does not register (a table from a newer
    # build): their entries were left out on reading, and are not written back.
    left_out: tuple[str, ...] = field(default=(), compare=False)
    source: str = field(default="", compare=False)  # the file it was loaded from, if any

    def __repr__(self) -> str:
        """Its kernels' entry counts, device kinds, choices and file, not every entry."""
        tables = self.kernel_tables()
        entries = ", ".join(f"{len(t.entries)} {t.kernel} v{t.kernel_version}" for t in tables)
        kinds = ", ".join(sorted({repr(t.device_kind) for t in tables}))
        where = f", from {self.source}" if self.source else ""
        return (f"LookupTable({kinds}: entries {entries}; {len(self.choices)} kernel "
                f"choices{where})")

    def kernel_tables(self) -> tuple[LookupTable, ...]:
        """This table and its ``others``: the entries of each kernel it carries."""
        return (self, *self.others)

    @property
    def problem_type(self) -> str:
        """``attention`` or ``serving``: what its kernel's problems are (:data:`PROBLEM_TYPES`)."""
        return problem_type_name(registered_kernel(self.kernel).problem_type)

    def to_dict(self) -> dict[str, Any]:
        table = dict(schema_version=self.schema_version, problem_type=self.problem_type,
                     kernel=self.kernel, kernel_version=self.kernel_version,
                     device_kind=self.device_kind, jax_version=self.jax_version,
                     entries=[entry.to_dict() for entry in self.entries],
                     choices=[choice.to_dict() for choice in self.choices])
        if self.others:
            table["others"] = [{name: other[name] for name in _OTHER_FIELDS}
                               for other in (kernel.to_dict() for kernel in self.others)]
        return table

    @classmethod
    def from_dict(cls, data: Any) -> LookupTable:
        """Validates a whole table; the first bad entry is named by its index."""
        if not isinstance(data, dict):
            raise TableError(f"a table must be a JSON object, got {type(data).__name__}")
        version = _schema_version(data.get("schema_version"))
        header, kernel = _header(data)
        _check_problem_type(data, version, kernel)
        raw_entries = data.get("entries")
        if not isinstance(raw_entries, list):
            raise TableError("table field 'entries' must be a list")
        entries = _parse_each(raw_entries, "entry", lambda raw: TableEntry.from_dict(
            _schema_features(raw, version), kernel))
        raw_choices = data.get("choices", []) if version >= 2 else []
        if not isinstance(raw_choices, list):
            raise TableError("table field 'choices' must be a list")
        choices = _parse_each(raw_choices, "choice", lambda raw: KernelChoice.from_dict(
            _schema_features(raw, version)))
        others, left_out = _others(data, version, header["device_kind"], kernel)
        return cls(**header, entries=entries, choices=choices, others=others,
                   left_out=left_out)

    @classmethod
    def load(cls, path: str | Path) -> LookupTable:
        """Reads and validates a table file; every failure is a ``TableError`` naming it."""
        text = read_table_bytes(path)
        try:
            data = json.loads(text.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise TableError(f"table {path} is not UTF-8 text (byte {error.start}); export "
                             "it again with `autotune export`") from None
        except ValueError as error:  # JSONDecodeError, or an integer of over 4300 digits
            raise TableError(f"table {path} is not valid JSON: {error}") from None
        except RecursionError:
            raise TableError(f"table {path} is nested too deeply to be a lookup table") from None
        try:
            return dataclasses.replace(cls.from_dict(data), source=str(path))
        except AutotuneError as error:
            raise TableError(f"table {path}: {error}") from None

    def lookup(self, problem: Problem) -> tuple[TableEntry, str] | None:
        """The exact entry for ``problem``, else the nearest whose config is legal for it."""
        return find_entry(problem, self.entries, self.kernel)

    def lookup_choice(self, problem: Problem) -> tuple[KernelChoice, str] | None:
        """The kernel choice for exactly ``problem``, else the nearest (``ProblemIndex``)."""
        return find_choice(problem, self.choices)


def problem_type_name(problem_type: type) -> str:
    """The name a table gives ``problem_type`` (:data:`PROBLEM_TYPES`)."""
    return next(name for name, known in PROBLEM_TYPES.items() if known is problem_type)


def _check_problem_type(data: dict[str, Any], version: int, kernel: str) -> None:
    """Raises unless the table's ``problem_type`` (``attention`` when absent) is its kernel's,
    and a serving kernel's table is of a schema that names it."""
    named = data.get("problem_type", "attention")
    own = problem_type_name(registered_kernel(kernel).problem_type)
    if not isinstance(named, str) or named not in PROBLEM_TYPES:
        raise TableError(f"table problem_type must be one of {', '.join(PROBLEM_TYPES)}, got "
                         f"{named!r}")
    if named != own:
        raise TableError(f"table problem_type {named!r} is not that of kernel {kernel!r} "
                         f"({own!r}); export the table again with `autotune export`")
    if own != "attention" and version < PROBLEM_TYPE_SINCE:
        raise TableError(f"kernel {kernel!r} tables came with schema_version "
                         f"{PROBLEM_TYPE_SINCE} ({own} problems); a schema {version} table "
                         "cannot hold them (export the table again with this build)")


def _schema_version(version: Any) -> int:
    """A table's ``schema_version``, if this build reads it."""
    if (isinstance(version, int) and not isinstance(version, bool)
            and version > TABLE_SCHEMA_VERSION):
        raise TableError(f"table schema_version {version} is newer than this build, which "
                         f"reads versions up to {TABLE_SCHEMA_VERSION}: upgrade "
                         "flash-autotune, or export the table from a service running "
                         "this build")
    if type(version) is not int or version not in READABLE_SCHEMA_VERSIONS:  # not True
        raise TableError(f"unsupported schema_version {version!r}; this build reads "
                         f"versions {', '.join(map(str, READABLE_SCHEMA_VERSIONS))} "
                         "(re-export the table)")
    return version


def _header(data: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A table's text fields (``jax_version`` too) and its kernel, registered here."""
    header = {name: data.get(name) for name in _HEADER_TEXT}
    for name, value in header.items():
        if not isinstance(value, str) or not value:
            raise TableError(f"table field {name!r} must be a non-empty string")
    try:
        kernel = registered_kernel(header[_HEADER_TEXT[0]]).name
    except AutotuneError as error:
        raise TableError(f"table {error}") from None
    jax_version = data.get("jax_version")
    if jax_version is not None and not isinstance(jax_version, str):
        raise TableError(f"table field 'jax_version' must be a string or null, got "
                         f"{jax_version!r}")
    return {**header, "jax_version": jax_version}, kernel


def read_table_bytes(path: str | Path) -> bytes:
    """The bytes of a table file: a regular file of at most :data:`MAX_TABLE_BYTES` (a device,
    a FIFO or a huge file is refused before it is read, without blocking on it)."""
    try:
        return read_regular_file(path, MAX_TABLE_BYTES)
    except FileNotFoundError:
        raise TableError(f"table {path} does not exist; give the path of a table written by "
                         "`autotune export`") from None
    except OSError as error:
        raise TableError(f"cannot read table {path}: {error.strerror}") from None
    except NotARegularFile:
        raise TableError(f"table {path} is not a regular file; give the path of a table "
                         "written by `autotune export`") from None
    except FileTooLarge:
        raise TableError(f"table {path} is over the {MAX_TABLE_BYTES // MiB} MiB a lookup "
                         "table may have; export one device kind's table (`autotune export "
                         "--device-kind ...`)") from None


# The fields of an ``others`` item: a table's own, less those the outer table holds for all.
_OTHER_FIELDS = tuple(field.name for field in dataclasses.fields(LookupTable)
                      if field.name not in ("device_kind", "schema_version", "choices", "others",
                                            "left_out", "source"))


def _others(data: dict[str, Any], version: int, device_kind: str,
            kernel: str) -> tuple[tuple[LookupTable, ...], tuple[str, ...]]:
    """The ``others`` of a table of ``kernel``: each other kernel's entries on the table's
    device kind, at most one item a kernel; and the kernels this build does not register (a
    table from a newer build), whose items are left out, as the resolver leaves out a choice's
    unknown kernel."""
    raw = data.get("others", [])
    if not isinstance(raw, list):
        raise TableError("table field 'others' must be a list")
    others: list[LookupTable] = []
    left_out: list[str] = []
    for i, other in enumerate(raw):
        if not isinstance(other, dict):
            raise TableError(f"others[{i}] must be a JSON object, got {type(other).__name__}")
        name = other.get(_HEADER_TEXT[0])
        if not isinstance(name, str) or not name:
            raise TableError(f"others[{i}]: field {_HEADER_TEXT[0]!r} must be a non-empty "
                             f"string (a kernel's name), got {name!r}")
        if name == kernel or name in left_out or any(t.kernel == name for t in others):
            raise TableError(f"others[{i}] holds kernel {name!r} again: a table holds each "
                             f"kernel's entries once (kernel {kernel!r} in 'entries', each "
                             "other in one 'others' item); merge them, or export the table "
                             "again")
        if name not in KERNELS:
            left_out.append(name)
            continue
        try:
            others.append(LookupTable.from_dict(
                {**{field_name: other.get(field_name) for field_name in _OTHER_FIELDS},
                 "schema_version": version, "device_kind": device_kind}))
        except AutotuneError as error:
            raise TableError(f"others[{i}]: {error}") from None
    return tuple(others), tuple(left_out)


def _schema_features(raw: Any, version: int) -> Any:
    """``raw`` (an entry or a choice), unless its problem uses a feature (window, softcap,
    segment ids, bottom-right alignment) that its table's schema ``version`` predates."""
    problem = raw.get("problem") if isinstance(raw, dict) else None
    if not isinstance(problem, dict):
        return raw
    used = [name for name, since in FEATURE_SINCE.items()
            if version < since and problem.get(name) not in (None, False)]
    if used:
        since = max(FEATURE_SINCE[name] for name in used)
        raise TableError(f"problem field(s) {', '.join(used)} came with schema_version "
                         f"{since}; a schema {version} table has none (export the table again "
                         "with this build)")
    return raw


def _parse_each(raw_items: list[Any], what: str, parse: Any) -> tuple[Any, ...]:
    """Each item parsed; the first bad one, or one repeating an earlier one's problem (an
    import would keep one and a pinned table run the other), is a ``TableError`` naming its
    index."""
    parsed: dict[Problem, Any] = {}
    for index, raw in enumerate(raw_items):
        try:
            item = parse(raw)
        except (AutotuneError, TypeError) as error:
            raise TableError(f"{what} {index}: {error}") from None
        if item.problem in parsed:
            earlier = list(parsed).index(item.problem)
            raise TableError(f"{what} {index} repeats the problem of {what} {earlier} "
                             f"({item.problem.label()}); a table holds one {what} per "
                             "problem: keep one of them")
        parsed[item.problem] = item
    return tuple(parsed.values())


# The table's non-empty text fields, the kernel's name first.
_HEADER_TEXT = tuple(f.name for f in dataclasses.fields(LookupTable)[:3])


def find_entry(problem: Problem, entries: Sequence[TableEntry],
               kernel: str) -> tuple[TableEntry, str] | None:
    """``(entry, "exact")`` for ``problem``, else ``(entry, "nearest")``
    (:func:`nearest_entry`), else None: of one table, or of several in order."""
    return ProblemIndex(entries, lambda entry: kernel).find(problem)


def find_choice(problem: Problem,
                choices: Sequence[KernelChoice]) -> tuple[KernelChoice, str] | None:
    """As :func:`find_entry`, for kernel choices (``ProblemIndex.nearest``)."""
    return ProblemIndex(choices, lambda choice: choice.kernel).find(problem)


class ProblemIndex:
    """Table entries or kernel choices indexed by problem: an exact lookup is one dict read;
    a nearest one looks only at the problem's family (its ``family()``), visits its buckets
    (``nearest_axes()``: an attention problem's (q_len, kv_len)) closest first and stops once a
    bucket cannot hold anything closer than the best legal item found, checking rules closest
    first. Earlier items win ties."""

    def __init__(self, items: Iterable[Any], kernel_of: Callable[[Any], str]) -> None:
        self._kernel_of = kernel_of
        self._exact: dict[Any, Any] = {}
        self._families: dict[tuple[Any, ...], dict[tuple[int, ...], list[Any]]] = {}
        for order, item in enumerate(items):
            self._exact.setdefault(item.problem, item)
            self._families.setdefault(item.problem.family(), {}).setdefault(
                item.problem.nearest_axes(), []).append((order, item))

    def find(self, problem: Any,
             legal: Callable[[Any], bool] | None = None) -> tuple[Any, str] | None:
        """``(item, "exact")``, else ``(item, "nearest")``, else None."""
        exact = self._exact.get(problem)
        if exact is not None:
            return exact, "exact"
        item = self.nearest(problem, legal)
        return (item, "nearest") if item is not None else None

    def nearest(self, problem: Any, legal: Callable[[Any], bool] | None = None) -> Any:
        """The closest item of the family whose config passes its kernel's stored-config rules
        for ``problem`` (its ``distance``), or ``legal(item)`` where given (a device's rules:
        :func:`legal_on`); None when none does."""
        legal = legal or (lambda item: self._legal(problem, item))
        buckets = self._families.get(problem.family(), {})
        # The bucket axes' part of the distance: a lower bound for a whole bucket.
        bounds = sorted((problem.axes_distance(axes), axes) for axes in buckets)
        best: tuple[float, int, Any] | None = None
        for bound, axes in bounds:
            if best is not None and bound > best[0]:
                break
            ranked = [(problem.distance(item.problem), order, item)
                      for order, item in buckets[axes]]
            heapq.heapify(ranked)
            while ranked and (best is None or ranked[0][:2] < best[:2]):
                found = heapq.heappop(ranked)
                if legal(found[2]):
                    best = found
                    break
        return best[2] if best is not None else None

    def _legal(self, problem: Problem, item: Any) -> bool:
        """Whether ``item``'s kernel is registered and its config legal for ``problem``."""
        name = self._kernel_of(item)
        if not is_registered(name):
            return False
        rules = registered_kernel(name)
        return (isinstance(item.config, rules.config_type)
                and not rules.stored_violations(problem, item.config))


def nearest_entry(problem: Problem, entries: Iterable[TableEntry],
                  kernel: str) -> TableEntry | None:
    """The closest tuned problem of the same family (``Problem.family``: dtype, head_dim,
    causality, mode, window, softcap or none, segment ids or none, alignment) whose config
    (one of kernel ``kernel``'s) passes that kernel's stored-config rules for ``problem``; None
    when none does."""
    return ProblemIndex(entries, lambda entry: kernel).nearest(problem)


def legal_on(kernel: Any, problem: Any, target: Any) -> Callable[[Any], bool]:
    """Whether an item's config (a ``TunableKernel`` ``kernel``'s) passes every rule of
    ``kernel`` for ``problem`` on ``target`` (a ``Target`` or its name), its VMEM included: the
    nearest entry a device may run (``ProblemIndex.nearest``'s ``legal``)."""
    return lambda item: (isinstance(item.config, kernel.config_type)
                         and not kernel.violations(problem, item.config, target))
