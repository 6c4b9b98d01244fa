"""JAX's Pallas TPU flash attention (``jax.experimental.pallas.ops.tpu.flash_attention``) as a
tunable kernel: its ``BlockSizes`` are the config, its own checks are the rules.

Upstream differences this wrapper hides: no grouped-query attention (K/V heads are repeated to
the query heads with ``jnp.repeat`` before the call, so a GQA problem moves ``group_size`` times
more K/V through the kernel than ``flash`` does); ``sm_scale`` defaults to 1.0 upstream, here it
is ``head_dim ** -0.5``; no ``interpret`` argument (on CPU the call is traced inside
``pltpu.force_tpu_interpret_mode``, chosen per platform when lowering, so an ahead-of-time
compile for TPU on a CPU host still gets the Mosaic kernels). Segment ids go to upstream's
``SegmentIds`` natively (a query whose id no key has gets an average of the values, not the
reference's zeros, as from splash); it has no window or soft cap, refused by rule (``window``,
``softcap``).

Pure Python at import; jax loads in ``build``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from kernel.config import IntConfig
from kernel.contract import (
    AttentionFn,
    ConfigFor,
    Params,
    TunableKernel,
    default_device,
    default_scale,
    measured_fn,
    per_mode,
    repeat_kv_heads,
)
from kernel.problem import Problem
from kernel.rules import (
    LANES,
    MAX_COMPUTE_BLOCK,
    UnrolledScratch,
    Violation,
    block_values,
    block_violations,
    feature_violations,
    key_lane_violations,
    largest_at_most,
    sequence_violations,
    tile_bytes,
    vmem_limit_violations,
    x64_violations,
)
from kernel.sharded import vma_violations
from kernel.targets import TPU_TARGETS, Target

MIN_BLOCK_SIZE = 128  # upstream: in-kernel key blocks tile the lane-replicated row statistics
UPSTREAM_DEFAULT = 128  # BlockSizes.get_default(): 128 everywhere, block_b=1
MAX_BLOCK_B = 8  # batch rows per forward grid step: the kernel unrolls a loop over them


@dataclass(frozen=True)
class JaxTpuFlashConfig(IntConfig):
    """Upstream ``BlockSizes``. Forward: ``block_q`` query rows and ``block_k_major`` keys per
    grid step (``block_b`` batch rows at once), logits computed ``block_k`` keys at a time.
    dK/dV kernel: ``block_k_major_dkv`` keys against ``block_q_major_dkv`` queries per step,
    computed in (``block_q_dkv``, ``block_k_dkv``) tiles. dQ kernel: ``block_q_dq`` queries
    against ``block_k_major_dq`` keys per step, ``block_k_dq`` keys at a time."""

    block_q: int = UPSTREAM_DEFAULT
    block_k_major: int = UPSTREAM_DEFAULT
    block_k: int = UPSTREAM_DEFAULT
    block_b: int = 1
    block_q_major_dkv: int = UPSTREAM_DEFAULT
    block_k_major_dkv: int = UPSTREAM_DEFAULT
    block_k_dkv: int = UPSTREAM_DEFAULT
    block_q_dkv: int = UPSTREAM_DEFAULT
    block_k_major_dq: int = UPSTREAM_DEFAULT
    block_k_dq: int = UPSTREAM_DEFAULT
    block_q_dq: int = UPSTREAM_DEFAULT

    def label(self, mode: str = "fwd_bwd") -> str:
        forward = f"b{self.block_b} q{self.block_q} k{self.block_k_major}/{self.block_k}"
        if mode == "fwd":
            return forward
        return (f"{forward} dkv{self.block_q_major_dkv}/{self.block_q_dkv}x"
                f"{self.block_k_major_dkv}/{self.block_k_dkv} "
                f"dq{self.block_q_dq}x{self.block_k_major_dq}/{self.block_k_dq}")


FORWARD_FIELDS = ("block_q", "block_k_major", "block_k", "block_b")
BACKWARD_FIELDS = ("block_q_major_dkv", "block_k_major_dkv", "block_k_dkv", "block_q_dkv",
                   "block_k_major_dq", "block_k_dq", "block_q_dq")
# (minor, major): the kernel loops ``major // minor`` times, so minor must divide major
# (upstream BlockSizes raises otherwise).
MINOR_MAJOR = (("block_k", "block_k_major"), ("block_q_dkv", "block_q_major_dkv"),
               ("block_k_dkv", "block_k_major_dkv"), ("block_k_dq", "block_k_major_dq"))
# Sequence-axis blocks per mode: (field, axis); the backward ones only matter for fwd_bwd.
_FWD_AXES = (("block_q", "q_len"), ("block_k_major", "kv_len"), ("block_k", "kv_len"))
_BWD_AXES = (("block_q_major_dkv", "q_len"), ("block_q_dkv", "q_len"),
             ("block_k_major_dkv", "kv_len"), ("block_k_dkv", "kv_len"),
             ("block_q_dq", "q_len"), ("block_k_major_dq", "kv_len"), ("block_k_dq", "kv_len"))


def _axes(problem: Problem) -> tuple[tuple[str, str], ...]:
    return _FWD_AXES + (_BWD_AXES if problem.mode == "fwd_bwd" else ())


def batch_blocks(batch: int) -> list[int]:
    """``block_b`` values: powers of two up to ``MAX_BLOCK_B`` that divide the batch."""
    return [b for b in (1, 2, 4, 8) if batch % b == 0]


# Mosaic's internal scratch (f32 temporaries that do not fit the 64 vector registers) beyond
# the windows and scratch the kernel declares. Upstream unrolls its inner loops over (rows,
# cols) logits tiles (``fori_loop(..., unroll=True)``), and temporaries of several unrolled
# steps stay alive at once. Measured on v5e (deviceless compiles, bf16, head_dim 128, the scoped
# limit set to the estimate, the compiler naming the size it needed): about 1.5 logits tiles with
# 1-2 unrolled steps, 4 tiles with 4 steps. Modelled as an upper bound: 1.75 tiles plus 1.5 per
# step beyond 2, plus the register file once (all checked: forward 1-8 steps, dK/dV and dQ).
# The forward repeats the unrolled body for each of its ``block_b`` batch rows (``copies``).
SCRATCH = UnrolledScratch(base=1.75, per_step=1.5)


def vmem_estimate(problem: Problem, config: JaxTpuFlashConfig) -> dict[str, int]:
    """Estimated peak VMEM bytes of each upstream kernel (``fwd``, ``dkv``, ``dq``): the
    double-buffered windows of its BlockSpecs, its scratch, and Mosaic's internal scratch for
    its unrolled logits tiles (``SCRATCH``). Meant as an upper bound; the backward
    kernels reuse the forward's calibration."""
    d, isz, c = problem.head_dim, problem.itemsize, config
    stat = tile_bytes(c.block_q, LANES, 4)  # (rows, 128) f32 row statistic (m, l, di)
    fwd = c.block_b * (
        2 * tile_bytes(c.block_q, d, isz)  # q window
        + 2 * 2 * tile_bytes(c.block_k_major, d, isz)  # k, v windows
        + 2 * tile_bytes(c.block_q, d, isz)  # output window
        + 2 * stat + tile_bytes(c.block_q, d, 4)  # m, l, acc scratch
        + (2 * 2 * stat if problem.mode == "fwd_bwd" else 0)  # l, m output windows
    ) + SCRATCH.bytes(c.block_q, c.block_k, c.block_k_major // c.block_k, c.block_b)
    estimate = {"fwd": fwd}
    if problem.mode == "fwd_bwd":
        qm, km = c.block_q_major_dkv, c.block_k_major_dkv
        estimate["dkv"] = (
            2 * 2 * tile_bytes(qm, d, isz)  # q, do windows
            + 2 * 3 * tile_bytes(qm, LANES, 4)  # l, m, di windows
            + 2 * 2 * tile_bytes(km, d, isz)  # k, v windows
            + 2 * 2 * tile_bytes(km, d, isz)  # dk, dv output windows
            + 2 * tile_bytes(km, d, 4)  # dk, dv scratch
            + SCRATCH.bytes(c.block_q_dkv, c.block_k_dkv, (qm // c.block_q_dkv)
                             * (km // c.block_k_dkv)))
        qq, kq = c.block_q_dq, c.block_k_major_dq
        estimate["dq"] = (
            2 * 2 * tile_bytes(qq, d, isz)  # q, do windows
            + 2 * 3 * tile_bytes(qq, LANES, 4)  # l, m, di windows
            + 2 * 2 * tile_bytes(kq, d, isz)  # k, v windows
            + 2 * tile_bytes(qq, d, isz)  # dq output window
            + tile_bytes(qq, d, 4)  # dq scratch
            + SCRATCH.bytes(qq, c.block_k_dq, kq // c.block_k_dq))
    return estimate


@dataclass(frozen=True)
class JaxTpuFlashKernel(TunableKernel):
    name: ClassVar[str] = "jax_tpu_flash"
    version: ClassVar[str] = "1"
    description: ClassVar[str] = ("JAX's Pallas TPU flash attention "
                                  "(jax.experimental.pallas.ops.tpu.flash_attention); "
                                  "GQA by repeating K/V heads")
    targets: ClassVar[tuple[str, ...]] = TPU_TARGETS
    platforms: ClassVar[tuple[str, ...]] = ("tpu",)
    config_type: ClassVar[type[JaxTpuFlashConfig]] = JaxTpuFlashConfig
    landscape_axes: ClassVar[tuple[str, str, str]] = ("block_q", "block_k_major", "block_b")

    def problem_violations(self, problem: Problem) -> list[Violation]:
        # With kv_len a multiple of 128, block_tiling (a multiple of 128 or the whole axis)
        # gives upstream's rule that every key block is a multiple of MIN_BLOCK_SIZE.
        out = sequence_violations(problem.q_len, "q_len") + key_lane_violations(problem.kv_len)
        if problem.head_dim > LANES and problem.head_dim % LANES:
            out.append(Violation("head_dim", f"head_dim={problem.head_dim} must be at most "
                                 f"{LANES} or a multiple of {LANES} for this kernel"))
        return (out + x64_violations() + vma_violations()
                + feature_violations(problem, self.name, frozenset({"segment_ids"})))

    def space_params(self, problem: Problem) -> Params:
        q_values, kv_values = block_values(problem.q_len), block_values(problem.kv_len)
        minor_kv = [v for v in kv_values if v <= MAX_COMPUTE_BLOCK and v % MIN_BLOCK_SIZE == 0]
        minor_kv = minor_kv or kv_values[:1]
        minor_q = [v for v in q_values if v <= MAX_COMPUTE_BLOCK] or q_values[:1]
        params: Params = {"block_q": q_values, "block_k_major": kv_values, "block_k": minor_kv,
                          "block_b": batch_blocks(problem.batch)}
        if problem.mode == "fwd_bwd":
            params.update(block_q_major_dkv=q_values, block_q_dkv=minor_q,
                          block_k_major_dkv=kv_values, block_k_dkv=minor_kv,
                          block_q_dq=q_values, block_k_major_dq=kv_values, block_k_dq=minor_kv)
        return params

    def violations(self, problem: Problem, config: JaxTpuFlashConfig,
                   target: Target | str = "cpu") -> list[Violation]:
        target = self.target(target)
        out = self.problem_violations(problem)
        for field, axis in _axes(problem):
            out += block_violations(field, getattr(config, field), getattr(problem, axis), axis)
        for minor, major in MINOR_MAJOR[:1 if problem.mode == "fwd" else None]:
            small, large = getattr(config, minor), getattr(config, major)
            if large % small:
                out.append(Violation("minor_divides_major", f"{minor}={small} must divide "
                                     f"{major}={large}"))
        if problem.batch % config.block_b or config.block_b > MAX_BLOCK_B:
            out.append(Violation("block_b", f"block_b={config.block_b} must divide "
                                 f"batch={problem.batch} and be at most {MAX_BLOCK_B}; pick one "
                                 f"of {batch_blocks(problem.batch)}"))
        return out + vmem_limit_violations(vmem_estimate(problem, config), target)

    def default_config(self, problem: Problem,
                       target: Target | str = "cpu") -> JaxTpuFlashConfig:
        """Upstream's ``BlockSizes.get_default()`` (128 everywhere, ``block_b=1``), each block
        clamped to a legal value for its axis."""
        self.target(target)
        values = {"q_len": block_values(problem.q_len), "kv_len": block_values(problem.kv_len)}
        return JaxTpuFlashConfig(**{
            field: largest_at_most(values[axis], UPSTREAM_DEFAULT)
            for field, axis in _FWD_AXES + _BWD_AXES})

    def build(self, problem: Problem, config: JaxTpuFlashConfig, *,
              forward_only: bool = False) -> AttentionFn:
        self.check(problem, config)
        # The backward kernels are traced by jax.grad inside the measured function, so on a
        # CPU they are interpreted too.
        return _on_platform(measured_fn(problem, self._attend(problem, config,
                                                              default_scale(problem)),
                                        forward_only=forward_only))

    def attention(self, problem: Problem, config_for: ConfigFor,
                  sm_scale: float) -> AttentionFn:
        """The forward function in our layout; upstream's own custom VJP differentiates it
        with the blocks it was called with, so a differentiated call runs the ``fwd_bwd``
        config (:func:`per_mode`). Off a TPU (the default device's platform, as the resolver
        sees it) every kernel is interpreted, its backward too, which upstream's VJP traces
        only when the gradient is taken."""
        run = (lambda fn: fn) if default_device().platform == "tpu" else _interpreted
        return per_mode(lambda config: self._attend(problem, config, sm_scale), config_for,
                        run=run)

    @staticmethod
    def _attend(problem: Problem, config: JaxTpuFlashConfig, scale: float) -> AttentionFn:
        from jax.experimental.pallas.ops.tpu import flash_attention as upstream

        sizes = upstream.BlockSizes(**config.to_dict())

        def attend(q, k, v, *segment_ids):  # noqa: ANN001, ANN002, ANN202
            k, v = repeat_kv_heads(problem, k, v)
            ids = upstream.SegmentIds(*segment_ids) if segment_ids else None
            return upstream.flash_attention(q, k, v, segment_ids=ids, causal=problem.causal,
                                            sm_scale=scale, block_sizes=sizes)

        return attend


def _interpreted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with every Pallas TPU kernel it traces run in TPU interpret mode (the fast HLO
    interpreter; upstream's kernel has no ``interpret`` argument)."""
    from jax.experimental.pallas import tpu as pltpu

    def run(*args):  # noqa: ANN002, ANN202
        with pltpu.force_tpu_interpret_mode(True):
            return fn(*args)

    return run


def _on_platform(fn: AttentionFn) -> AttentionFn:
    """``fn`` compiled with Mosaic on a TPU, interpreted elsewhere, chosen per platform when
    lowering (an ahead-of-time compile for TPU on a CPU host gets the Mosaic kernels). ``fn``
    must contain its own gradient: a branch's custom VJP is traced outside it."""
    from jax import lax

    return lambda *args: lax.platform_dependent(*args, tpu=fn, default=_interpreted(fn))


KERNEL = JaxTpuFlashKernel()
