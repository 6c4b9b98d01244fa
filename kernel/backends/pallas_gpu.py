"""JAX's Pallas Triton attention for GPUs (``jax.experimental.pallas.ops.gpu.attention.mha``)
as a tunable kernel: block sizes, warps per program and forward pipeline stages.

Upstream differences this wrapper hides: layout ``[batch, seq, heads, head_dim]`` (q, k, v are
transposed in and the output or gradients transposed back, inside the measured function); no
grouped-query attention (K/V heads are repeated with ``jnp.repeat``); ``sm_scale`` defaults to
1.0 upstream, here ``head_dim ** -0.5``. On a GPU the kernels compile with Triton; on any other
platform they run with ``interpret=True`` (a correctness oracle; block sizes, warps and stages
do not change what it computes).

Rules (Triton's and upstream's): blocks are powers of two (Triton tensors), at least 16 (the
minimum ``tl.dot`` tile), at most and dividing their sequence axis (upstream raises otherwise);
the fused backward walks q in ``block_q_dq`` and kv in ``block_kv_dkv`` blocks on one grid axis,
so ``q_len / block_q_dq == kv_len / block_kv_dkv``. Shared memory and registers are not
estimated: an oversized config fails in the Triton compiler on the GPU, and the tuner records
that failure.

Deprecated upstream: jax 0.12 warns on importing ``pallas/ops/gpu/attention.py`` ("use
tokamax.dot_product_attention instead"); it still ships it, unchanged. This backend keeps JAX's
module rather than tokamax's Triton kernel: tokamax (0.0.12 on the package index) would add
absl-py, einshape, jaxtyping, pydantic, qwix, tensorboardx and an exact ``typeguard==2.13.3``
pin to what is today a jax-only ``kernel`` install, for a pre-1.0 API. The warning is silenced
at our one import (:func:`upstream_module`); ``tests/test_mosaic_gpu.py`` fails (smoke, on the
newest jax) the day JAX removes the module, which is when to move to tokamax's
``pallas_triton`` implementation. ``mosaic_gpu`` is the Hopper kernel JAX does not deprecate.

Pure Python at import; jax loads in ``build``.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

from kernel.config import IntConfig
from kernel.contract import (
    AttentionFn,
    ConfigFor,
    Params,
    TunableKernel,
    per_mode,
    repeat_kv_heads,
)
from kernel.problem import Problem
from kernel.rules import Violation, feature_violations, x64_violations
from kernel.targets import GPU_TARGET, Target

MIN_BLOCK = 16  # tl.dot needs every tile dimension >= 16
MAX_FWD_BLOCK = 256  # searched forward tiles: a (256, head_dim) f32 accumulator fills registers
MAX_BWD_BLOCK = 128  # searched backward tiles: dK and dV accumulators share the registers
NUM_WARPS = (1, 2, 4, 8, 16)  # legal; the search tries SEARCH_WARPS
SEARCH_WARPS = (4, 8)
MAX_STAGES = 4  # software pipeline depth of the forward K/V loads (the backward uses 2)


def upstream_module() -> ModuleType:
    """``jax.experimental.pallas.ops.gpu.attention``, without its deprecation warning (see the
    module docstring); ImportError once JAX removes it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ops.gpu.attention is deprecated",
                                category=DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention
    return attention


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def pow2_blocks(dim: int, cap: int) -> list[int]:
    """Powers of two from ``MIN_BLOCK`` to ``min(dim, cap)`` that divide ``dim``."""
    out, size = [], MIN_BLOCK
    while size <= min(dim, cap):
        if dim % size == 0:
            out.append(size)
        size *= 2
    return out


@dataclass(frozen=True)
class PallasGpuConfig(IntConfig):
    """Forward: ``block_q`` query rows per program, keys ``block_k`` at a time, ``num_stages``
    K/V loads in flight. Fused backward: dK/dV for ``block_kv_dkv`` keys walking queries in
    ``block_q_dkv`` blocks, then dQ for ``block_q_dq`` queries walking keys in ``block_kv_dq``
    blocks. ``num_warps`` for the forward and backward programs. Defaults are upstream's
    (``BlockSizes.get_default()``, ``num_stages=2``)."""

    block_q: int = 128
    block_k: int = 128
    block_q_dkv: int = 32
    block_kv_dkv: int = 32
    block_q_dq: int = 32
    block_kv_dq: int = 32
    num_warps: int = 4
    num_stages: int = 2

    def label(self, mode: str = "fwd_bwd") -> str:
        backward = "" if mode == "fwd" else (f"dkv{self.block_q_dkv}x{self.block_kv_dkv} "
                                             f"dq{self.block_q_dq}x{self.block_kv_dq} ")
        return (f"q{self.block_q} k{self.block_k} {backward}w{self.num_warps} "
                f"s{self.num_stages}")


