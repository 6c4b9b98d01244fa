"""JAX's splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) as a tunable
kernel: the kernel production TPU training runs (MaxText's ``attention=flash``, tokamax's TPU
path). Its ``BlockSizes`` are the config, MaxText's settings the default.

How it is called (``_attend``):
- Grouped-query attention: splash's MHA entry point (``make_splash_mha``) with the problem's
  K/V heads as they are; its kernels map each query head to its K/V head
  (``q_heads_per_kv_head``), as MaxText calls it. Repeating K/V heads would move
  ``group_size`` times more K/V through the kernel; the MQA entry point takes one K/V head
  only (``kv_heads=1`` is the MHA entry point's special case).
- Causal: splash's ``CausalMask`` per query head (:func:`splash_mask`, the one place masks are
  built); splash skips the fully masked blocks. A window: its ``LocalMask`` (``(left, 0)`` when
  causal), whose blocks outside the window are skipped likewise.
- Soft-capping: splash's ``attn_logits_soft_cap``, applied to the scaled logits. Segment ids:
  splash's ``SegmentIds`` per batch row. A query that sees no key at all (ids absent from the
  keys, or a window past the last key) gets splash's masked average, not the reference's
  zeros: packings where each query sees its own segment avoid it.
- Batch: ``jax.vmap`` over splash's ``[heads, seq, head_dim]`` kernel; ``sm_scale``: splash has
  none, so q is scaled before the call (as MaxText does).
- Interpret mode on a CPU, chosen per platform when lowering
  (:func:`kernel.contract.mosaic_or_interpreted`), so an ahead-of-time compile for a TPU on a
  CPU host still gets the Mosaic kernels.

Pure Python at import; jax loads in ``attention``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from kernel.config import IntConfig
from kernel.contract import (
    AttentionFn,
    ConfigFor,
    Params,
    TunableKernel,
    mosaic_or_interpreted,
    per_mode,
)
from kernel.problem import Problem
from kernel.rules import (
    LANES,
    REGISTER_FILE,
    SPLASH_COMPUTE_OF,
    SPLASH_DKV_AXES,
    SPLASH_FWD_AXES,
    SUBLANES,
    UnrolledScratch,
    Violation,
    block_values,
    key_lane_violations,
    largest_at_most,
    sequence_violations,
    splash_block_violations,
    tile_bytes,
    vmem_limit_violations,
    x64_violations,
)
from kernel.sharded import vma_violations
from kernel.targets import TPU_TARGETS, Target

Layout = Literal["HEAD_DIM_MINOR", "SEQ_MINOR"]
MAXTEXT_BLOCK = 512  # MaxText's sa_block_* defaults, every block


@dataclass(frozen=True)
class SplashConfig(IntConfig):
    """Splash's ``BlockSizes``. Forward: ``block_q`` query rows against ``block_kv`` keys per
    grid step, logits computed ``block_kv_compute`` keys at a time. dK/dV kernel:
    ``block_kv_dkv`` keys against ``block_q_dkv`` queries, ``block_kv_dkv_compute`` keys at a
    time; with ``use_fused_bwd_kernel`` it computes dQ too, and the dQ kernel's blocks
    (``block_q_dq``, ``block_kv_dq``) are unused: None. Layouts: which axis of each of q, k and
    v is minor (lanes) in the kernel's VMEM tiles."""

    block_q: int = MAXTEXT_BLOCK
    block_kv: int = MAXTEXT_BLOCK
    block_kv_compute: int = MAXTEXT_BLOCK
    block_q_dkv: int = MAXTEXT_BLOCK
    block_kv_dkv: int = MAXTEXT_BLOCK
    block_kv_dkv_compute: int = MAXTEXT_BLOCK
    block_q_dq: int | None = MAXTEXT_BLOCK
    block_kv_dq: int | None = MAXTEXT_BLOCK
    use_fused_bwd_kernel: bool = False
    q_layout: Layout = "HEAD_DIM_MINOR"
    k_layout: Layout = "HEAD_DIM_MINOR"
    v_layout: Layout = "HEAD_DIM_MINOR"

    def label(self, mode: str = "fwd_bwd") -> str:
        layouts = "".join("s" if getattr(self, f"{x}_layout") == "SEQ_MINOR" else "h"
                          for x in "qkv")
        forward = f"q{self.block_q} kv{self.block_kv}/{self.block_kv_compute}"
        if mode == "fwd":
            return f"{forward} layout {layouts}"
        dq = "fused" if self.use_fused_bwd_kernel else f"dq{self.block_q_dq}x{self.block_kv_dq}"
        return (f"{forward} dkv{self.block_q_dkv}x{self.block_kv_dkv}/"
                f"{self.block_kv_dkv_compute} {dq} layout {layouts}")


