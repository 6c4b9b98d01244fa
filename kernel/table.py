"""Lookup tables: tuned configs as plain, versioned JSON that a model build can embed.

Pure Python (no jax): the service exports and imports the same format, and uses the same
nearest-match rule, as the kernel wrapper reading a pinned table.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernel.errors import AutotuneError, TableError
from kernel.problem import Problem
from kernel.registry import get_kernel

TABLE_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class TableEntry:
    """One tuned result: the problem, the winning config, and how it was measured."""

    problem: Problem
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
        """An entry whose config is one of kernel ``kernel``'s."""
        if not isinstance(data, dict):
            raise TableError(f"an entry must be a JSON object, got {type(data).__name__}")
        for name in ("problem", "config"):
            if name not in data:
                raise TableError(f"entry is missing {name!r}")
        problem = Problem.from_dict(data["problem"])
        config = get_kernel(kernel).config_from_dict(data["config"])
        numbers = {}
        for name in ("time_ms", "default_time_ms", "speedup"):
            value = data.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, int | float) or not math.isfinite(value) or value < 0):
                raise TableError(f"{name} must be a non-negative number, got {value!r}")
            numbers[name] = value
        provenance = data.get("provenance") or {}
        if not isinstance(provenance, dict):
            raise TableError("provenance must be a JSON object")
        return cls(problem=problem, config=config, provenance=provenance, **numbers)


@dataclass(frozen=True)
class LookupTable:
    """Tuned configs of one kernel on one device kind."""

    kernel: str
    kernel_version: str
    device_kind: str
    entries: tuple[TableEntry, ...]
    jax_version: str | None = None
    schema_version: int = TABLE_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return dict(schema_version=self.schema_version, kernel=self.kernel,
                    kernel_version=self.kernel_version, device_kind=self.device_kind,
                    jax_version=self.jax_version,
                    entries=[entry.to_dict() for entry in self.entries])

    @classmethod
    def from_dict(cls, data: Any) -> LookupTable:
        """Validates a whole table; the first bad entry is named by its index."""
        if not isinstance(data, dict):
            raise TableError(f"a table must be a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version != TABLE_SCHEMA_VERSION:
            raise TableError(f"unsupported schema_version {version!r}; this build reads "
                             f"version {TABLE_SCHEMA_VERSION} (re-export the table)")
        header = {name: data.get(name) for name in _HEADER_TEXT}
        for name, value in header.items():
            if not isinstance(value, str) or not value:
                raise TableError(f"table field {name!r} must be a non-empty string")
        kernel = get_kernel(header[_HEADER_TEXT[0]]).name
        raw_entries = data.get("entries")
        if not isinstance(raw_entries, list):
            raise TableError("table field 'entries' must be a list")
        entries = []
        for index, raw in enumerate(raw_entries):
            try:
                entries.append(TableEntry.from_dict(raw, kernel))
            except (AutotuneError, TypeError) as error:
                raise TableError(f"entry {index}: {error}") from None
        return cls(**header, entries=tuple(entries), jax_version=data.get("jax_version"))

    @classmethod
    def load(cls, path: str | Path) -> LookupTable:
        """Reads and validates a table file; every failure is a ``TableError`` naming it."""
        try:
            data = json.loads(Path(path).read_bytes().decode("utf-8"))
        except OSError as error:
            raise TableError(f"cannot read table {path}: {error.strerror}") from None
        except UnicodeDecodeError as error:
            raise TableError(f"table {path} is not UTF-8 text (byte {error.start}); export "
                             "it again with `autotune export`") from None
        except json.JSONDecodeError as error:
            raise TableError(f"table {path} is not valid JSON: {error}") from None
        except RecursionError:
            raise TableError(f"table {path} is nested too deeply to be a lookup table") from None
        try:
            return cls.from_dict(data)
        except AutotuneError as error:
            raise TableError(f"table {path}: {error}") from None

    def lookup(self, problem: Problem) -> tuple[TableEntry, str] | None:
        """The exact entry for ``problem``, else the nearest whose config is legal for it."""
        for entry in self.entries:
            if entry.problem == problem:
                return entry, "exact"
        entry = nearest_entry(problem, self.entries, self.kernel)
        return (entry, "nearest") if entry else None


# The table's non-empty text fields, the kernel's name first.
_HEADER_TEXT = tuple(f.name for f in dataclasses.fields(LookupTable)[:3])


def shape_distance(a: Problem, b: Problem) -> float:
    """How far apart two problems are, in octaves of their sizes."""
    return (abs(math.log2(a.q_len / b.q_len)) + abs(math.log2(a.kv_len / b.kv_len))
            + 0.5 * abs(math.log2(a.batch * a.q_heads / (b.batch * b.q_heads)))
            + 0.25 * abs(math.log2(a.group_size / b.group_size)))


def nearest_entry(problem: Problem, entries: Iterable[TableEntry],
                  kernel: str) -> TableEntry | None:
    """The closest tuned problem with the same dtype, head_dim, causality and mode whose
    config (one of kernel ``kernel``'s) passes that kernel's stored-config rules for
    ``problem``; None when none does."""
    rules = get_kernel(kernel)
    candidates = [
        entry for entry in entries
        if (entry.problem.dtype, entry.problem.head_dim, entry.problem.causal,
            entry.problem.mode) == (problem.dtype, problem.head_dim, problem.causal, problem.mode)
        and isinstance(entry.config, rules.config_type)
        and not rules.stored_violations(problem, entry.config)
    ]
    return min(candidates, key=lambda e: shape_distance(problem, e.problem), default=None)
