"""The base of every backend's config: a frozen, typed, validated dataclass of integers.

Pure Python (no jax): the service and storage read and write configs too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from kernel.errors import ConfigError
from kernel.problem import MAX_SEQ_LEN


@dataclass(frozen=True)
class IntConfig:
    """Base of the kernels' configs: frozen dataclasses of positive integers, none larger than
    the longest sequence (``MAX_SEQ_LEN``): no block, depth or warp count is.

    Subclasses declare fields with defaults and ``label``. Relations between fields (a minor
    block dividing its major block, ...) are legality rules of the kernel, not errors here, so
    the search can ask about any combination and get the broken rule's name.
    """

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{field.name} must be an integer, got {value!r}")
            if not 1 <= value <= MAX_SEQ_LEN:
                shown = value if value.bit_length() <= 64 else "a larger number"  # printable
                raise ConfigError(f"{field.name} must be from 1 to {MAX_SEQ_LEN}, got {shown}")

    def to_dict(self) -> dict[str, int]:
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

    def replace(self, **changes: int) -> Self:
        return dataclasses.replace(self, **changes)

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.to_dict().items())
