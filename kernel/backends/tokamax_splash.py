"""tokamax's splash attention (``tokamax._src.ops.experimental.tpu.splash_attention``) as a
tunable kernel: a newer splash than JAX's, vendored by tokamax, with base-2 exponentials, an
experimental Mosaic scheduler for the forward, and only the fused backward (one kernel for dQ,
dK and dV). Its ``SplashConfig``'s tunable fields are the config.

It needs the optional ``tokamax`` package (``pip install 'flash-autotune[tokamax]'``): without
it, every problem breaks the ``tokamax_missing`` rule, so the kernel choice and the wrapper pass
it over, naming the fix.

How it is called (``_attend``), as tokamax's own op calls it
(``tokamax/_src/ops/attention/pallas_mosaic_tpu.py``):
- One 2-D mask for every head (tokamax's masks have no per-head form): ``CausalMask``, a window
  as ``LocalMask`` (``(left, 0)`` when causal), else ``FullMask``; bottom-right alignment is
  their ``offset``, as in JAX's splash. Fully masked blocks are skipped.
- Grouped-query attention: the MHA entry point with the K/V heads as they are; one K/V head:
  the MQA entry point (K/V squeezed to ``[seq, head_dim]``), as tokamax does.
- ``jax.vmap`` over the batch; ``sm_scale`` applied to q before the call (tokamax's
  ``logits_scale`` is); soft-capping is ``attn_logits_soft_cap``; segment ids its
  ``SegmentIds`` per batch row. A query that sees no key gets splash's masked average.
- The fused backward with the config's backward blocks, ``HEAD_DIM_MINOR`` layouts and Mosaic's
  default scheduler, whatever the forward's, as tokamax's VJP op runs it
  (:func:`_with_tokamax_backward`).
- float32 refused on a TPU (``tokamax_float32``): its dots round float32 to bf16 there.
- The masked logits are float32's lowest and the mask tables stay int32 in SMEM
  (``downcast_smem_data=False``), as tokamax's op passes them.
- Interpret mode on a CPU, chosen per platform when lowering
  (:func:`kernel.contract.mosaic_or_interpreted`).

Pure Python at import; jax and tokamax load in ``attention``.
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from kernel.config import IntConfig
from kernel.contract import (
    AttentionFn,
    ConfigFor,
    Params,
    TunableKernel,
    by_mode,
    mosaic_or_interpreted,
)
from kernel.problem import Problem
from kernel.rules import (
    LANES,
    MAX_COMPUTE_BLOCK,
    SPLASH_COMPUTE_OF,
    SPLASH_DKV_AXES,
    SPLASH_FWD_AXES,
    SUBLANES,
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
from kernel.targets import Target

Layout = Literal["HEAD_DIM_MINOR", "SEQ_MINOR"]
INSTALL_HINT = "pip install 'flash-autotune[tokamax]'"
DEFAULT_BLOCK = 512  # MaxText's splash blocks, as the splash backend's default
DQ_REDUCTION_STEPS = (None, 3)  # tokamax's SplashConfig takes only these


@dataclass(frozen=True)
class TokamaxConfig(IntConfig):
    """tokamax's ``SplashConfig``, its tunable fields. Forward: ``block_q`` query rows against
    ``block_kv`` keys per grid step, logits computed ``block_kv_compute`` keys at a time, with
    Mosaic's experimental scheduler or not. Fused backward: ``block_kv_dkv`` keys against
    ``block_q_dkv`` queries, ``block_kv_dkv_compute`` keys at a time; ``dq_reduction_steps``
    None writes one partial dQ per key block to HBM (summed by XLA after the kernel), 3 sums
    them in the kernel into 3 buffers. Layouts: which axis of each of q, k and v is minor
    (lanes) in the forward's VMEM tiles; it alone takes them and the scheduler (the backward
    runs tokamax's defaults, as tokamax's op does). Base-2 exponentials always, as tokamax
    ships it."""

    block_q: int = DEFAULT_BLOCK
    block_kv: int = DEFAULT_BLOCK
    block_kv_compute: int = DEFAULT_BLOCK
    block_q_dkv: int = DEFAULT_BLOCK
    block_kv_dkv: int = DEFAULT_BLOCK
    block_kv_dkv_compute: int = DEFAULT_BLOCK
    dq_reduction_steps: int | None = None
    q_layout: Layout = "HEAD_DIM_MINOR"
    k_layout: Layout = "HEAD_DIM_MINOR"
    v_layout: Layout = "HEAD_DIM_MINOR"
    use_experimental_scheduler: bool = True

    def label(self, mode: str = "fwd_bwd") -> str:
        layouts = "".join("s" if getattr(self, f"{x}_layout") == "SEQ_MINOR" else "h"
                          for x in "qkv")
        scheduler = " exp-sched" if self.use_experimental_scheduler else ""
        forward = f"q{self.block_q} kv{self.block_kv}/{self.block_kv_compute}"
        if mode == "fwd":
            return f"{forward} layout {layouts}{scheduler}"
        reduction = "" if self.dq_reduction_steps is None else f" dq{self.dq_reduction_steps}"
        return (f"{forward} dkv{self.block_q_dkv}x{self.block_kv_dkv}/"
                f"{self.block_kv_dkv_compute}{reduction} layout {layouts}{scheduler}")


FORWARD_FIELDS = ("block_q", "block_kv", "block_kv_compute", "q_layout", "k_layout", "v_layout",
                  "use_experimental_scheduler")
DKV_FIELDS = ("block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute", "dq_reduction_steps")
# tokamax's own winner on a TPU v5e at b4 h16 s4096 d128 bf16, full attention, fwd_bwd (its
# autotune, 2026-12): a seed, each block capped at its sequence axis (:func:`capped`).
TOKAMAX_V5E_WINNER = dict(block_q=1024, block_kv=4096, block_kv_compute=512,
                          q_layout="SEQ_MINOR", k_layout="HEAD_DIM_MINOR",
                          v_layout="HEAD_DIM_MINOR", use_experimental_scheduler=True,
                          block_q_dkv=2048, block_kv_dkv=2048, block_kv_dkv_compute=512)


def tokamax_violations() -> list[Violation]:
    """``tokamax_missing``: the optional package is not installed (looked up without
    importing it, which would load jax)."""
    if importlib.util.find_spec("tokamax") is not None:
        return []
    return [Violation("tokamax_missing", "the tokamax kernel needs the optional tokamax "
                      f"package, which is not installed; install it with {INSTALL_HINT}, or "
                      "use the splash kernel (JAX's)")]


def float32_violations(problem: Problem, target: Target) -> list[Violation]:
    """``tokamax_float32``, on a TPU: tokamax's kernel leaves its dots at Mosaic's default
    precision, which rounds float32 operands to bf16 (one MXU pass). On a TPU v5e its float32
    errors were bf16's: 5e-3 relative against the float32 gate's 2e-3, 0.9 at logits near 1e4,
    19 of the peers' float32 cases 1.01x-8,800x their tolerance (bench/results/
    tpu-v5e-2026-12-07g; every bfloat16 case passed). A CPU's interpret mode multiplies in
    float32, so it runs float32 there (and the common suite checks it)."""
    if problem.dtype != "float32" or target.scoped_vmem_bytes is None:
        return []
    return [Violation("tokamax_float32", "tokamax's kernel multiplies float32 at bf16 "
                      "precision on a TPU (one MXU pass), beyond float32's tolerance; "
                      "use bfloat16 inputs, or the flash kernel, which keeps float32 exact")]


def _dq_reduction_violations(problem: Problem, config: TokamaxConfig) -> list[Violation]:
    """``dq_reduction_steps``: tokamax takes null or 3. ``dq_reduction_grouped``: 3 runs the
    backward on a grid of the mask's active blocks, which accumulates dK and dV over a group's
    query heads through aliased outputs; with grouped K/V heads under a causal or window mask
    (a full mask keeps the static grid) its dK and dV came out wrong in interpret mode (tokamax
    0.0.12, relative error 0.5), unchecked on a chip."""
    steps = config.dq_reduction_steps
    if steps not in DQ_REDUCTION_STEPS:
        return [Violation("dq_reduction_steps", "dq_reduction_steps must be null or 3 "
                          f"(tokamax's only choices), got {steps}")]
    masked = problem.causal or problem.window is not None
    if steps == 3 and problem.mode == "fwd_bwd" and problem.group_size > 1 and masked:
        return [Violation("dq_reduction_grouped", "dq_reduction_steps=3 with grouped K/V heads "
                          "under a causal or window mask computes wrong dK and dV in interpret "
                          "mode (tokamax 0.0.12); use null")]
    return []


# The VMEM model: JAX's splash model (kernel/backends/splash.py) rewritten for the buffers
# tokamax's kernels declare, its temporaries fitted to the scoped allocations a deviceless v5e
# compile reports for them (bench/kernels/data/tokamax_vmem/: configs of tokamax's own v5e run
# and a random sample, at b4 h16 s4096 d128 bf16, full attention). It is an upper bound on each
# of those, within 10% and 1 MiB; not yet checked on a chip, nor with a causal or window mask
# or segment ids (their int32 blocks are counted as declared, double-buffered), nor fitted on
# another generation (UNFITTED_MARGINS).
# What differs from JAX's splash: the forward's m, l and accumulator are scratch, not outputs;
# its residuals are logsumexp and max_logits, each (rows, 128) f32; the only backward is the
# fused dK/dV/dQ kernel, whose dQ output block is f32 when it is written per key block and
# there are more than 4 of them, and which keeps an f32 dQ scratch only when it computes fewer
# keys than its block. What the compiles show beyond the blocks: the forward holds 1.15 f32
# logits tiles, 0.15 more per unrolled step after the first (up to 8 steps), and 5.5 f32
# (rows, 128) row temporaries (m, l, alpha and their tiles), half a one more for a SEQ_MINOR q;
# the backward 1.35 logits tiles whatever its steps (1.0 to 1.32 measured from 2 to 8).
FWD_LOGIT_TILES, FWD_TILES_PER_STEP, FWD_MAX_STEPS = 1.15, 0.15, 8
# Past 8 unrolled steps each step holds about two more tiles: q1024 kv4096/128 (32 steps) took
# 31.98 MiB (34.51 with a SEQ_MINOR k) where 8 steps' rate says 12.35; its failure with a
# scoped-VMEM out-of-memory in tokamax's own v5e run (2026-12-07f, peers-3) was the model's one
# false admit of 16.
FWD_TILES_PER_EXTRA_STEP = 1.9
FWD_ROW_TEMPORARIES, SEQ_MINOR_Q_ROWS = 5.5, 0.5
DKV_LOGIT_TILES = 1.35
UNFITTED_MARGINS = {"v5p": 1.5, "v6e": 1.25}


def vmem_estimate(problem: Problem, config: TokamaxConfig) -> dict[str, int]:
    """Estimated peak VMEM bytes of each of tokamax's splash kernels (``fwd``, ``dkv``), as a
    v5e compiler allocates them (the model above)."""
    d, isz, c = problem.head_dim, problem.itemsize, config

    def io(rows: int, itemsize: int = isz) -> int:  # one double-buffered (rows, d) window
        return 2 * tile_bytes(rows, d, itemsize)

    row_stat = tile_bytes(c.block_q, LANES, 4)  # one (rows, 128) f32 row statistic
    masked = problem.causal or problem.window is not None  # query positions, for the mask
    q_ids = (masked + problem.segmented) * 2  # (rows, 128) or (8, rows) int32 blocks, doubled
    residuals = 2 if problem.mode == "fwd_bwd" else 0  # logsumexp, max_logits outputs
    steps = c.block_kv // c.block_kv_compute
    fitted_steps, extra_steps = min(steps, FWD_MAX_STEPS), max(steps - FWD_MAX_STEPS, 0)
    logits = tile_bytes(c.block_q, c.block_kv_compute, 4)
    row_temporaries = FWD_ROW_TEMPORARIES + (SEQ_MINOR_Q_ROWS if c.q_layout == "SEQ_MINOR"
                                             else 0)
    fwd = (2 * io(c.block_q) + 2 * io(c.block_kv)  # q, out; k, v
           + (2 + 2 * residuals) * row_stat + tile_bytes(c.block_q, d, 4)  # m, l, acc; outputs
           + (FWD_LOGIT_TILES + FWD_TILES_PER_STEP * (fitted_steps - 1)
              + FWD_TILES_PER_EXTRA_STEP * extra_steps) * logits
           + row_temporaries * row_stat
           + q_ids * row_stat + problem.segmented * 2 * tile_bytes(SUBLANES, c.block_kv, 4))
    estimate = {"fwd": int(fwd)}
    if problem.mode == "fwd_bwd":
        qd, kd, kc = c.block_q_dkv, c.block_kv_dkv, c.block_kv_dkv_compute
        partials = problem.kv_len // kd
        dq_itemsize = 4 if c.dq_reduction_steps is None and partials > 4 else isz
        estimate["dkv"] = int(
            2 * io(qd) + 4 * io(kd)  # q, dO; k, v, dk, dv
            + io(qd, dq_itemsize) * (2 if c.dq_reduction_steps else 1)  # dq (and its alias)
            + 2 * tile_bytes(kd, d, 4)  # f32 dk, dv scratch
            + (tile_bytes(qd, d, 4) if kc < kd else 0)  # f32 dq scratch
            + (2 * 2 + q_ids) * tile_bytes(SUBLANES, qd, 4)  # logsumexp, di, ids: (8, rows)
            + problem.segmented * 2 * tile_bytes(kd, LANES, 4)  # kv segment ids
            + DKV_LOGIT_TILES * tile_bytes(kc, qd, 4))
    return estimate


@dataclass(frozen=True)
class TokamaxSplashKernel(TunableKernel):
    name: ClassVar[str] = "tokamax"
    # 2: the layouts and scheduler are the forward's alone (1 ran the backward with them too)
    version: ClassVar[str] = "2"
    description: ClassVar[str] = ("tokamax's splash attention (its vendored, newer splash): "
                                  "base-2 exponentials, an experimental scheduler, the fused "
                                  "backward; needs the optional tokamax package")
    # tokamax's op runs it on TPU v5 and later only (``supported_on``); interpreted on a CPU.
    targets: ClassVar[tuple[str, ...]] = ("v5e", "v5p", "v6e", "cpu")
    platforms: ClassVar[tuple[str, ...]] = ("tpu",)
    config_type: ClassVar[type[TokamaxConfig]] = TokamaxConfig
    landscape_axes: ClassVar[tuple[str, str, str]] = ("block_q", "block_kv",
                                                      "use_experimental_scheduler")
    # The layouts, shared by both kernels, are prechecked at the default in the backward part.
    compile_parts: ClassVar[tuple[tuple[str, ...], ...]] = (FORWARD_FIELDS, DKV_FIELDS)
    # tokamax names each kernel after its entry point (mha, mqa), phase, segment ids and
    # residuals (``get_kernel_name``).
    profile_names: ClassVar[tuple[str, ...]] = tuple(
        f"splash_{entry}_{phase}{segments}"
        for entry, segments, phase in itertools.product(
            ("mha", "mqa"), ("", "_segmented"),
            ("fwd_no_residuals", "fwd_residuals", "dkv_no_residuals")))

    def problem_violations(self, problem: Problem) -> list[Violation]:
        return (tokamax_violations() + sequence_violations(problem.q_len, "q_len")
                + key_lane_violations(problem.kv_len) + x64_violations() + vma_violations())

    def device_violations(self, problem: Problem, target: Target) -> list[Violation]:
        return float32_violations(problem, target)

    def space_params(self, problem: Problem) -> Params:
        """Every legal block, except compute blocks past ``MAX_COMPUTE_BLOCK`` keys (tokamax's
        own space stops there too: the f32 logits tile must stay small)."""
        q_values = block_values(problem.q_len)
        kv_values = [v for v in block_values(problem.kv_len) if v % LANES == 0]
        compute_values = [v for v in kv_values if v <= MAX_COMPUTE_BLOCK] or kv_values[:1]
        params: Params = {"block_q": q_values, "block_kv": kv_values,
                          "block_kv_compute": compute_values,
                          **{f"{x}_layout": TokamaxConfig.choices("q_layout") for x in "qkv"},
                          "use_experimental_scheduler": [False, True]}
        if problem.mode == "fwd_bwd":
            params.update(block_q_dkv=q_values, block_kv_dkv=kv_values,
                          block_kv_dkv_compute=compute_values,
                          dq_reduction_steps=list(DQ_REDUCTION_STEPS))
        return params

    def violations(self, problem: Problem, config: TokamaxConfig,
                   target: Target | str = "cpu") -> list[Violation]:
        target = self.target(target)
        out = self.problem_violations(problem) + self.device_violations(problem, target)
        forward = problem.mode == "fwd"
        out += splash_block_violations(problem, config,
                                       SPLASH_FWD_AXES + (() if forward else SPLASH_DKV_AXES),
                                       SPLASH_COMPUTE_OF[:1 if forward else None])
        out += _dq_reduction_violations(problem, config)
        if out:  # a block the kernel cannot take: no estimate
            return out
        margin = UNFITTED_MARGINS.get(target.name, 1.0)
        need = {name: int(size * margin) for name, size in vmem_estimate(problem, config).items()}
        return vmem_limit_violations(need, target)

    def default_config(self, problem: Problem, target: Target | str = "cpu") -> TokamaxConfig:
        """Every block 512 (MaxText's, as the splash backend's default), capped at its
        sequence axis; ``HEAD_DIM_MINOR`` layouts; the experimental scheduler on and dQ summed
        by XLA, as tokamax's own defaults. tokamax's heuristic (every block 128) is a
        placeholder in tokamax, whose own search never takes blocks under 1024 at 1024 tokens
        or more."""
        self.target(target)
        return capped(problem)

    def seed_configs(self, problem: Problem, target: Target | str = "cpu") -> list[TokamaxConfig]:
        """Uniform blocks (the contract's), then tokamax's v5e winner
        (:data:`TOKAMAX_V5E_WINNER`) capped at the problem, where legal."""
        uniform = super().seed_configs(problem, target)
        winner = capped(problem, **TOKAMAX_V5E_WINNER)
        legal = not self.violations(problem, winner, target)
        return [*uniform, *([winner] if legal and winner not in uniform else [])]

    def attention(self, problem: Problem, config_for: ConfigFor,
                  sm_scale: float) -> AttentionFn:
        """The forward function in our layout. tokamax's custom VJP differentiates it with the
        config it was made with, so a differentiated call runs the ``fwd_bwd`` config (as
        :func:`kernel.contract.per_mode`); a plain call's kernel is made without backward
        blocks, so a ``fwd`` config's unchecked backward fields are never read."""
        return by_mode(lambda mode: mosaic_or_interpreted(lambda interpret: _attend(
            problem, config_for(mode), sm_scale, interpret, backward=mode == "fwd_bwd")))


def capped(problem: Problem, **changes: Any) -> TokamaxConfig:
    """The default config with ``changes``, each block capped at its sequence axis (the
    largest legal block up to it)."""
    config = TokamaxConfig().replace(**changes)
    values = {"q_len": block_values(problem.q_len),
              "kv_len": [v for v in block_values(problem.kv_len) if v % LANES == 0]
              or block_values(problem.kv_len)}
    return config.replace(**{field: largest_at_most(values[axis], getattr(config, field))
                             for field, axis in SPLASH_FWD_AXES + SPLASH_DKV_AXES})


def tokamax_mask(problem: Problem) -> Any:
    """tokamax's 2-D mask for ``problem``, the same for every head: a window (``LocalMask``:
    keys p - left..p + right for the query at position p), causal (keys up to p) or full; p is
    i top-left aligned, i + kv_len - q_len bottom-right (the masks' ``offset``). A causal mask
    under which every query sees every key (one query, bottom-right) is passed as the full
    mask: tokamax 0.0.12 keeps such a mask's query positions but drops its mask function, and
    its kernel asserts that it has both or neither."""
    from tokamax._src.ops.experimental.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    shape, offset = (problem.q_len, problem.kv_len), problem.query_offset
    if problem.window is not None:
        return masks.LocalMask(shape, problem.window, offset=offset)
    if problem.causal and offset < problem.kv_len - 1:
        return masks.CausalMask(shape, offset=offset)
    return masks.FullMask(shape)


def splash_config(problem: Problem, config: TokamaxConfig, interpret: bool,
                  backward: bool) -> Any:
    """tokamax's ``SplashConfig`` of ``config``: the backward fields only when differentiated."""
    from tokamax._src.ops.experimental.tpu.splash_attention import (
        splash_attention_kernel as sk,
    )

    fields = {name: getattr(config, name) for name in FORWARD_FIELDS}
    for layout in ("q_layout", "k_layout", "v_layout"):
        fields[layout] = sk.QKVLayout[fields[layout]]
    if backward:
        fields.update({name: getattr(config, name) for name in DKV_FIELDS})
    return sk.SplashConfig(**fields, attn_logits_soft_cap=problem.softcap, use_base2_exp=True,
                           interpret=interpret)


def _attend(problem: Problem, config: TokamaxConfig, sm_scale: float, interpret: bool,
            backward: bool) -> AttentionFn:
    import jax
    import jax.numpy as jnp
    from tokamax._src.ops.experimental.tpu.splash_attention import base
    from tokamax._src.ops.experimental.tpu.splash_attention import (
        splash_attention_kernel as sk,
    )

    mqa = problem.kv_heads == 1
    make = sk.make_splash_mqa if mqa else sk.make_splash_mha
    splash = make(tokamax_mask(problem), config=splash_config(problem, config, interpret,
                                                              backward),
                  q_seq_shards=1, mask_value=float(jnp.finfo(jnp.float32).min),
                  downcast_smem_data=False)
    run = _with_tokamax_backward(splash, mqa) if backward else splash

    def one_row(q, k, v, *segment_ids):  # noqa: ANN001, ANN002, ANN202
        if mqa:
            k, v = k[0], v[0]
        ids = base.SegmentIds(*segment_ids) if segment_ids else None
        return run(q, k, v, segment_ids=ids)

    def attend(q, k, v, *segment_ids):  # noqa: ANN001, ANN002, ANN202
        return jax.vmap(one_row)((q * sm_scale).astype(q.dtype), k, v, *segment_ids)

    return attend


def _with_tokamax_backward(splash: Any, mqa: bool) -> Callable[..., Any]:
    """``splash`` whose backward runs as tokamax's own op runs it
    (``pallas_mosaic_tpu_vjp.py``): with the config's backward blocks but ``HEAD_DIM_MINOR``
    layouts and Mosaic's default scheduler, whatever the forward's. splash's own VJP would
    run the forward's layouts and scheduler, a program tokamax's tuner never builds (on a
    v5e, tokamax's winner timed 2.2% faster than the same config through splash's VJP)."""
    import dataclasses

    import jax
    from tokamax._src.ops.experimental.tpu.splash_attention import (
        splash_attention_kernel as sk,
    )

    kw = splash.kwargs
    layout = sk.QKVLayout.HEAD_DIM_MINOR
    backward = dataclasses.replace(kw["config"], q_layout=layout, k_layout=layout,
                                   v_layout=layout, use_experimental_scheduler=False)
    static = (kw["mask_value"], mqa)
    masks = (kw["mask_function"], kw["fwd_mask_sparsity"], kw["dkv_mask_sparsity"])

    # The mask tables go in as arguments, not closed over: made under a trace they are tracers.
    @jax.custom_vjp
    def run(fwd_info, dkv_info, q, k, v, segment_ids):  # noqa: ANN001, ANN202
        return type(splash)(fwd_info, dkv_info, **kw)(q, k, v, segment_ids=segment_ids)

    def forward(fwd_info, dkv_info, q, k, v, segment_ids):  # noqa: ANN001, ANN202
        return sk._splash_attention_fwd(fwd_info, dkv_info, q, k, v, segment_ids, None, False,
                                        *static, kw["config"], *masks)

    def differentiate(residuals, d_out):  # noqa: ANN001, ANN202
        _, _, dq, dk, dv, *_ = sk._splash_attention_bwd(False, *static, backward, *masks,
                                                        residuals, d_out)
        return None, None, dq, dk, dv, None

    run.defvjp(forward, differentiate)
    return lambda q, k, v, segment_ids: run(splash.fwd_mask_info, splash.dkv_mask_info, q, k,
                                            v, segment_ids)


KERNEL = TokamaxSplashKernel()
