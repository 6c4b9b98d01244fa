"""The base of every backend's config: a frozen, typed, validated dataclass whose field types
declare the values each field takes.

- ``int``: a size (block, depth, warp count): from 1 to ``MAX_SEQ_LEN``.
- ``int | None``: a size, or ``None`` for one the config leaves unused (it is stored as null,
  never as a meaningful number; the kernel's rules say when it must be unused).
- ``bool``: a flag.
- ``Literal["A", "B", ...]``: an enum of strings (a layout, ...).

Pure Python (no jax): the service and storage read and write configs too, as JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Self

from kernel.errors import ConfigError
from kernel.problem import MAX_SEQ_LEN

ConfigValue = int | bool | str | None  # what a config field holds, in Python and in JSON


@dataclass(frozen=True)
class FieldKind:
    """What one field's type admits: sizes (``choices`` None) or a closed set of choices,
    and whether ``None`` (unused) is admitted besides."""

    choices: tuple[bool | str, ...] | None
    optional: bool = False

    def error(self, name: str, value: Any) -> str | None:
        """Why ``value`` is not admitted for field ``name``, or None when it is."""
        if value is None:
            return None if self.optional else f"{name} must be set, got None"
        if self.choices is not None:  # by type too: 1 is no flag, True no layout
            if any(type(value) is type(c) and value == c for c in self.choices):
                return None
            return f"{name} must be one of {list(self.choices)}, got {value!r}"
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{name} must be an integer, got {value!r}"
        if not 1 <= value <= MAX_SEQ_LEN:
            shown = value if value.bit_length() <= 64 else "a larger number"  # printable
            return f"{name} must be from 1 to {MAX_SEQ_LEN}, got {shown}"
        return None


def _field_kind(hint: Any) -> FieldKind:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return dataclasses.replace(_field_kind(rest[0]), optional=True)
    if hint is bool:
        return FieldKind((False, True))
    if hint is int:
        return FieldKind(None)
    if typing.get_origin(hint) is Literal and args and all(isinstance(a, str) for a in args):
        return FieldKind(args)
    raise TypeError(f"unsupported config field type {hint!r}: use int, bool, a Literal of "
                    "strings, or one of them | None")


@functools.cache
def field_kinds(config_type: type) -> dict[str, FieldKind]:
    """Each field's :class:`FieldKind`, from ``config_type``'s annotations."""
    hints = typing.get_type_hints(config_type)
    return {f.name: _field_kind(hints[f.name]) for f in dataclasses.fields(config_type)}


@dataclass(frozen=True)
class IntConfig:
    """Base of the kernels' configs: frozen dataclasses of sizes (positive integers, none
    larger than the longest sequence, ``MAX_SEQ_LEN``: no block, depth or warp count is),
    flags and string enums, each field's type saying which (module doc).

    Subclasses declare fields with defaults and ``label``. Relations between fields (a minor
    block dividing its major block, ...) are legality rules of the kernel, not errors here, so
    the search can ask about any combination and get the broken rule's name.
    """

    def __post_init__(self) -> None:
        for name, kind in field_kinds(type(self)).items():
            error = kind.error(name, getattr(self, name))
            if error:
                raise ConfigError(error)

    @classmethod
    def choices(cls, name: str) -> list[Any]:
        """The values a flag or enum field takes, in declaration order ([] for a size)."""
        return list(field_kinds(cls)[name].choices or ())

    def to_dict(self) -> dict[str, ConfigValue]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Builds a config from a mapping; missing fields take their defaults."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a config must be a JSON object, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown} for {cls.__name__}; "
                              f"known: {names}")
        return cls(**data)

    def replace(self, **changes: ConfigValue) -> Self:
        return dataclasses.replace(self, **changes)

    def label(self, mode: str = "fwd_bwd") -> str:
        """A short name of the config; ``mode="fwd"`` leaves out what only the backward
        uses (backends that have one override this)."""
        return " ".join(f"{k}={v}" for k, v in self.to_dict().items())
