"""Legality rules, VMEM estimate, search space and default config of the flash kernel.

Pure Python (no jax): the service checks legality of a stored config for a new shape with the
same rules the tuner uses. Static rules and the VMEM estimate are kept apart so that a caller
can also ask for the configs the estimate rejects (to measure the estimate against a compiler).
"""

from __future__ import annotations

from collections.abc import Iterable

from kernel.backends.flash.config import DEPTH_FIELDS, DQ_FIELDS, FlashConfig
from kernel.errors import ConfigError
from kernel.problem import Problem
from kernel.rules import (
    LANES,
    MAX_COMPUTE_BLOCK,
    SUBLANES,
    Violation,
    block_values,
    block_violations,
    largest_at_most,
    sequence_violations,
    tile_bytes,
    vmem_limit_violations,
)
from kernel.targets import Target

# The pipeline depths (VMEM buffers per operand a kernel streams through ``stream_ahead``'s
# ring) every supported JAX lowers for TPU (probed with jax 0.10.2 and 0.12);
# ``kernel.backends.flash.depths`` probes the installed one, up to MAX_PROBED_DEPTH.
MAX_PROBED_DEPTH = 4
DEFAULT_DEPTHS: tuple[int, ...] = tuple(range(1, MAX_PROBED_DEPTH + 1))


def problem_violations(problem: Problem) -> list[Violation]:
    """A sequence axis that no TPU block tiles (``seq_len``); the kv axis also needs a compute
    block of at most ``MAX_COMPUTE_BLOCK``. Windows, soft-capping and segment ids all run."""
    return (sequence_violations(problem.q_len, "q_len")
            + sequence_violations(problem.kv_len, "kv_len", MAX_COMPUTE_BLOCK))


def static_violations(
    problem: Problem, config: FlashConfig, depths: Iterable[int] = DEFAULT_DEPTHS
) -> list[Violation]:
    """Every static rule ``config`` breaks for ``problem`` (empty when legal)."""
    out = dq_violations(config)
    if out:  # unset fields the kernels would read: nothing else to check
        return out
    checks = [("block_q", problem.q_len, "q_len"), ("block_kv", problem.kv_len, "kv_len"),
              ("block_kv_compute", problem.kv_len, "kv_len")]
    if problem.mode == "fwd_bwd":
        checks += [("block_q_dkv", problem.q_len, "q_len"), ("block_kv_dkv", problem.kv_len,
                   "kv_len")]
        if not config.fused_bwd:
            checks += [("block_q_dq", problem.q_len, "q_len"),
                       ("block_kv_dq", problem.kv_len, "kv_len")]
    for field, dim, dim_name in checks:
        out += block_violations(field, getattr(config, field), dim, dim_name)
    if config.block_kv % config.block_kv_compute:
        out.append(Violation("compute_divides", f"block_kv_compute={config.block_kv_compute} "
                             f"must divide block_kv={config.block_kv}"))
    if config.block_kv_compute > MAX_COMPUTE_BLOCK:
        out.append(Violation("compute_max", f"block_kv_compute={config.block_kv_compute} "
                             f"exceeds {MAX_COMPUTE_BLOCK}; split the kv block further"))
    depths = tuple(depths)
    depth_fields = (DEPTH_FIELDS[:1] if problem.mode == "fwd" else
                    DEPTH_FIELDS[:2] if config.fused_bwd else DEPTH_FIELDS)
    for field in depth_fields:
        depth = getattr(config, field)
        if depth not in depths:
            out.append(Violation("pipeline_depth", f"{field}={depth} is not supported by the "
                                 f"installed JAX (pl.Buffered({depth}) in an in-kernel "
                                 f"pipeline does not lower for TPU); use one of {list(depths)}"))
    return out


def dq_violations(config: FlashConfig) -> list[Violation]:
    """``dq_unused``: the fused backward runs no dQ kernel, so its fields are None there, and
    only there (as splash's ``BlockSizes`` refuses dQ blocks with its fused kernel): a config
    is stored one way, and a search measures it once (``FlashKernel.canonical_params``)."""
    unset = [f for f in DQ_FIELDS if getattr(config, f) is None]
    if config.fused_bwd and len(unset) < len(DQ_FIELDS):
        return [Violation("dq_unused", "with fused_bwd the dQ kernel does not run; set "
                          f"{', '.join(DQ_FIELDS)} to null")]
    if not config.fused_bwd and unset:
        return [Violation("dq_unused", f"{', '.join(unset)} unset, but the unfused backward "
                          "runs the dQ kernel; set them, or fused_bwd=true")]
    return []


