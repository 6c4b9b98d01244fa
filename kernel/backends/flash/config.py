"""The flash kernel's config: block sizes and pipeline depths of its three kernels, and whether
the backward fuses dQ into the dK/dV kernel."""

from __future__ import annotations

from dataclasses import dataclass

from kernel.config import IntConfig
from kernel.errors import ConfigError


@dataclass(frozen=True)
class FlashConfig(IntConfig):
    """Tiles and pipeline depths of the forward and backward kernels.

    Forward: the grid walks ``block_q`` query rows against ``block_kv`` keys per step; inside a
    step the logits are computed ``block_kv_compute`` keys at a time (bounding the f32 temporaries
    in VMEM). Backward: the dK/dV kernel walks ``block_kv_dkv`` keys against ``block_q_dkv``
    queries; the dQ kernel walks ``block_q_dq`` queries against ``block_kv_dq`` keys.
    Each kernel streams the operands of its inner loop from HBM through a pipeline of
    ``pipeline_depth*`` VMEM buffers per operand (1 to 4: synchronous, double buffered, or
    up to three blocks in flight ahead of the compute): ``pipeline_depth`` K and V in the
    forward, ``pipeline_depth_dkv`` Q, dO and the row statistics in dK/dV,
    ``pipeline_depth_dq`` K and V in dQ. One depth per kernel, not one for all: the kernels
    stream different operands against different compute per block, so their best depths
    differ, and each kernel then compiles from its own fields alone (precheck's additive
    coverage of the gradient program). A config stored before the backward depths existed
    loads with them at the default.

    ``fused_bwd`` (issue 74): the dK/dV kernel computes dQ too, as splash's
    ``use_fused_bwd_kernel``, summing it over its kv blocks in VMEM (the whole sequence's dQ of
    a kv head's group: for short sequences); the dQ kernel does not run, and its fields are
    unused: None (then and only then). A config stored before the flag existed loads unfused.
    """

    block_q: int = 128
    block_kv: int = 128
    block_kv_compute: int = 128
    block_q_dkv: int = 128
    block_kv_dkv: int = 128
    block_q_dq: int | None = 128
    block_kv_dq: int | None = 128
    pipeline_depth: int = 2
    pipeline_depth_dkv: int = 2
    pipeline_depth_dq: int | None = 2
    fused_bwd: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_kv % self.block_kv_compute:
            raise ConfigError(
                f"block_kv_compute ({self.block_kv_compute}) must divide block_kv "
                f"({self.block_kv})"
            )

    def label(self, mode: str = "fwd_bwd") -> str:
        forward = f"q{self.block_q} kv{self.block_kv}/{self.block_kv_compute} " \
                  f"depth{self.pipeline_depth}"
        if mode == "fwd":
            return forward
        dq = ("fused" if self.fused_bwd else
              f"dq{self.block_q_dq}x{self.block_kv_dq}/depth{self.pipeline_depth_dq}")
        return (f"{forward} dkv{self.block_q_dkv}x{self.block_kv_dkv}/depth"
                f"{self.pipeline_depth_dkv} {dq}")

    def fused(self) -> FlashConfig:
        """This config with the fused backward (dQ in the dK/dV kernel): no dQ fields."""
        return self.replace(fused_bwd=True, **dict.fromkeys(DQ_FIELDS))


FORWARD_FIELDS = ("block_q", "block_kv", "block_kv_compute", "pipeline_depth")
# The fused flag belongs to the dK/dV kernel, which it changes (dQ added); the dQ kernel's
# fields are then None.
DKV_FIELDS = ("block_q_dkv", "block_kv_dkv", "pipeline_depth_dkv", "fused_bwd")
DQ_FIELDS = ("block_q_dq", "block_kv_dq", "pipeline_depth_dq")
DEPTH_FIELDS = ("pipeline_depth", "pipeline_depth_dkv", "pipeline_depth_dq")
