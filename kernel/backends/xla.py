"""Backends ``xla`` and ``cudnn``: ``jax.nn.dot_product_attention`` with
``implementation="xla"`` (every platform: the candidate that can always run) or ``"cudnn"``
(NVIDIA GPUs only). Neither has a tunable field: the space is one config.

Pure Python at import; jax loads in ``attention``. Grouped-query K/V heads are broadcast by
``dot_product_attention`` itself; the layout is transposed to its ``[batch, seq, heads,
head_dim]`` and back.

Features: ``xla`` runs all four, a window as ``local_window_size``, segment ids as a boolean
``mask`` (``kernel.contract.attention_mask``), and soft-capping and bottom-right alignment,
which ``jax.nn`` lacks, through :func:`kernel.contract.reference_attention` (plain jnp). A
query that sees no key gets zeros, as the reference's. ``cudnn`` runs what cuDNN's fused
attention takes natively: a window on a causal problem (its sliding window is left-only);
soft-capping, segment ids and bottom-right alignment are refused by rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kernel.config import IntConfig
from kernel.contract import (
    AttentionFn,
    ConfigFor,
    Params,
    TunableKernel,
    attention_mask,
    reference_attention,
)
from kernel.problem import Problem
from kernel.rules import Violation, feature_violations
from kernel.targets import GPU_TARGET, TPU_TARGETS, Target

CUDNN_DTYPES = ("bfloat16",)  # cuDNN's fused attention takes half precision, not float32
CUDNN_MAX_HEAD_DIM = 128


@dataclass(frozen=True)
class XlaConfig(IntConfig):
    """No tunable field: XLA (or cuDNN) picks its own tiling."""

    def label(self, mode: str = "fwd_bwd") -> str:
        return "default"


@dataclass(frozen=True)
class XlaKernel(TunableKernel):
    implementation: ClassVar[str] = "xla"
    name: ClassVar[str] = "xla"
    version: ClassVar[str] = "1"
    description: ClassVar[str] = ("XLA's attention (jax.nn.dot_product_attention, "
                                  "implementation='xla'): no tiles to tune, runs everywhere")
    targets: ClassVar[tuple[str, ...]] = (*TPU_TARGETS, GPU_TARGET.name)
    platforms: ClassVar[tuple[str, ...]] = ("tpu", "gpu", "cpu")
    config_type: ClassVar[type[XlaConfig]] = XlaConfig
    landscape_axes: ClassVar[tuple[str, ...]] = ()

    def space_params(self, problem: Problem) -> Params:
        return {}

    def violations(self, problem: Problem, config: XlaConfig,
                   target: Target | str = "cpu") -> list[Violation]:
        self.target(target)
        return self.problem_violations(problem)

    def default_config(self, problem: Problem, target: Target | str = "cpu") -> XlaConfig:
        self.target(target)
        return XlaConfig()

    def attention(self, problem: Problem, config_for: ConfigFor,
                  sm_scale: float) -> AttentionFn:
        import jax
        import jax.numpy as jnp

        config_for(problem.mode)  # nothing to read, but an explicit config is still checked

        def attend(q: Any, k: Any, v: Any, *segment_ids: Any) -> Any:
            # jax.nn lacks soft-capping, and its causal and window masks are top-left.
            if problem.softcap is not None or problem.bottom_right:
                # f32: bf16 probabilities put dK 5x off (peers)
                wide = (x.astype(jnp.promote_types(x.dtype, jnp.float32)) for x in (q, k, v))
                return reference_attention(*wide, *segment_ids, causal=problem.causal,
                                           sm_scale=sm_scale, window=problem.window,
                                           softcap=problem.softcap,
                                           query_offset=problem.query_offset).astype(q.dtype)
            ids = dict(zip(("q_segment_ids", "kv_segment_ids"), segment_ids))
            mask = attention_mask(problem.q_len, problem.kv_len, **ids) if ids else None
            out = jax.nn.dot_product_attention(
                *(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), mask=mask, scale=sm_scale,
                is_causal=problem.causal, local_window_size=problem.window,
                implementation=self.implementation)
            out = jnp.swapaxes(out, 1, 2)
            if problem.window is None and not ids:
                return out
            seen = attention_mask(problem.q_len, problem.kv_len, causal=problem.causal,
                                  window=problem.window, **ids).any(axis=-1, keepdims=True)
            return jnp.where(seen, out, 0).astype(out.dtype)  # a query that sees no key: zeros

        return attend


@dataclass(frozen=True)
class CudnnKernel(XlaKernel):
    implementation: ClassVar[str] = "cudnn"
    name: ClassVar[str] = "cudnn"
    description: ClassVar[str] = ("cuDNN's fused attention (jax.nn.dot_product_attention, "
                                  "implementation='cudnn'): NVIDIA GPUs, bfloat16")
    targets: ClassVar[tuple[str, ...]] = (GPU_TARGET.name,)  # refused elsewhere, by name
    platforms: ClassVar[tuple[str, ...]] = ("gpu",)

    def problem_violations(self, problem: Problem) -> list[Violation]:
        out = []
        if problem.dtype not in CUDNN_DTYPES:
            out.append(Violation("dtype", f"cuDNN attention takes {', '.join(CUDNN_DTYPES)}, "
                                 f"not {problem.dtype}; cast the inputs or use the xla kernel"))
        if problem.head_dim > CUDNN_MAX_HEAD_DIM or problem.head_dim % 8:
            out.append(Violation("head_dim", f"head_dim={problem.head_dim} must be a multiple "
                                 f"of 8 and at most {CUDNN_MAX_HEAD_DIM} for cuDNN"))
        if problem.window is not None and not problem.causal:
            out.append(Violation("window", f"cuDNN's sliding window is causal (left only), but "
                                 f"{problem.label()} is not causal; use splash or xla"))
        return out + feature_violations(problem, self.name, frozenset({"window"}))


KERNEL = XlaKernel()
CUDNN = CudnnKernel()