FORWARD_FIELDS = ("block_q", "block_kv", "block_kv_compute", "q_layout", "k_layout", "v_layout")
DKV_FIELDS = ("block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute")
DQ_FIELDS = ("block_q_dq", "block_kv_dq")
# The dQ kernel's sequence-axis blocks: (field, axis), as kernel.rules' SPLASH_FWD_AXES.
_DQ_AXES = (("block_q_dq", "q_len"), ("block_kv_dq", "kv_len"))


def _checked_axes(problem: Problem, config: SplashConfig) -> tuple[tuple[str, str], ...]:
    if problem.mode == "fwd":
        return SPLASH_FWD_AXES
    dq = () if config.use_fused_bwd_kernel else _DQ_AXES
    return SPLASH_FWD_AXES + SPLASH_DKV_AXES + dq


def _dq_violations(config: SplashConfig) -> list[Violation]:
    """``dq_unused``: the fused backward has no dQ kernel, so its blocks are None there (and
    only there); splash's own ``BlockSizes`` refuses dQ blocks with the fused kernel."""
    unset = [f for f in DQ_FIELDS if getattr(config, f) is None]
    if config.use_fused_bwd_kernel and len(unset) < len(DQ_FIELDS):
        return [Violation("dq_unused", "with use_fused_bwd_kernel the dQ kernel does not run; "
                          "set block_q_dq and block_kv_dq to null")]
    if not config.use_fused_bwd_kernel and unset:
        return [Violation("dq_unused", f"{', '.join(unset)} unset, but the unfused backward "
                          "runs the dQ kernel; set a block, or use_fused_bwd_kernel=true")]
    return []


# The VMEM model below is fitted to the allocations Mosaic reports for splash in deviceless
# compiles (``bench/kernels/vmem_sizes.py``; the measurements are in ``bench/kernels/data/``),
# not derived from the kernel's block specs: the compiler allocates about half of what the specs
# double-buffer. What the measurements show:
# - the windows of a kernel's innermost grid axis (k and v in the forward, q and dO in dK/dV)
#   are not in its scoped allocation on v5e while HEAD_DIM_MINOR, and on v6e no more than the
#   compute's temporaries (its allocation is the larger of the two: a q128 kv4096/128 forward
#   takes 4.02 MiB there, 0.69 on v5e); each SEQ_MINOR ((head_dim, rows)) input costs a window
#   more and an f32 (rows, head_dim) copy, on any axis;
# - the forward's row state (q and out windows, m, l, the accumulator, q_sequence and
#   logsumexp) fits in what its q and out windows and m and l alone would take;
# - the unrolled compute loop (``fori_loop(..., unroll=True)``) holds 1.25 f32 logits tiles
#   (1.35 at 128 keys), and more per step beyond the first: 0.3 at 128 keys (``jnp.tile`` of
#   the row max is a no-op there), up to 9 steps; 0.4 at 256; 0.9 at 512 and wider; up to 16
#   steps.
FWD_SCRATCH = {128: UnrolledScratch(base=1.35, per_step=0.3, max_steps=9, base_steps=1),
               256: UnrolledScratch(base=1.25, per_step=0.4, max_steps=16, base_steps=1)}
