"""JAX's Mosaic GPU flash attention for Hopper (``jax.experimental.pallas.ops.gpu.attention_mgpu``,
FlashAttention-3 style: warp-specialised, TMA loads, wgmma) as a tunable kernel: tile shapes
and the pipeline depth.

Upstream (checked in jax 0.10.2 and 0.12.0.1, the same kernel): ``attention(q, k, v,
TuningConfig(...))`` in layout ``[batch, seq, heads, head_dim]``, grouped-query K/V heads
native, no softmax scale (q is scaled here), float16/bfloat16 only. The forward runs two
compute warpgroups of ``block_q`` rows each and one memory warpgroup that keeps
``max_concurrent_steps`` K/V blocks in flight. The backward is two kernels (dQ, then dK/dV),
each with ``compute_wgs_bwd`` compute warpgroups and the same pipeline depth; upstream's
backward has no causal mask, so causal ``fwd_bwd`` is refused.

Rules (upstream's own checks): blocks multiples of 64; ``q_len`` a multiple of ``2 *
block_q``, ``kv_len`` of ``block_kv``; the backward's blocks likewise (times
``compute_wgs_bwd`` where upstream multiplies); ``max_concurrent_steps >= 2``; ``head_dim`` a
multiple of 64 (at most 256, what upstream tests); bfloat16; not causal with ``q_len >
kv_len`` (the causal loop would read past the last key block). Plus the shared memory each of
its kernels allocates against the per-block limit (:func:`smem_bytes`), so configs that cannot
fit are never compiled.

It compiles only on an NVIDIA GPU of compute capability 9.0 (Hopper) or newer: its targets are
``gpu`` alone (refused on a CPU or TPU, as ``cudnn`` is), and :meth:`MosaicGpuKernel.discover`
reads the device's architecture so that an older GPU refuses it with the reason. There is no
interpret mode: on a CPU upstream asserts a CUDA runtime.

Pure Python at import; jax loads in ``attention`` and ``discover``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from kernel.config import IntConfig
from kernel.contract import AttentionFn, ConfigFor, Params, TunableKernel, per_mode
from kernel.problem import Problem
from kernel.rules import Violation, feature_violations
from kernel.targets import GPU_PLATFORMS, GPU_TARGET, Target

BLOCK_QUANTUM = 64  # wgmma's M tile and the (8, 64) TMA tiling: every block a multiple of 64
SEARCH_BLOCKS = (64, 128, 192, 256)  # forward tiles searched (the dividing ones)
SEARCH_BWD_BLOCKS = (64, 128)  # what upstream's backward tests use
MIN_DEPTH = 2  # upstream: max_concurrent_steps >= 2
SEARCH_DEPTHS = tuple(range(MIN_DEPTH, 7))  # the pipeline depths searched, 2-6
COMPUTE_WGS_BWD = (1, 2)  # upstream tests 2 (head_dim <= 128) and 1 (head_dim 256)
FWD_COMPUTE_WGS = 2  # the forward always runs two compute warpgroups
MAX_HEAD_DIM = 256
DTYPES = ("bfloat16",)  # upstream takes float16 and bfloat16; our problems are bf16 or f32
MIN_COMPUTE_CAPABILITY = (9, 0)  # Hopper: wgmma and TMA
CAUSAL_BROKEN_CUDA = (12080, 12091)  # upstream refuses causal on CUDA runtimes in [a, b)

# Shared memory, as Pallas Mosaic GPU allocates it (jax/_src/pallas/mosaic_gpu/lowering.py):
# every SMEM scratch rounded up to SMEM_ALIGNMENT, a kernel that reduces (max/sum over rows)
# reserves REDUCTION_SCRATCH_BYTES (CompilerParams.reduction_scratch_bytes' default) on top,
# and each mbarrier takes MBARRIER_BYTES after them (jax/experimental/mosaic/gpu/core.py).
SMEM_ALIGNMENT = 1024
REDUCTION_SCRATCH_BYTES = 128 * 4 * 4
MBARRIER_BYTES = 8
# The dynamic shared memory one block may opt into on Hopper (and Blackwell): the SM's 228 KiB
# less the 1 KiB the driver reserves per block; what Mosaic GPU checks a kernel against.
SMEM_PER_BLOCK = 227 * 1024
ELEMENT_BYTES = 2  # upstream's SMEM tiles are 16-bit whatever the input dtype
STAT_BYTES = 4  # log-sum-exp and delta rows are float32


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SMEM_ALIGNMENT) * SMEM_ALIGNMENT


@dataclass(frozen=True)
class MosaicGpuConfig(IntConfig):
    """Forward: each program runs two compute warpgroups of ``block_q`` query rows over keys
    ``block_kv`` at a time, with ``max_concurrent_steps`` K/V blocks in flight (the pipeline
    depth, shared by the backward). Backward: dQ for ``block_q_dq`` rows walking keys in
    ``block_kv_dq`` blocks, dK/dV for ``block_kv_dkv`` keys walking queries in ``block_q_dkv``
    blocks, each with ``compute_wgs_bwd`` compute warpgroups. Defaults: upstream's benchmark
    (block_q 64, depth 2) and backward test (blocks 64, two warpgroups), clamped per problem by
    :meth:`MosaicGpuKernel.default_config`."""

    block_q: int = 64
    block_kv: int = 128
    max_concurrent_steps: int = 2
    compute_wgs_bwd: int = 2
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    block_q_dq: int = 64
    block_kv_dq: int = 64

    def label(self, mode: str = "fwd_bwd") -> str:
        forward = f"q{self.block_q} kv{self.block_kv} s{self.max_concurrent_steps}"
        if mode == "fwd":
            return forward
        return (f"{forward} dkv{self.block_q_dkv}x{self.block_kv_dkv} dq{self.block_q_dq}x"
                f"{self.block_kv_dq} wg{self.compute_wgs_bwd}")


def _pipeline_depth(config: MosaicGpuConfig, steps: int) -> int:
    """The depth upstream really allocates: the config's, capped at the loop's step count."""
    return max(1, min(config.max_concurrent_steps, steps))


def smem_bytes(problem: Problem, config: MosaicGpuConfig,
               training: bool | None = None) -> dict[str, int]:
    """Shared memory per block of each kernel the problem's mode runs (``fwd``, and for
    ``fwd_bwd`` also ``dq`` and ``dkv``), in bytes, from upstream's allocations (A(x): x
    rounded up to 1024; d head_dim; s the depth, capped at the loop's steps; W
    compute_wgs_bwd; 2-byte tiles, 4-byte statistics):

    - fwd: A(2 block_q d 2) for Q/O + 2 A(s block_kv d 2) for K and V + A(2 block_q 4) for
      the log-sum-exp when training + 2048 reduction scratch + 8 (4 s + 3) barriers;
    - dq: 2 A(W block_q_dq d 2) for Q and dO + 2 A(W block_q_dq 4) for lse and delta +
      2 A(s block_kv_dq d 2) for the K/V pipeline + 8 (4 W + 3 s) barriers;
    - dkv: 2 A(W block_kv_dkv d 2) for K and V + 2 A(s block_q_dkv d 2) + 2 A(s block_q_dkv 4)
      for the Q/dO/lse/delta pipeline + 8 (2 W + 5 s) barriers.
    """
    d, E = problem.head_dim, ELEMENT_BYTES
    training = problem.mode == "fwd_bwd" if training is None else training
    depth = _pipeline_depth(config, problem.kv_len // config.block_kv)
    out = {"fwd": (_aligned(FWD_COMPUTE_WGS * config.block_q * d * E)
                   + 2 * _aligned(depth * config.block_kv * d * E)
                   + (_aligned(FWD_COMPUTE_WGS * config.block_q * STAT_BYTES) if training else 0)
                   + REDUCTION_SCRATCH_BYTES + MBARRIER_BYTES * (4 * depth + 3))}
    if problem.mode != "fwd_bwd":
        return out
    wgs = config.compute_wgs_bwd
    depth = _pipeline_depth(config, problem.q_len // (config.block_q_dq * wgs))
    out["dq"] = (2 * _aligned(wgs * config.block_q_dq * d * E)
                 + 2 * _aligned(wgs * config.block_q_dq * STAT_BYTES)
                 + 2 * _aligned(depth * config.block_kv_dq * d * E)
                 + MBARRIER_BYTES * (4 * wgs + 3 * depth))
    depth = _pipeline_depth(config, problem.kv_len // (config.block_kv_dkv * wgs))
    out["dkv"] = (2 * _aligned(wgs * config.block_kv_dkv * d * E)
                  + 2 * _aligned(depth * config.block_q_dkv * d * E)
                  + 2 * _aligned(depth * config.block_q_dkv * STAT_BYTES)
                  + MBARRIER_BYTES * (2 * wgs + 5 * depth))
    return out


def _multiple_of(field: str, value: int, axis: str, length: int, times: int = 1,
                 by: str = "") -> list[Violation]:
    """``field`` a multiple of 64, and ``times * value`` dividing the ``axis`` length."""
    out = []
    if value % BLOCK_QUANTUM:
        out.append(Violation("block_multiple", f"{field}={value} must be a multiple of "
                             f"{BLOCK_QUANTUM}"))
    elif length % (value * times):
        span = f"{times} x {field}{by}" if times > 1 else field
        out.append(Violation("block_divides", f"{axis}={length} must be a multiple of {span} "
                             f"= {value * times}; pick a smaller {field}"))
    return out


@dataclass(frozen=True)
class MosaicGpuKernel(TunableKernel):
    name: ClassVar[str] = "mosaic_gpu"
    version: ClassVar[str] = "1"
    description: ClassVar[str] = ("JAX's Mosaic GPU flash attention for Hopper "
                                  "(jax.experimental.pallas.ops.gpu.attention_mgpu): "
                                  "warp-specialised, TMA, wgmma; sm90+")
    targets: ClassVar[tuple[str, ...]] = (GPU_TARGET.name,)  # refused elsewhere, by name
    platforms: ClassVar[tuple[str, ...]] = ("gpu",)
    config_type: ClassVar[type[MosaicGpuConfig]] = MosaicGpuConfig
    landscape_axes: ClassVar[tuple[str, str, str]] = ("block_q", "block_kv",
                                                      "max_concurrent_steps")
    # No kernels' share is reported (profile_names empty; every kernel's whole step is timed
    # anyway): upstream's backward computes delta and, for GQA, sums dK/dV over the group in
    # XLA ops outside its kernels. Its kernels' names, by upstream's bodies (plgpu.kernel names
    # a kernel after its body function; the backward's are functools.partials), unverified on
    # a device: bench/chip/gpu_check.py lists the compiled program's op names to check them.
    kernel_names: ClassVar[tuple[str, ...]] = ("entry", "anonymous")
    # What discover() read of the device: "sm90"-style, "" for a GPU that is not NVIDIA's,
    # None when unknown (not discovered, or no GPU: the target rule refuses those).
    gpu_arch: str | None = None
    cuda_runtime: int | None = None

    def discover(self) -> MosaicGpuKernel:
        """This backend with the first device's architecture and CUDA runtime version."""
        import jax

        device = jax.devices()[0]
        if device.platform not in GPU_PLATFORMS:
            return self
        capability = getattr(device, "compute_capability", None)
        arch = "sm" + capability.replace(".", "") if capability else ""
        return dataclasses.replace(self, gpu_arch=arch, cuda_runtime=_cuda_runtime())

    def problem_violations(self, problem: Problem) -> list[Violation]:
        out = self._device_violations(problem)
        if problem.dtype not in DTYPES:
            out.append(Violation("dtype", f"mosaic_gpu takes {', '.join(DTYPES)}, not "
                                 f"{problem.dtype}; cast the inputs or use the xla kernel"))
        if problem.head_dim % BLOCK_QUANTUM or problem.head_dim > MAX_HEAD_DIM:
            out.append(Violation("head_dim", f"head_dim={problem.head_dim} must be a multiple "
                                 f"of {BLOCK_QUANTUM} and at most {MAX_HEAD_DIM}; pad it or "
                                 "use the cudnn or xla kernel"))
        rows = FWD_COMPUTE_WGS * BLOCK_QUANTUM
        if problem.q_len % rows:
            out.append(Violation("seq_len", f"q_len={problem.q_len} must be a multiple of "
                                 f"{rows} (two compute warpgroups of 64 rows); pad it"))
        if problem.kv_len % BLOCK_QUANTUM:
            out.append(Violation("seq_len", f"kv_len={problem.kv_len} must be a multiple of "
                                 f"{BLOCK_QUANTUM}; pad it"))
        if problem.causal and problem.q_len > problem.kv_len:
            out.append(Violation("causal", f"causal with q_len={problem.q_len} > kv_len="
                                 f"{problem.kv_len}: upstream's causal loop reads past the "
                                 "last key block; use the xla kernel"))
        if problem.causal and problem.mode == "fwd_bwd":
            out.append(Violation("causal_backward", "upstream's backward has no causal mask "
                                 "(jax 0.10.2-0.12); tune mode fwd, or use cudnn or "
                                 "pallas_gpu for causal training"))
        return out + feature_violations(problem, self.name)  # upstream has none of them

    def _device_violations(self, problem: Problem) -> list[Violation]:
        """What the discovered device cannot run: not Hopper, or causal on a CUDA runtime
        whose ptxas miscompiles it."""
        if self.gpu_arch == "":
            return [Violation("gpu_arch", "mosaic_gpu runs on NVIDIA GPUs only (this one has "
                              "no CUDA compute capability); use pallas_gpu or xla")]
        if self.gpu_arch is not None:
            major, minor = divmod(int(self.gpu_arch[2:]), 10)
            if (major, minor) < MIN_COMPUTE_CAPABILITY:
                return [Violation("gpu_arch", f"mosaic_gpu needs Hopper (sm90) or newer, this "
                                  f"GPU is {self.gpu_arch} (wgmma and TMA); use cudnn, "
                                  "pallas_gpu or xla")]
        low, high = CAUSAL_BROKEN_CUDA
        if problem.causal and self.cuda_runtime is not None and low <= self.cuda_runtime < high:
            return [Violation("cuda_version", f"causal mosaic_gpu is refused upstream on CUDA "
                              f"runtime {self.cuda_runtime} (a ptxas miscompilation in "
                              "12.8.0-12.9.0); upgrade CUDA to 12.9.1+ or use cudnn")]
        return []

    def space_params(self, problem: Problem) -> Params:
        def dividing(values: tuple[int, ...], length: int, times: int = 1) -> list[int]:
            return [b for b in values if length % (b * times) == 0] or [BLOCK_QUANTUM]

        params: Params = {
            "block_q": dividing(SEARCH_BLOCKS, problem.q_len, FWD_COMPUTE_WGS),
            "block_kv": dividing(SEARCH_BLOCKS, problem.kv_len),
            "max_concurrent_steps": list(SEARCH_DEPTHS),
        }
        if problem.mode == "fwd_bwd":
            params.update({
                "compute_wgs_bwd": list(COMPUTE_WGS_BWD),
                "block_q_dkv": dividing(SEARCH_BWD_BLOCKS, problem.q_len),
                "block_kv_dkv": dividing(SEARCH_BWD_BLOCKS, problem.kv_len),
                "block_q_dq": dividing(SEARCH_BWD_BLOCKS, problem.q_len),
                "block_kv_dq": dividing(SEARCH_BWD_BLOCKS, problem.kv_len),
            })
        return params

    def violations(self, problem: Problem, config: MosaicGpuConfig,
                   target: Target | str = GPU_TARGET.name) -> list[Violation]:
        self.target(target)
        out = self.problem_violations(problem)
        q_len, kv_len = problem.q_len, problem.kv_len
        out += _multiple_of("block_q", config.block_q, "q_len", q_len, FWD_COMPUTE_WGS)
        out += _multiple_of("block_kv", config.block_kv, "kv_len", kv_len)
        if config.max_concurrent_steps < MIN_DEPTH:
            out.append(Violation("depth", f"max_concurrent_steps={config.max_concurrent_steps}"
                                 f" must be at least {MIN_DEPTH}"))
        if problem.mode == "fwd_bwd":
            out += self._backward_violations(problem, config)
        if not out:
            out += _smem_violations(problem, config)
        return out

    def _backward_violations(self, problem: Problem,
                             config: MosaicGpuConfig) -> list[Violation]:
        wgs = config.compute_wgs_bwd
        if wgs not in COMPUTE_WGS_BWD:
            return [Violation("compute_wgs_bwd", f"compute_wgs_bwd={wgs} must be one of "
                              f"{list(COMPUTE_WGS_BWD)}")]
        by = " x compute_wgs_bwd"
        return [*_multiple_of("block_q_dq", config.block_q_dq, "q_len", problem.q_len, wgs, by),
                *_multiple_of("block_kv_dkv", config.block_kv_dkv, "kv_len", problem.kv_len,
                              wgs, by),
                *_multiple_of("block_q_dkv", config.block_q_dkv, "q_len", problem.q_len),
                *_multiple_of("block_kv_dq", config.block_kv_dq, "kv_len", problem.kv_len)]

    def default_config(self, problem: Problem,
                       target: Target | str = GPU_TARGET.name) -> MosaicGpuConfig:
        """Upstream's: block_q 64, the largest block_kv of 128 and 64 that divides kv_len and
        fits shared memory at depth 2 (its benchmark tries 256, 128, 64 and keeps the first
        that fits; 256 never fits at head_dim 128), backward blocks 64 with two compute
        warpgroups for head_dim <= 128 (one above, or where two do not divide the lengths)."""
        self.target(target)
        wgs = 2 if (problem.head_dim <= 128 and problem.q_len % 128 == 0
                    and problem.kv_len % 128 == 0) else 1
        base = MosaicGpuConfig(compute_wgs_bwd=wgs)
        for block_kv in (128, 64):
            config = base.replace(block_kv=block_kv)
            if problem.kv_len % block_kv == 0 and not _smem_violations(problem, config):
                return config
        return base.replace(block_kv=BLOCK_QUANTUM)

    def attention(self, problem: Problem, config_for: ConfigFor,
                  sm_scale: float) -> AttentionFn:
        """The forward function in our layout (upstream's is ``[batch, seq, heads,
        head_dim]`` and has no scale: q is scaled first). Upstream's custom VJP differentiates
        with the config it was called with (:func:`per_mode`); its dK/dV leave in float16
        whatever the input dtype, so they are cast back to it."""
        import jax
        import jax.numpy as jnp
        from jax.experimental.pallas.ops.gpu import attention_mgpu as upstream

        def attend_with(config: MosaicGpuConfig) -> AttentionFn:
            tuning = upstream.TuningConfig(
                block_q=config.block_q, block_kv=config.block_kv,
                max_concurrent_steps=config.max_concurrent_steps, causal=problem.causal,
                compute_wgs_bwd=config.compute_wgs_bwd, block_q_dkv=config.block_q_dkv,
                block_kv_dkv=config.block_kv_dkv, block_q_dq=config.block_q_dq,
                block_kv_dq=config.block_kv_dq)

            def run(q: Any, k: Any, v: Any) -> Any:
                q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
                out = upstream.attention((q * sm_scale).astype(q.dtype), k, v, tuning)
                return jnp.swapaxes(out, 1, 2)

            @jax.custom_vjp
            def attend(q: Any, k: Any, v: Any) -> Any:
                return run(q, k, v)

            def backward(vjp: Any, cotangent: Any) -> tuple[Any, ...]:
                return tuple(grad.astype(problem.dtype) for grad in vjp(cotangent))

            attend.defvjp(lambda q, k, v: jax.vjp(run, q, k, v), backward)
            return attend

        return per_mode(attend_with, config_for)


def _smem_violations(problem: Problem, config: MosaicGpuConfig) -> list[Violation]:
    """``smem``: each kernel's shared memory (:func:`smem_bytes`) within the per-block
    limit."""
    return [Violation("smem", f"the {part} kernel needs {used // 1024} KiB of shared memory "
                      f"per block, more than the {SMEM_PER_BLOCK // 1024} KiB a Hopper block "
                      "has; lower max_concurrent_steps or the blocks")
            for part, used in smem_bytes(problem, config).items() if used > SMEM_PER_BLOCK]


def _cuda_runtime() -> int | None:
    """The CUDA runtime version JAX was built against (12090 for 12.9.0), None without one."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    return None if cuda_versions is None else cuda_versions.cuda_runtime_get_version()


KERNEL = MosaicGpuKernel()
