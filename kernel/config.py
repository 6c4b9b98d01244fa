"""Configs of the kernels: frozen, typed, validated dataclasses of integers (``IntConfig``),
and the flash kernel's block sizes and pipeline depth (``FlashConfig``).

Pure Python (no jax): the service and storage read and write configs too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self


class ConfigError(ValueError):
    """A config is malformed or illegal; the message names the field or rule and the fix."""


@dataclass(frozen=True)
class IntConfig:
    """Base of the kernels' configs: frozen dataclasses of positive integers.

    Subclasses declare fields with defaults and ``label``. Relations between fields (a minor
    block dividing its major block, ...) are legality rules of the kernel, not errors here, so
    the search can ask about any combination and get the broken rule's name (``FlashConfig``
    still refuses one relation itself).
    """

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{field.name} must be an integer, got {value!r}")
            if value < 1:
                raise ConfigError(f"{field.name} must be positive, got {value}")

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


@dataclass(frozen=True)
class FlashConfig(IntConfig):
    """Tiles of the forward and backward kernels and the K/V pipeline depth.

    Forward: the grid walks ``block_q`` query rows against ``block_kv`` keys per step; inside a
    step the logits are computed ``block_kv_compute`` keys at a time (bounding the f32 temporaries
    in VMEM). Backward: the dK/dV kernel walks ``block_kv_dkv`` keys against ``block_q_dkv``
    queries; the dQ kernel walks ``block_q_dq`` queries against ``block_kv_dq`` keys.
    ``pipeline_depth`` is the buffer count of the streamed K/V inputs (forward and dQ).
    """

    block_q: int = 128
    block_kv: int = 128
    block_kv_compute: int = 128
    block_q_dkv: int = 128
    block_kv_dkv: int = 128
    block_q_dq: int = 128
    block_kv_dq: int = 128
    pipeline_depth: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_kv % self.block_kv_compute:
            raise ConfigError(
                f"block_kv_compute ({self.block_kv_compute}) must divide block_kv "
                f"({self.block_kv})"
            )

    def label(self) -> str:
        return (
            f"q{self.block_q} kv{self.block_kv}/{self.block_kv_compute} "
            f"dkv{self.block_q_dkv}x{self.block_kv_dkv} dq{self.block_q_dq}x{self.block_kv_dq} "
            f"depth{self.pipeline_depth}"
        )


FORWARD_FIELDS = ("block_q", "block_kv", "block_kv_compute", "pipeline_depth")
BACKWARD_FIELDS = ("block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq")