WIDE_FWD_SCRATCH = UnrolledScratch(base=1.25, per_step=0.9, max_steps=16, base_steps=1)
# At 128 keys with one key block over all keys, up to 13 steps count: q4096 kv4096/128 takes
# 17.66 MiB at 4096 tokens and 13.90 at 8192 (two key blocks); q2048 kv2048/128 at 2048, 8.68.
ONE_KV_BLOCK_SCRATCH = UnrolledScratch(base=1.35, per_step=0.3, max_steps=13, base_steps=1)
# dK/dV's loop over (block_kv_dkv_compute, block_q_dkv) tiles: one tile, a quarter per step.
DKV_SCRATCH = UnrolledScratch(base=1, per_step=0.25, base_steps=1)
# dQ's one (block_q_dq, block_kv_dq) step: two tiles (not refitted; it over-counts, see
# docs/vmem-estimate.md).
DQ_SCRATCH = UnrolledScratch(base=2, per_step=0)
# The model is fitted on v5e and v6e. Measured at 2048 tokens, v5p's and v4's compilers
# allocate more, above all for the forward with residuals (q2048 kv128/128: 8.00 MiB on v5p,
# 9.82 on v4, where the model says 5.60): there the estimate is scaled by at least the largest
# ratio measured (v5p 1.43, v4 1.83).
UNFITTED_MARGINS = {"v5p": 1.5, "v4": 2.0}
# The sample above is batch 1, where ``jax.vmap`` leaves splash's grid as it is (a vmap of
# size 1 is squeezed away). From batch 2 it adds a batch grid axis, and the compiler allocates
# more per kernel (v5e, 4096 tokens, batch 4 and 16 heads unless said:
# ``bench/kernels/data/splash_vmem/v5e_4096_chip_false_admits.jsonl``):
# - the outputs splash uses as scratch (index map ``(0, 0)``: the forward's m, l and
#   accumulator, dK/dV's f32 dk and dv, dQ's f32 dq) take a second buffer, and so does the
#   forward's logsumexp residual;
# - the innermost axis' windows count on top of the compute's temporaries (as on v6e).
# A q512 kv4096/512 forward takes 5.35 MiB at batch 1 and 10.09 at batch 4 (+0.75 for m, l
# and the accumulator, +4 for the k and v windows). The chip's two false admits are such:
# dK/dV 256x4096/128 takes 16.16 MiB (13.39 estimated for batch 1), and a q4096 kv128/128
# SEQ_MINOR forward with residuals 22.52 (10.52 at batch 1; 18.52 without residuals at
# batch 2, 20.52 at batch 4).