_FWD_AXES = (("block_q", "q_len"), ("block_k", "kv_len"))
_BWD_AXES = (("block_q_dkv", "q_len"), ("block_kv_dkv", "kv_len"), ("block_q_dq", "q_len"),
             ("block_kv_dq", "kv_len"))


def _block_violations(field: str, block: int, dim: int, dim_name: str) -> list[Violation]:
    out = []
    if not _is_pow2(block) or block < MIN_BLOCK:
        out.append(Violation("block_pow2", f"{field}={block} must be a power of two and at "
                             f"least {MIN_BLOCK} (Triton tiles)"))
    if block > dim:
        out.append(Violation("block_max", f"{field}={block} is larger than {dim_name}={dim}"))
    elif dim % block:
        out.append(Violation("block_divides", f"{field}={block} does not divide "
                             f"{dim_name}={dim}; pick one of {pow2_blocks(dim, dim)}"))
    return out


def _fused_block_pairs(q_len: int, kv_len: int) -> list[tuple[int, int]]:
    """(block_q_dq, block_kv_dkv) pairs of legal blocks that split q_len and kv_len into
    equally many blocks, as the fused backward needs."""
    return [(b, kv_len * b // q_len) for b in pow2_blocks(q_len, q_len)
            if kv_len * b % q_len == 0 and kv_len * b // q_len in pow2_blocks(kv_len, kv_len)]


@dataclass(frozen=True)
class PallasGpuKernel(TunableKernel):
    name: ClassVar[str] = "pallas_gpu"
    version: ClassVar[str] = "1"
    description: ClassVar[str] = ("JAX's Pallas Triton attention for GPUs "
                                  "(jax.experimental.pallas.ops.gpu.attention.mha); "
                                  "GQA by repeating K/V heads")
    targets: ClassVar[tuple[str, ...]] = (GPU_TARGET.name, "cpu")
    platforms: ClassVar[tuple[str, ...]] = ("gpu",)
    config_type: ClassVar[type[PallasGpuConfig]] = PallasGpuConfig
    landscape_axes: ClassVar[tuple[str, str, str]] = ("block_q", "block_k", "num_stages")

    def problem_violations(self, problem: Problem) -> list[Violation]:
        out = []
        for axis in ("q_len", "kv_len"):
            if not pow2_blocks(getattr(problem, axis), getattr(problem, axis)):
                out.append(Violation("seq_len", f"{axis}={getattr(problem, axis)} has no "
                                     f"power-of-two block of at least {MIN_BLOCK} dividing it; "
                                     f"pad it to a multiple of {MIN_BLOCK}"))
        if problem.head_dim <= MIN_BLOCK // 2:
            out.append(Violation("head_dim", f"head_dim={problem.head_dim} is padded to a power "
                                 f"of two that must be at least {MIN_BLOCK} (tl.dot tiles)"))
        if problem.causal and problem.q_len > problem.kv_len:
            out.append(Violation("causal", f"causal with q_len={problem.q_len} > kv_len="
                                 f"{problem.kv_len}: upstream's causal loops run past the last "
                                 "key block (out-of-bounds reads); use the xla kernel"))
        if (problem.mode == "fwd_bwd" and not out
                and not _fused_block_pairs(problem.q_len, problem.kv_len)):
            out.append(Violation("fused_backward", f"q_len={problem.q_len} and kv_len="
                                 f"{problem.kv_len} have no power-of-two blocks that split them "
                                 "into equally many blocks (the fused backward walks both on "
                                 "one grid axis); pad them to a power-of-two ratio"))
        # Upstream's segment ids are one array for queries and keys alike, and it has no
        # window or soft cap: all three refused.
        return out + x64_violations() + feature_violations(problem, self.name)

    def space_params(self, problem: Problem) -> Params:
        params: Params = {
            "block_q": pow2_blocks(problem.q_len, MAX_FWD_BLOCK),
            "block_k": pow2_blocks(problem.kv_len, MAX_FWD_BLOCK),
            "num_warps": list(SEARCH_WARPS),
            "num_stages": list(range(1, MAX_STAGES + 1)),
        }
        if problem.mode == "fwd_bwd":
            params.update({field: pow2_blocks(getattr(problem, axis), MAX_BWD_BLOCK)
                           for field, axis in _BWD_AXES})
        return {name: values or [MIN_BLOCK] for name, values in params.items()}

    def violations(self, problem: Problem, config: PallasGpuConfig,
                   target: Target | str = "cpu") -> list[Violation]:
        self.target(target)  # no per-target limits (see the module docstring)
        out = self.problem_violations(problem)
        axes = _FWD_AXES + (_BWD_AXES if problem.mode == "fwd_bwd" else ())
        for field, axis in axes:
            out += _block_violations(field, getattr(config, field), getattr(problem, axis),
                                     axis)
        if problem.mode == "fwd_bwd" and (problem.q_len // config.block_q_dq
                                          != problem.kv_len // config.block_kv_dkv):
            out.append(Violation("fused_backward", f"q_len/block_q_dq = {problem.q_len}/"
                                 f"{config.block_q_dq} must equal kv_len/block_kv_dkv = "
                                 f"{problem.kv_len}/{config.block_kv_dkv} (one grid axis walks "
                                 "both)"))
        if config.num_warps not in NUM_WARPS:
            out.append(Violation("num_warps", f"num_warps={config.num_warps} must be one of "
                                 f"{list(NUM_WARPS)}"))
        if config.num_stages > MAX_STAGES:
            out.append(Violation("num_stages", f"num_stages={config.num_stages} must be at most "
                                 f"{MAX_STAGES}"))
        return out

    def default_config(self, problem: Problem, target: Target | str = "cpu") -> PallasGpuConfig:
        """Upstream's defaults (128-row forward tiles, 32-row backward tiles, 2 stages, 4 warps
        for head_dim <= 64 else 8), each block clamped to a legal value; for ``q_len !=
        kv_len`` the dK/dV key block keeps the fused backward's block counts equal."""
        self.target(target)
        q_len, kv_len = problem.q_len, problem.kv_len

        def pick(dim: int, cap: int) -> int:
            fitting = [b for b in pow2_blocks(dim, dim) if b <= cap]
            return max(fitting) if fitting else MIN_BLOCK

        # the (block_q_dq, block_kv_dkv) pair with equal block counts nearest 32 rows
        block_q_dq, block_kv_dkv = min(_fused_block_pairs(q_len, kv_len),
                                       key=lambda p: abs(math.log2(p[0] / 32)),
                                       default=(pick(q_len, 32), pick(kv_len, 32)))
        return PallasGpuConfig(
            block_q=pick(q_len, 128), block_k=pick(kv_len, 128),
            block_q_dkv=pick(q_len, 32), block_kv_dkv=block_kv_dkv,
            block_q_dq=block_q_dq, block_kv_dq=pick(kv_len, 32),
            num_warps=4 if problem.head_dim <= 64 else 8, num_stages=2)

    def attention(self, problem: Problem, config_for: ConfigFor,
                  sm_scale: float) -> AttentionFn:
        """The forward function in our layout (upstream's layout is ``[batch, seq, heads,
        head_dim]``; its own custom VJP differentiates it with the config's backward blocks,
        so a differentiated call runs the ``fwd_bwd`` config: :func:`per_mode`): Triton on
        CUDA/ROCm, interpret mode elsewhere."""
        import jax.numpy as jnp
        from jax import lax

        upstream = upstream_module()

        def attend_with(config: PallasGpuConfig) -> AttentionFn:
            sizes = upstream.BlockSizes(
                block_q=config.block_q, block_k=config.block_k, block_q_dkv=config.block_q_dkv,
                block_kv_dkv=config.block_kv_dkv, block_q_dq=config.block_q_dq,
                block_kv_dq=config.block_kv_dq)

            def run(interpret: bool, q, k, v):  # noqa: ANN001, ANN202
                k, v = repeat_kv_heads(problem, k, v)
                q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
                out = upstream.mha(q, k, v, None, sm_scale=sm_scale, causal=problem.causal,
                                   block_sizes=sizes, num_warps=config.num_warps,
                                   num_stages=config.num_stages, interpret=interpret)
                return jnp.swapaxes(out, 1, 2)

            return lambda q, k, v: lax.platform_dependent(
                q, k, v, cuda=functools.partial(run, False),
                rocm=functools.partial(run, False), default=functools.partial(run, True))

        return per_mode(attend_with, config_for)


KERNEL = PallasGpuKernel()