# Mosaic's internal scratch: the f32 temporaries of one compute step (logits, probabilities,
# mask, their bf16 copies) that do not stay in the 64 vector registers spill to VMEM, on top of
# the windows and scratch the kernel declares, under the same scoped limit. Measured with
# deviceless compiles (the compiler names the size it needs when the scoped limit is lowered):
# up to 1.2x the bytes of the step's f32 tiles (below), plus up to 0.4 MiB for small tiles.
SPILL_TILES = 1.25  # spilled bytes per byte of the f32 step temporaries, an upper bound
SPILL_FLOOR = 256 * 1024  # the vector register file (64 x 4 KiB), spilled at most once
# The forward kernel's narrow compute blocks (at most two vregs, 256 lanes, wide) spill less:
# measured up to 0.73x.
NARROW_SPILL_TILES = 0.75
NARROW_LANES = 2 * LANES
# The forward step has a second f32 temporary as large as its accumulator: the MXU's
# (block_q, head_dim) f32 product P @ V, added to acc * alpha. It is a value, not a ref, so it
# lives in the same 64 vregs and spills like the logits: the (block_q, block_kv_compute) tile
# alone undercounts a step with a large block_q x head_dim (v5e, d256, q2048 kv2048/256:
# 2.83 MiB spilled, 1.75 MiB counted; it failed to compile at 16.8 of 16 MiB). Counting both
# tiles, the spill less SPILL_FLOOR measured (v5e, libtpu 0.0.42, 60 forward configs, block_q
# 512-2048, compute blocks 128-1024, d 128-512, bf16 and f32, causal and not) up to 0.73
# (narrow) and 1.20 (wide) of their bytes together (up to 2.2 and 1.8 of the logits alone),
# so the factors above still bound it.
# The backward kernels' logit gradients dS: with f32 inputs fed to the MXU uncast (no half-size
# bf16 copies), measured up to 2.15 logits tiles, one tile more; with bf16 inputs, dS rounded
# to one bf16 copy, which the same bound covers (it was measured with two, its rounding and the
# f32 remainder).
# Their f32 matmul products (dK, dV, dQ: block x head_dim) stayed within it in 11 compiles with
# d 128-512 and 2048-row blocks (tightest: dQ d512 2048x128 bf16, 2.33 of 2.5 MiB counted).
BACKWARD_DS_SPILL_TILES = 1.0
# The (block_q, 1) f32 columns of the row statistics dK/dV keeps in VMEM, in columns' bytes (see
# vmem_estimate): the logsumexp and delta; in float32, whose forward saves the row max m and
# 1 / l apart (issue 74), m, delta, and 1 / l counted twice.
DKV_STAT_COLUMNS = {"bfloat16": 2, "float32": 4}
# Windows, soft-capping and segment ids add step temporaries, spilled like the others: a
# window masked on both sides a second key-position comparison, segment ids an int32
# comparison, a soft cap its tanh (kept live in the backward for the cap's derivative), in
# logits tiles. Measured (v5e, libtpu deviceless, gradient of b1 h2/1 4096 d128 bf16 at
# 1024-blocks, depth 2: the scoped limit it compiles under, 256 KiB steps): full 11.7 MiB, a
# (700, 300) window 11.5, segment ids 12.6 (their id blocks, counted by _segment_bytes: 1.06),
# a soft cap 15.4 (0.9 tiles of 4 MiB), all three 16.5. The comparisons get a quarter tile
# of margin each, the soft cap a whole tile. Segment ids also add input blocks.
WINDOW_SPILL_TILES = 0.25
SEGMENT_SPILL_TILES = 0.25
SOFTCAP_SPILL_TILES = 1.0
# Float32 dots run at fp32 contract precision (``Precision.HIGHEST``, issue 74: Mosaic's default
# rounds f32 operands to bf16 for one MXU pass; fp32 takes several passes over bf16 parts of each
# operand), which allocates far more than the terms above (v5e, d256 f32 dK/dV 2048x256 depth 1:
# 27.83 MiB, 13.91 at the default precision, 15.38 counted). Per kernel, bytes per byte of: its
# (query block, head_dim) f32 tile, its (kv block, head_dim) f32 tile, and its f32 logits tile
# once per 128 lanes of head_dim. Fitted to 108 deviceless v5e compiles, each kernel alone
# (libtpu 0.0.42.1, d 64-256, query blocks 128-4096, kv blocks 128-1024, depths 1-3;
# bench/kernels/data/flash_vmem/v5e_float32.jsonl, bench/kernels/flash_vmem_sizes.py): the
# smallest coefficients that bound every point, rounded up to quarters. Every point is within
# its estimate, at 1.01x to 2.75x (medians 1.24x forward, 1.10x dK/dV, 1.24x dQ); three sampled
# sweeps of whole configs, precision 1.0 (docs/flash-vmem-statistics.md).
F32_HIGHEST_TILES = {"fwd": (0.75, 0.0, 1.25), "dkv": (5.0, 0.0, 1.25),
                     "dq": (1.25, 3.0, 0.25)}