def vmem_estimate(problem: Problem, config: SplashConfig) -> dict[str, int]:
    """Estimated peak VMEM bytes of each splash kernel (``fwd``, ``dkv``, ``dq``; ``dkv`` also
    computes dQ when fused), as the compiler allocates it (the model above). Meant as an upper
    bound near the targets' limits.

    The backward kernels get the row statistics lane-major: splash broadcasts ``logsumexp``
    and ``di`` to ``(8, q_len)`` for dK/dV (blocks ``(8, rows)``) and passes them as
    ``(1, q_len)`` to dQ (``(1, rows)``, padded to 8 sublanes), and the causal mask's
    ``q_sequence`` is ``(8, rows)`` int32 in dK/dV, ``(rows, 128)`` in dQ: a block of 4096
    query rows costs 128 KiB per buffer there, not the 2 MiB of a ``(rows, 128)`` f32 tile."""
    d, isz, c = problem.head_dim, problem.itemsize, config
    stat = tile_bytes(c.block_q, LANES, 4)  # (rows, 128) f32 row statistic / q_sequence

    def io(rows: int) -> int:  # one double-buffered (rows, d) window
        return 2 * tile_bytes(rows, d, isz)

    def seq_minor(rows: int, *layouts: str) -> int:  # SEQ_MINOR inputs: window and f32 copy
        return sum(io(rows) + tile_bytes(rows, d, 4) for layout in layouts
                   if layout == "SEQ_MINOR")

    batched = problem.batch > 1  # a batch grid axis (the model above)

    def compute(scratch_bytes: int, inner_rows: int) -> int:  # and the innermost windows
        windows = 2 * io(inner_rows) + REGISTER_FILE
        return scratch_bytes + windows if batched else max(scratch_bytes, windows)

    def scratch_outputs(*tiles: int) -> int:  # splash's outputs used as scratch
        return (2 if batched else 1) * sum(tiles)

    steps = c.block_kv // c.block_kv_compute
    scratch = (ONE_KV_BLOCK_SCRATCH if c.block_kv_compute == LANES and c.block_kv >= problem.kv_len
               else FWD_SCRATCH.get(c.block_kv_compute, WIDE_FWD_SCRATCH))
    # q, out; m, l: at batch 1 the whole row state. Batched, the accumulator and (with
    # residuals) the logsumexp take a second buffer as m and l do.
    rows = 2 * io(c.block_q) + scratch_outputs(stat, stat)
    if batched:
        rows += tile_bytes(c.block_q, d, 4) + (stat if problem.mode == "fwd_bwd" else 0)
    fwd = (rows + seq_minor(c.block_q, c.q_layout)
           + seq_minor(c.block_kv, c.k_layout, c.v_layout)
           + compute(scratch.bytes(c.block_q, c.block_kv_compute, steps), c.block_kv))
    estimate = {"fwd": fwd}
    if problem.mode == "fwd_bwd":
        qd, kd = c.block_q_dkv, c.block_kv_dkv
        dkv = (2 * io(kd) + 2 * io(kd)  # k, v; dk, dv
               + scratch_outputs(tile_bytes(kd, d, 4), tile_bytes(kd, d, 4))  # f32 dk, dv
               + 3 * 2 * tile_bytes(SUBLANES, qd, 4)  # logsumexp, di, q_sequence: (8, rows)
               + seq_minor(qd, c.q_layout)  # dO is never SEQ_MINOR
               + seq_minor(kd, c.k_layout, c.v_layout)
               + compute(DKV_SCRATCH.bytes(c.block_kv_dkv_compute, qd,
                                           kd // c.block_kv_dkv_compute), qd))  # q, dO windows
        if c.use_fused_bwd_kernel:
            dkv += io(qd) + scratch_outputs(tile_bytes(qd, d, 4))  # dq output and scratch
        estimate["dkv"] = dkv
        if not c.use_fused_bwd_kernel:
            qq, kq = c.block_q_dq, c.block_kv_dq
            estimate["dq"] = (2 * io(qq) + 2 * io(kq) + io(qq)  # q, do; k, v; dq
                              + 2 * 2 * tile_bytes(1, qq, 4)  # logsumexp, di: (1, rows)
                              + 2 * tile_bytes(qq, LANES, 4)  # q_sequence: (rows, 128)
                              + scratch_outputs(tile_bytes(qq, d, 4))  # dq scratch
                              + seq_minor(qq, c.q_layout) + seq_minor(kq, c.k_layout, c.v_layout)
                              + DQ_SCRATCH.bytes(qq, kq, 1))
    return estimate


@dataclass(frozen=True)
class SplashKernel(TunableKernel):
    name: ClassVar[str] = "splash"
    version: ClassVar[str] = "1"
    description: ClassVar[str] = ("JAX's splash attention "
                                  "(jax.experimental.pallas.ops.tpu.splash_attention), as MaxText "
                                  "runs it: grouped-query heads native, causal through its masks")
    targets: ClassVar[tuple[str, ...]] = TPU_TARGETS
    platforms: ClassVar[tuple[str, ...]] = ("tpu",)
    config_type: ClassVar[type[SplashConfig]] = SplashConfig
    landscape_axes: ClassVar[tuple[str, str, str]] = ("block_q", "block_kv",
                                                      "use_fused_bwd_kernel")
    # The dQ part holds the fused flag: the fused dK/dV kernel (which computes dQ too) is
    # prechecked at the default dK/dV blocks; the layouts, shared by all three kernels, at the
    # default in the backward parts.
    compile_parts: ClassVar[tuple[tuple[str, ...], ...]] = (
        FORWARD_FIELDS, DKV_FIELDS, ("use_fused_bwd_kernel", *DQ_FIELDS))
    profile_names: ClassVar[tuple[str, ...]] = (
        "splash_mha_fwd_no_residuals", "splash_mha_fwd_residuals", "splash_mha_dkv_no_residuals",
        "splash_mha_dq_no_residuals")

    def problem_violations(self, problem: Problem) -> list[Violation]:
        return (sequence_violations(problem.q_len, "q_len")
                + key_lane_violations(problem.kv_len) + x64_violations() + vma_violations())

    def space_params(self, problem: Problem) -> Params:
        q_values = block_values(problem.q_len)
        kv_values = [v for v in block_values(problem.kv_len) if v % LANES == 0]
        layouts = SplashConfig.choices("q_layout")
        params: Params = {"block_q": q_values, "block_kv": kv_values,
                          "block_kv_compute": kv_values,
                          **{f"{x}_layout": layouts for x in "qkv"}}
        if problem.mode == "fwd_bwd":
            params.update(block_q_dkv=q_values, block_kv_dkv=kv_values,
                          block_kv_dkv_compute=kv_values, block_q_dq=[None, *q_values],
                          block_kv_dq=[None, *kv_values],
                          use_fused_bwd_kernel=SplashConfig.choices("use_fused_bwd_kernel"))
        return params

    def canonical_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The fused backward has no dQ kernel: its dQ blocks are None, whatever was drawn. As
        a rule (``dq_unused``) alone, one fused config in 26 was legal at s4096 (both dQ blocks
        None), and 9 of the 229 splash configs measured on the v5e on 2026-12-07 were fused."""
        if params.get("use_fused_bwd_kernel"):
            return {**params, **{field: None for field in DQ_FIELDS if field in params}}
        return params

    def violations(self, problem: Problem, config: SplashConfig,
                   target: Target | str = "cpu") -> list[Violation]:
        target = self.target(target)
        out = self.problem_violations(problem)
        unused = _dq_violations(config)
        if unused:  # unset blocks the kernel would run: no estimate
            return out + unused
        out += splash_block_violations(problem, config, _checked_axes(problem, config),
                                       SPLASH_COMPUTE_OF[:1 if problem.mode == "fwd" else None])
        margin = UNFITTED_MARGINS.get(target.name, 1.0)
        need = {name: int(size * margin) for name, size in vmem_estimate(problem, config).items()}
        return out + vmem_limit_violations(need, target)

    def default_config(self, problem: Problem, target: Target | str = "cpu") -> SplashConfig:
        """MaxText's: every block 512, capped at its sequence axis (the largest legal block
        up to 512), unfused, ``HEAD_DIM_MINOR`` layouts."""
        self.target(target)
        return recipe(problem)

    def seed_configs(self, problem: Problem, target: Target | str = "cpu") -> list[SplashConfig]:
        """Uniform blocks (the contract's); in fwd_bwd the default and each of those with the
        fused backward (one kernel for dQ, dK and dV: none was among the seeds when tune-jax's
        fused winner beat our published choice by 3.4% on the v5e, 2026-12-07); then MaxText's
        hand-set recipes (:data:`RECIPES`) and tune-jax's v5e winner
        (:data:`TUNE_JAX_V5E_WINNER`), their forward fields alone in fwd mode."""
        uniform = super().seed_configs(problem, target)
        fused_seeds = [fused(config) for config in [self.default_config(problem, target), *uniform]
                       if problem.mode == "fwd_bwd"]
        recipes = [recipe(problem, **{field: value for field, value in changes.items()
                                      if problem.mode == "fwd_bwd" or field in FORWARD_FIELDS})
                   for changes in [*RECIPES.values(), TUNE_JAX_V5E_WINNER]]
        return [*uniform, *(config for config in fused_seeds + recipes
                            if not self.violations(problem, config, target))]

    def attention(self, problem: Problem, config_for: ConfigFor,
                  sm_scale: float) -> AttentionFn:
        """The forward function in our layout; splash's own custom VJP differentiates it with
        the blocks it was made with, so a differentiated call runs the ``fwd_bwd`` config
        (:func:`per_mode`)."""
        return per_mode(lambda config: mosaic_or_interpreted(
            lambda interpret: _attend(problem, config, sm_scale, interpret)), config_for)


def fused(config: SplashConfig) -> SplashConfig:
    """``config`` with the fused backward (one kernel for dQ, dK and dV): no dQ blocks."""
    return config.replace(**KERNEL.canonical_params({**config.to_dict(),
                                                     "use_fused_bwd_kernel": True}))


def recipe(problem: Problem, **changes: Any) -> SplashConfig:
    """MaxText's config with ``changes`` (a hand-set recipe, :data:`RECIPES`), each block
    capped at its sequence axis as MaxText caps them (the largest legal block up to it)."""
    config = SplashConfig().replace(**changes)
    values = {"q_len": block_values(problem.q_len), "kv_len": block_values(problem.kv_len)}
    return config.replace(**{
        field: largest_at_most(values[axis], getattr(config, field))
        for field, axis in SPLASH_FWD_AXES + SPLASH_DKV_AXES + _DQ_AXES
        if getattr(config, field) is not None})


# MaxText's benchmark recipes that hand-set splash per model, as named baselines.
RECIPES: dict[str, dict[str, Any]] = {
    "all 2048, fused": dict(block_q=2048, block_kv=2048, block_kv_compute=2048,
                            block_q_dkv=2048, block_kv_dkv=2048, block_kv_dkv_compute=2048,
                            block_q_dq=None, block_kv_dq=None, use_fused_bwd_kernel=True),
    "q1024 dkv2048, seq-minor": dict(block_q=1024, block_q_dkv=2048, q_layout="SEQ_MINOR",
                                     k_layout="SEQ_MINOR", v_layout="SEQ_MINOR"),
}


# tune-jax's winner over MaxText's splash settings on a TPU v5e at both unmasked problems it
# was run on (b8 h16 s2048 and b4 h16 s4096, fwd_bwd, 2026-12-07: bench/results/tpu-v5e-
# 2026-12-07e/peers-9, -07f/peers-3), 1.1% and 6.1% faster over the step than the best splash
# config our 30 trials had found there: a seed, capped at the problem as the recipes are.
TUNE_JAX_V5E_WINNER: dict[str, Any] = dict(
    block_q=1024, block_kv=2048, block_kv_compute=512, block_q_dkv=1024, block_kv_dkv=2048,
    block_kv_dkv_compute=512, block_q_dq=None, block_kv_dq=None, use_fused_bwd_kernel=True)


def splash_mask(problem: Problem) -> Any:
    """Splash's mask for ``problem``, one per query head: a window (``LocalMask``: keys p -
    left..p + right for the query at position p, the right side 0 when causal), causal (keys
    up to p) or full; p is i top-left aligned (as ``jax.nn.dot_product_attention``'s
    ``is_causal``), i + kv_len - q_len bottom-right (splash's ``offset``). The one place masks
    are built; segment ids are splash's separate ``SegmentIds`` argument."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    shape, offset = (problem.q_len, problem.kv_len), problem.query_offset
    if problem.window is not None:
        head = masks.LocalMask(shape, problem.window, offset=offset)
    elif problem.causal:
        head = masks.CausalMask(shape, offset=offset)
    else:
        head = masks.FullMask(shape)
    return masks.MultiHeadMask([head] * problem.q_heads)


def block_sizes(config: SplashConfig) -> Any:
    """Splash's ``BlockSizes`` of ``config``."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    fields = config.to_dict()
    for layout in ("q_layout", "k_layout", "v_layout"):
        fields[layout] = sk.QKVLayout[fields[layout]]
    return sk.BlockSizes(**fields)


def _attend(problem: Problem, config: SplashConfig, sm_scale: float,
            interpret: bool) -> AttentionFn:
    import jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    splash = sk.make_splash_mha(splash_mask(problem), block_sizes=block_sizes(config),
                                attn_logits_soft_cap=problem.softcap, head_shards=1,
                                q_seq_shards=1, interpret=interpret)

    def attend(q, k, v, *segment_ids):  # noqa: ANN001, ANN002, ANN202
        scaled = (q * sm_scale).astype(q.dtype)
        if not segment_ids:
            return jax.vmap(splash)(scaled, k, v)
        return jax.vmap(lambda q, k, v, q_ids, kv_ids: splash(
            q, k, v, segment_ids=sk.SegmentIds(q_ids, kv_ids)))(scaled, k, v, *segment_ids)

    return attend


KERNEL = SplashKernel()
