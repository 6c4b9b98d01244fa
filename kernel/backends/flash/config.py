"""The flash kernel's config: block sizes of its three kernels and the K/V pipeline depth."""

from __future__ import annotations

from dataclasses import dataclass

from kernel.config import IntConfig
from kernel.errors import ConfigError


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