# The fused backward's dK/dV kernel (issue 74) keeps the dQ of its group's whole sequence in
# VMEM across its kv blocks: an f32 accumulator, and the output block it is written to once
# (double buffered, the input dtype), both counted whole; and each step's MXU product dS K, an
# f32 (block_q, head_dim) value added to its rows of the accumulator, in those tiles. Measured
# (v5e, libtpu deviceless, 27 fused dK/dV kernels: d 64-256, bf16 and f32, 512-4096 queries,
# GQA 4/1, dK/dV 256x256 to 2048x512, depths 2-4: bench/kernels/data/flash_fused_vmem/):
# every allocation within the estimate, the tightest 19.60 MiB of 21.88 (f32, 1024x1024), the
# loosest at d64 (0.47-0.64 of it); 1.7 to 4.5 MiB more than the same kernel unfused.
FUSED_DQ_STEP = 1.0


def _feature_tiles(problem: Problem) -> float:
    """Logits tiles of step temporaries that a window, a soft cap or segment ids add."""
    two_sided = problem.window is not None and not problem.causal
    return (WINDOW_SPILL_TILES * two_sided + SEGMENT_SPILL_TILES * problem.segmented
            + SOFTCAP_SPILL_TILES * (problem.softcap is not None))


def _segment_bytes(problem: Problem, rows: int, cols: int, depth: int, *, streamed: str) -> int:
    """VMEM of the segment-id blocks a kernel holds for ``rows`` queries and ``cols`` keys: q
    ids lane-replicated (rows, 128) int32, kv ids sublane-replicated (8, cols) int32; the side
    that follows the kernel's grid is a double-buffered window, the streamed side ``depth``
    buffers (``streamed``: "kv" or "q")."""
    if not problem.segmented:
        return 0
    q_ids, kv_ids = tile_bytes(rows, LANES, 4), tile_bytes(SUBLANES, cols, 4)
    if streamed == "kv":
        return 2 * q_ids + depth * kv_ids
    return depth * q_ids + 2 * kv_ids


def _spill_bytes(rows: int, cols: int, tiles: float = SPILL_TILES, extra: int = 0) -> int:
    """Upper bound of Mosaic's internal scratch for a step with a (rows, cols) f32 logits tile
    and ``extra`` bytes of other f32 temporaries (tiles) that spill alike."""
    return int(tiles * (tile_bytes(rows, cols, 4) + extra)) + SPILL_FLOOR


def fp32_dot_bytes(problem: Problem, kernel: str, rows: int, cols: int) -> int:
    """What float32's fp32-precision dots add to ``kernel``'s VMEM for a (rows, cols) logits
    tile (``F32_HIGHEST_TILES``); 0 for other dtypes, whose dots keep the default precision."""
    if problem.dtype != "float32":
        return 0
    d = problem.head_dim
    tiles = (tile_bytes(rows, d, 4), tile_bytes(cols, d, 4),
             tile_bytes(rows, cols, 4) * -(-d // LANES))
    return int(sum(c * t for c, t in zip(F32_HIGHEST_TILES[kernel], tiles, strict=True)))


def _stat_row_bytes(block: int) -> int:
    """VMEM of one buffer of row statistics (the logsumexp, m and 1 / l, or delta of ``block``
    queries): the kernels keep them lane-dense, a (1, block) or (2, block) f32 row block, padded
    to (8, block) either way (a lane-replicated (block, 128) column would take 16x that)."""
    return tile_bytes(1, block, 4)


def vmem_estimate(problem: Problem, config: FlashConfig) -> dict[str, int]:
    """Estimated peak VMEM bytes of each kernel the problem runs (``fwd``, ``dkv``, ``dq``; no
    ``dq`` with ``fused_bwd``, whose ``dkv`` computes dQ too).

    Each kernel holds the windows of its outer grid (two buffers each), the buffers of the
    operands it streams through its inner pipeline (its pipeline depth times their tile bytes),
    its declared scratch accumulators and Mosaic's internal scratch (``_spill_bytes``).
    Checked against the Mosaic compiler by ``bench/kernels/precheck.py``; meant as an upper bound (a
    config it admits compiles). In a gradient program XLA may keep operands
    in VMEM outside the scoped limit, so there a kernel can need less than its windows suggest
    (most of the rejected configs that compile anyway are such).
    """
    d, isz, depth = problem.head_dim, problem.itemsize, config.pipeline_depth
    features = _feature_tiles(problem)
    bq, bkv, bkc = config.block_q, config.block_kv, config.block_kv_compute
    row_stat = tile_bytes(bq, LANES, 4)  # lane-replicated f32 per-row value (m, l scratch)
    spill_tiles = NARROW_SPILL_TILES if bkc <= NARROW_LANES else SPILL_TILES
    fwd = (
        2 * tile_bytes(bq, d, isz)  # q window, double buffered
        + 2 * depth * tile_bytes(bkv, d, isz)  # streamed k and v buffers
        + 2 * tile_bytes(bq, d, isz)  # output window
        + 2 * row_stat + tile_bytes(bq, d, 4)  # m, l, acc scratch
        # one compute sub-block's logits and its f32 P @ V product (see SPILL_TILES), and the
        # temporaries of a window, soft cap or segment ids
        + _spill_bytes(bq, bkc, spill_tiles,
                       extra=tile_bytes(bq, d, 4) + int(features * tile_bytes(bq, bkc, 4)))
        + _segment_bytes(problem, bq, bkv, depth, streamed="kv")
        + fp32_dot_bytes(problem, "fwd", bq, bkc)
    )
    if problem.mode == "fwd_bwd":
        fwd += 2 * _stat_row_bytes(bq)  # statistics output window (rows), for the backward
        if isz < 4:  # the output's bf16 rounding remainder, for the backward's delta
            # ... and the f32 output it is taken from (acc / l), a (block_q, head_dim) value
            # that stays live across its own bf16 store: it spills whole (measured: 1.00-1.02
            # f32 tiles more than the same config's plain forward).
            fwd += 2 * tile_bytes(bq, d, isz) + tile_bytes(bq, d, 4)
    estimate = {"fwd": fwd}
    if problem.mode == "fwd_bwd":
        bwd_tiles = SPILL_TILES + BACKWARD_DS_SPILL_TILES + features
        qk, kk, depth_dkv = config.block_q_dkv, config.block_kv_dkv, config.pipeline_depth_dkv
        estimate["dkv"] = (
            2 * depth_dkv * tile_bytes(qk, d, isz)  # streamed q, do buffers
            # streamed statistics and delta rows (ring buffers)
            + 2 * depth_dkv * _stat_row_bytes(qk)
            # ... and the lane-padded (block_q, 1) f32 columns a step broadcasts them as along
            # the keys: values, kept whole in VMEM (v5e, d256 bf16, dK/dV 4096x128 depth 2:
            # 17.90 MiB allocated, 14.0 counted without them, 18.0 with). In float32 the column
            # of 1 / l, which multiplies P, took 0.4 to 2.3 columns' bytes more in nine
            # configs, and without it the estimate fell below one (issue 74, d256, 2048x256
            # depth 1: 13.02 MiB allocated with the logsumexp, 13.91 with m and 1 / l, 13.38
            # counted): counted as two (docs/flash-vmem-statistics.md).
            + DKV_STAT_COLUMNS[problem.dtype] * tile_bytes(qk, 1, 4)
            + 2 * 2 * tile_bytes(kk, d, isz)  # k, v windows
            + 2 * 2 * tile_bytes(kk, d, isz)  # dk, dv output windows
            + 2 * tile_bytes(kk, d, 4)  # dk, dv accumulators
            + _spill_bytes(qk, kk, bwd_tiles)  # logits, their gradients, their transposes
            + _segment_bytes(problem, qk, kk, depth_dkv, streamed="q")
            + fp32_dot_bytes(problem, "dkv", qk, kk)
        )
        if config.fused_bwd:  # dQ of the whole sequence, and of the step (see FUSED_DQ_STEP)
            rows = problem.q_len
            estimate["dkv"] += (problem.q_heads // problem.kv_heads * (
                2 * tile_bytes(rows, d, isz) + tile_bytes(rows, d, 4))  # output, accumulator
                + int(FUSED_DQ_STEP * tile_bytes(qk, d, 4)))
            return estimate
        qq, kq = config.block_q_dq, config.block_kv_dq
        estimate["dq"] = (
            2 * 2 * tile_bytes(qq, d, isz)  # q, do windows
            # statistics and delta row windows, double buffered (dQ's columns of them stayed
            # within the rest: v5e, d256, 4096x128 depth 2: 12.03 MiB allocated of 21.5 counted)
            + 2 * 2 * _stat_row_bytes(qq)
            + 2 * config.pipeline_depth_dq * tile_bytes(kq, d, isz)  # streamed k, v
            + 2 * tile_bytes(qq, d, isz)  # dq output window
            + tile_bytes(qq, d, 4)  # dq accumulator
            + _spill_bytes(qq, kq, bwd_tiles)  # logits and their gradients
            + _segment_bytes(problem, qq, kq, config.pipeline_depth_dq, streamed="kv")
            + fp32_dot_bytes(problem, "dq", qq, kq)
        )
    return estimate


def vmem_violations(problem: Problem, config: FlashConfig, target: Target) -> list[Violation]:
    """The VMEM rule: every kernel's estimate must fit the target's scoped VMEM limit."""
    return vmem_limit_violations(vmem_estimate(problem, config), target)


def violations(
    problem: Problem,
    config: FlashConfig,
    target: Target,
    depths: Iterable[int] = DEFAULT_DEPTHS,
) -> list[Violation]:
    """All rules (problem, static and VMEM) that ``config`` breaks for ``problem`` on
    ``target``."""
    static = static_violations(problem, config, depths)
    if any(v.rule == "dq_unused" for v in static):  # unset blocks the kernels would run
        return problem_violations(problem) + static
    return problem_violations(problem) + static + vmem_violations(problem, config, target)


def space_params(
    problem: Problem, depths: Iterable[int] = DEFAULT_DEPTHS
) -> dict[str, list[int]]:
    """The declared values of each tunable field (before cross-field and VMEM rules).

    In ``fwd`` mode the backward fields are not tunable and keep the default's values. In
    ``fwd_bwd`` the dQ fields also take None, their value when ``fused_bwd`` leaves them
    unused (``FlashKernel.canonical_params`` sets it).
    """
    q_values, kv_values = block_values(problem.q_len), block_values(problem.kv_len)
    params: dict[str, list[int]] = {
        "block_q": q_values,
        "block_kv": kv_values,
        "block_kv_compute": [v for v in kv_values if v <= MAX_COMPUTE_BLOCK] or kv_values[:1],
        "pipeline_depth": sorted(set(depths)),
    }
    if problem.mode == "fwd_bwd":
        params.update(block_q_dkv=q_values, block_kv_dkv=kv_values,
                      pipeline_depth_dkv=params["pipeline_depth"],
                      fused_bwd=FlashConfig.choices("fused_bwd"), block_q_dq=[None, *q_values],
                      block_kv_dq=[None, *kv_values],
                      pipeline_depth_dq=[None, *params["pipeline_depth"]])
    return params


def default_config(
    problem: Problem,
    target: Target,
    depths: Iterable[int] = DEFAULT_DEPTHS,
) -> FlashConfig:
    """A safe heuristic config: 512-row query tiles and 512-key kv tiles (1024 on v6e, which
    has twice the scoped VMEM), the backward's tiles the same at most 512, double buffered,
    shrunk until the VMEM estimate fits. Raises ``ConfigError`` for a problem no config can
    run."""
    broken = problem_violations(problem)
    if broken:
        raise ConfigError(f"no flash config can run {problem.label()}: "
                          + "; ".join(map(str, broken)))
    depths = tuple(depths)
    q_values, kv_values = block_values(problem.q_len), block_values(problem.kv_len)
    kv_cap = 1024 if target.name == "v6e" else 512
    q_cap = 512
    while True:
        bkv = largest_at_most(kv_values, kv_cap)
        bq = largest_at_most(q_values, q_cap)
        # Backward tiles as large as the forward's: on a v5e every block 512 took the causal
        # fwd_bwd step 1.24-1.31x faster than dK/dV 256x512 and dQ 512x256 (grid problems at
        # 2k-8k tokens, bench/results/tpu-v5e-2026-12-06d).
        bkv_bwd = largest_at_most(kv_values, min(kv_cap, 512))
        config = FlashConfig(
            block_q=bq, block_kv=bkv,
            block_kv_compute=largest_at_most([v for v in kv_values if bkv % v == 0], 512),
            block_q_dkv=bq, block_kv_dkv=bkv_bwd, block_q_dq=bq, block_kv_dq=bkv_bwd,
            **dict.fromkeys(DEPTH_FIELDS, 2 if 2 in depths else max(depths)),
        )
        fits = not vmem_violations(problem, config, target)
        if fits or (q_cap <= LANES and kv_cap <= LANES):
            return config
        q_cap, kv_cap = max(LANES, q_cap // 2), max(LANES, kv_cap // 2)

