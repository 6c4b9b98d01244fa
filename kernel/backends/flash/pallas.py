"""Flash attention for TPU in Pallas (Mosaic): forward, dK/dV and dQ kernels tiled by a config.

Layout ``[batch, heads, seq, head_dim]``; K/V may have fewer heads than Q (grouped-query
attention). Causal and sliding-window masks are a :class:`~kernel.backends.flash.blocks.Reach`:
each kernel loads only the run of blocks it sees and computes only block pairs that
``Reach.sees``; logits may be soft-capped (``softcap * tanh(logits / softcap)``); segment ids
(packed sequences) mask element-wise, their blocks read beside q and K/V. The kernels are
chosen when lowering, per platform: Mosaic for TPU (so ``jax.export`` or an ahead-of-time
compile for TPU on a CPU host gets the real kernels), TPU interpret mode on a CPU (a
correctness oracle, not a speed proxy).
"""

from __future__ import annotations

import contextvars
import functools
import operator
from dataclasses import dataclass
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel.backends.flash.blocks import Reach
from kernel.backends.flash.config import FlashConfig
from kernel.contract import ConfigFor
from kernel.rules import LANES, SUBLANES
from kernel.sharded import summed_as, varying_struct

# Masked logits and the running max's start: the most negative finite f32, so every finite
# logit is at least as large (a fixed value like -1e30 loses to smaller visible logits, which then
# count as masked), and no inf - inf NaN arises.
MASK_VALUE = float(jnp.finfo(jnp.float32).min)
# Whether the kernel being traced runs in interpret mode (set by _pallas_call around its trace).
_INTERPRETING: contextvars.ContextVar[bool] = contextvars.ContextVar("interpreting", default=False)
# The forward's saved statistics per query in float32 (issue 74): the row max m and 1 / l, one
# row each; other dtypes save one row, the logsumexp (``_saves_m_and_inv_l``). m is in row 0,
# where the logsumexp is otherwise: the backward subtracts row 0 from the logits either way.
M_ROW, INV_L_ROW = 0, 1
STATS_ROWS = 2
_NT = (((1,), (1,)), ((), ()))  # a @ b.T without materialising the transpose
_TN = (((0,), (0,)), ((), ()))  # a.T @ b: Mosaic transposes a on the XLU, then one matmul
_NN = (((1,), (0,)), ((), ()))  # a @ b


def _mxu(a: jax.Array, b: jax.Array, dims=_NN) -> jax.Array:
    """``dot_general(a, b, dims)`` on the MXU, accumulated in f32. Mosaic's default contract
    precision rounds float32 operands to bf16 (one pass), so float32 inputs ask for fp32
    (``Precision.HIGHEST``: several bf16 passes): at logits near 1e4 one pass put the output
    0.8 off on a TPU v5e (2026-12-07), where the CPU's interpret mode is exact. Other dtypes
    leave the default, so their Mosaic modules are unchanged."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


# --- custom VJP: Pallas forward, Pallas dK/dV + dQ backward ----------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: Segments | None,
                    logits: Logits, config_for: ConfigFor) -> jax.Array:
    """Softmax(``logits``) v with Pallas kernels both ways; ``config_for(mode)`` gives
    the config at trace time: ``"fwd"`` for a plain call, ``"fwd_bwd"`` (its backward tiles)
    when differentiated. ``segments``: (q ids [batch, q_len], kv ids [batch, kv_len]) or None;
    a query sees keys of its own segment only. A query that sees no key gets zeros."""
    return _forward(q, k, v, segments, config_for("fwd"), logits, save_stats=False)[0]


def _flash_fwd(q, k, v, segments, logits, config_for):
    # custom_vjp traces this rule only when differentiating: the fwd_bwd-tuned config.
    out, stats, out_low = _forward(q, k, v, segments, config_for("fwd_bwd"), logits,
                                   save_stats=True)
    return out, (q, k, v, segments, out, out_low, stats)


def _flash_bwd(logits, config_for, residuals, d_out):
    q, k, v, segments, out, out_low, stats = residuals
    config = config_for("fwd_bwd")
    # delta_i = sum_d dO_id O_id = rowsum(P * dP): one fused XLA reduction feeding both kernels.
    # With the f32 output (bf16: its rounded part plus the remainder), not the output rounded
    # to bf16: that rounding error is shared by a whole row of dS, and was the largest error of
    # the bf16 gradients.
    out = out.astype(jnp.float32)
    if out_low is not None:
        out = out + out_low.astype(jnp.float32)
    # Row statistics [batch, heads, rows, q_len], queries on lanes (see _forward); the sum over
    # head_dim leaves delta in that layout (one row), with no relayout pass of its own.
    delta = jnp.sum(out * d_out.astype(jnp.float32), axis=-1)[:, :, None, :]
    dk, dv, dq = _backward_dkv(q, k, v, d_out, stats, delta, segments, config, logits)
    if dq is None:  # unfused: dQ has a kernel of its own
        dq = _backward_dq(q, k, v, d_out, stats, delta, segments, config, logits)
    # segment ids: integers, no cotangent
    return summed_as(dq, q), summed_as(dk, k), summed_as(dv, v), None


flash_attention.defvjp(_flash_fwd, _flash_bwd)


# --- kernels ---------------------------------------------------------------------------------

Segments = tuple[jax.Array, jax.Array]  # (q ids [batch, q_len], kv ids [batch, kv_len])


def _segment_layouts(segments: Segments | None) -> list[jax.Array]:
    """The segment ids as the kernels read them, as splash lays them out: q ids lane-replicated
    [batch, q_len, 128] (a block is whole vregs, like the running max and sum), kv ids
    sublane-replicated [batch, 8, kv_len] (a block row broadcasts down the query rows). None:
    no inputs."""
    if segments is None:
        return []
    q_ids, kv_ids = (ids.astype(jnp.int32) for ids in segments)
    return [jnp.broadcast_to(q_ids[:, :, None], (*q_ids.shape, LANES)),
            jnp.broadcast_to(kv_ids[:, None, :], (kv_ids.shape[0], SUBLANES, kv_ids.shape[1]))]


def _same_segment(q_ids_ref, kv_ids_ref, start, cols: int) -> jax.Array | None:
    """(rows, cols) True where the query's segment is the key's; keys ``start ..`` of the kv
    ids block. None without segment ids."""
    if q_ids_ref is None:
        return None
    return _lanes(q_ids_ref[...], cols) == kv_ids_ref[0:1, pl.ds(start, cols)]


def _segment_refs(refs: tuple, segmented: bool) -> tuple:
    """((q ids, kv ids) refs or (None, None), the refs after them) of a kernel's refs."""
    return (refs[:2], refs[2:]) if segmented else ((None, None), refs)


def _segment_specs(q_ids: pl.BlockSpec, kv_ids: pl.BlockSpec, segmented: bool) -> list:
    """The in_specs of the segment ids, when given."""
    return [q_ids, kv_ids] if segmented else []


@dataclass(frozen=True)
class Logits:
    """How the kernels form logits: ``sm_scale`` q kᵀ, soft-capped when ``softcap`` is set,
    masked outside ``reach`` (hashable: a static argument of the custom VJP)."""

    sm_scale: float
    reach: Reach
    softcap: float | None = None

    def of(self, q: jax.Array, k: jax.Array) -> jax.Array:
        """The (soft-capped) f32 logits of a q block against a k block, on the MXU; the scale
        is applied in f32, not to bf16 q."""
        s = _mxu(q, k, _NT) * self.sm_scale
        if self.softcap is None:
            return s
        return self.softcap * jnp.tanh(s / self.softcap)

    def capped_grad(self, s: jax.Array, ds: jax.Array) -> jax.Array:
        """dS with respect to the uncapped logits, given ``ds`` for the capped ``s``:
        d/dx softcap tanh(x / softcap) = 1 - tanh², and tanh = s / softcap."""
        if self.softcap is None:
            return ds
        return ds * (1.0 - jnp.square(s / self.softcap))

    def visible(self, shape: tuple[int, int], row0, col0,
                same_segment: jax.Array | None = None) -> jax.Array | None:
        """True where a query (row) sees a key (column): in reach, and in its segment when
        ``same_segment`` is given; None when every query sees every key (no mask)."""
        rows = lax.broadcasted_iota(jnp.int32, shape, 0) + row0
        cols = lax.broadcasted_iota(jnp.int32, shape, 1) + col0
        sides = []
        if self.reach.masks_right:
            sides.append(cols <= rows + self.reach.right)
        if self.reach.masks_left:
            sides.append(cols >= rows - self.reach.left)
        if same_segment is not None:
            sides.append(same_segment)
        return functools.reduce(operator.and_, sides) if sides else None


def _lanes(x: jax.Array, n: int) -> jax.Array:
    """Widens a lane-replicated (rows, 128) value to (rows, n)."""
    if n % LANES == 0:
        return jnp.tile(x, (1, n // LANES))  # whole-vreg copies, no cross-lane work
    if n < LANES:
        return x[:, :n]
    return jnp.broadcast_to(x[:, :1], (x.shape[0], n))


def _ds_dot(ds: jax.Array, y: jax.Array, dims=_NN) -> jax.Array:
    """``dot_general(ds, y, dims)`` (default ``ds @ y``) for the f32 logit gradients dS: dS
    rounded to ``y``'s dtype, one MXU pass, as splash does. Two bf16 passes (dS's rounding and
    its remainder) made fwd_bwd 1.11x slower on a TPU v5e (s4096 causal, default and tuned
    configs) for no smaller largest error over out, dq, dk and dv (5.2e-3 either way; splash
    7.8e-3): bench/results/tpu-v5e-2026-12-06/backward.json."""
    return _mxu(ds.astype(y.dtype), y, dims)


def _saves_m_and_inv_l(dtype) -> bool:
    """Whether the forward saves the row max m and 1 / l apart for inputs of ``dtype`` (else
    one logsumexp), decided at trace time (issue 74). A logsumexp m + log l is rounded to the
    ulp of m, an error every recomputed P of the row shares: at logits near 1e4 in float32,
    dV was 2.9x XLA's error; from m and 1 / l, P = exp(S - m) / l is as exact as the
    forward's. The price is an f32 multiply per logit in dK/dV (and its column of 1 / l in
    VMEM): 5.7% on a bf16 fwd_bwd step (TPU v5e, b4 h16 s4096 d128 causal, every block 512:
    10.19 against 9.64 ms) for bf16 errors unchanged (P and dS are rounded to bf16 for the
    MXU, far coarser than that ulp). So float32, the precision-first case, pays it; other
    dtypes keep splash's logsumexp."""
    return dtype == jnp.float32


def _column(row_ref, row: int = 0) -> jax.Array:
    """Row ``row`` of a (n, block_q) row-statistic block as a (block_q, 1) column, to broadcast
    along a logits tile's keys (lanes): a relayout of one vector, as splash's dQ kernel reads
    its lse."""
    return jnp.expand_dims(row_ref[row], -1)


def _probs_and_ds(q, k, v, do, shift, inv_l, delta, logits: Logits, q0, k0,
                  same_segment=None):
    """The probabilities P and logit gradients dS (f32, queries x keys) of a (q, k) block pair
    whose first query and key positions are ``q0`` and ``k0``, recomputed as the forward
    computed them: logits ``q @ k.T`` (the dot orientation decides its rounding), P =
    exp(S - ``shift``) ``inv_l``, dS = P (dO V^T - delta) (through the soft cap's derivative
    when capped); ``shift`` (the logsumexp, or the row max m), ``inv_l`` (1 / l) and
    ``delta`` are (block_q, 1) columns. ``inv_l`` None: P = exp(S - shift), for the logsumexp,
    or (with m) P and dS l times as large, for a caller that sums them along the keys and
    multiplies the sum by 1 / l once (no multiply per logit)."""
    s = logits.of(q, k)
    p = jnp.exp(s - shift)
    if inv_l is not None:
        p = p * inv_l
    mask = logits.visible(p.shape, q0, k0, same_segment)
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dp = _mxu(do, v, _NT)
    return p, logits.capped_grad(s, p * (dp - delta))


def _div(index, divisor: int):
    """``index // divisor`` for a non-negative traced grid index and a static divisor."""
    # lax.div, not //: floor division of traced ints lowers through sign(), which Mosaic
    # lowers per TPU generation (and so fails when lowering on a host without one). The divisor
    # takes the index's dtype: under jax_enable_x64 a Python int would be int64.
    return lax.div(index, jnp.asarray(divisor, index.dtype))


def _rem(index, divisor: int):
    """``index % divisor`` for a non-negative traced index and a static divisor (as ``_div``)."""
    return lax.rem(index, jnp.asarray(divisor, index.dtype))


# The block arithmetic of kernel.backends.flash.blocks on traced grid indices.
_TRACED_OPS = SimpleNamespace(minimum=jnp.minimum, maximum=jnp.maximum, div=_div)


def _when_seen(seen, compute, reach: Reach) -> None:
    """``compute()``, under ``pl.when(seen)`` when some block pair can be unseen."""
    if reach.masks:
        pl.when(seen)(compute)
    else:
        compute()


def ring_scratch(blocks: list[tuple[tuple[int, ...], jnp.dtype]], depth: int) -> list:
    """The scratch of ``stream_ahead``: a ring of ``depth`` VMEM buffers per streamed operand
    (``blocks``: (block shape, dtype) each), their DMA semaphores, and the ring slot at which
    the next grid step's blocks start (SMEM)."""
    return [*(pltpu.VMEM((depth, *shape), dtype) for shape, dtype in blocks),
            pltpu.SemaphoreType.DMA((len(blocks), depth)), pltpu.SMEM((1,), jnp.int32)]


def window(ref, axis: int, start, size: int):
    """``ref``'s ``size`` entries from ``start`` along ``axis``, the rest whole (a DMA source).
    A window as long as the axis is the whole ref: its start can only be 0, but Mosaic cannot
    prove that of a traced start, and rejects a lane offset it cannot prove a multiple of 128
    (a sequence of 200 tokens, its one block 200 long, failed to compile on a TPU v5e)."""
    if size == ref.shape[axis]:
        return ref
    return ref.at[(slice(None),) * axis + (pl.ds(pl.multiple_of(start, size), size),)]


def _in_32_bits(function):
    """``function`` traced with ``jax_enable_x64`` off: under it a Python int index (a DMA
    semaphore's, a loop bound) would be int64, which Mosaic rejects beside int32 grid indices
    ("'tpu.memref_slice' op operand #1 must be variadic of 32-bit signless integer")."""
    @functools.wraps(function)
    def traced(*args, **kwargs):
        with jax.enable_x64(False):
            return function(*args, **kwargs)
    return traced


@_in_32_bits
def stream_ahead(body, windows, count, ring: list, depth: int) -> None:
    """Runs ``body(t, *tiles)`` for t in 0 .. ``count(o) - 1`` at grid step o of the last grid
    axis, its tiles the HBM windows ``windows(o, t)`` copied to VMEM through ``ring``
    (``ring_scratch``): up to ``depth - 1`` blocks in flight ahead of the compute (a
    ``pl.Buffered(depth)`` pipeline, which a ``pallas_call`` BlockSpec lowers only at depths 1
    and 2), and across grid steps: the last steps of o start o + 1's first blocks, so only the
    first grid step of each (batch, head) waits on a fetch that nothing overlaps. Every copy
    started is of a block a step waits on (none past the last grid step's run), so none is in
    flight when the kernel ends (one was, under ``emit_pipeline`` at depth 4, and corrupted
    that kernel's results and every later kernel's on a TPU v5e: pallas-facts §10).

    ``emit_pipeline`` cannot do that in jax 0.10.2: its prologue starts the first fetch of
    every run, and the loop waits on it at once (no hook runs between the two, nor lets a
    fetch already made stand in; ``Buffered(prefetched_count=)`` is jax 0.12's only). So the
    DMAs are made here, as upstream's paged attention prefetches the next grid step's block;
    the ring's state crosses grid steps, so the last grid axis must be ``arbitrary`` (in order
    on one core)."""
    *buffers, sems, next_slot = ring
    o, last = pl.program_id(2), pl.num_programs(2) - 1
    ahead = depth - 1
    n = count(o)
    n_next = jnp.where(o < last, count(jnp.minimum(o + 1, last)), 0)

    @pl.when(o == 0)
    def _():
        next_slot[0] = 0

    base = next_slot[0]

    def copies(outer, t, slot) -> list:
        return [pltpu.make_async_copy(source, buffer.at[slot], sems.at[i, slot])
                for i, (source, buffer) in enumerate(zip(windows(outer, t), buffers,
                                                         strict=True))]

    def start(p):
        """Starts ring position p (from this step's block 0): this step's block p, else the
        next step's block p - n, if any."""
        own = p < n

        @pl.when(p < n + n_next)
        def _():
            for copy in copies(jnp.where(own, o, o + 1), jnp.where(own, p, p - n),
                               _rem(base + p, depth)):
                copy.start()

    # The previous grid step started positions 0 .. min(ahead, n) - 1 of this one.
    started = jnp.where(o == 0, 0, jnp.minimum(ahead, n))
    for p in range(ahead):
        pl.when(p >= started)(functools.partial(start, p))

    def step(t, carry):
        start(t + ahead)
        slot = _rem(base + t, depth)
        for copy in copies(o, t, slot):
            copy.wait()
        body(t, *(buffer.at[slot] for buffer in buffers))
        return carry

    # Interpreted, a traced trip count even where it is static (attention without a mask or
    # window): a static one makes fori_loop a scan, whose interpret-mode discharge in JAX 0.10.2
    # drops the varying mesh axes of its carry inside shard_map ("Scan carry input and output
    # got mismatched varying manual axes"). Compiled, the static count stays: Mosaic lowers a
    # traced one to a different, larger kernel (3 loops become 6 in the unmasked fwd_bwd).
    lax.fori_loop(0, jnp.asarray(n, jnp.int32) if _INTERPRETING.get() else n, step, 0)
    next_slot[0] = _rem(base + n, depth)


_IN_HBM = pl.BlockSpec(memory_space=pl.ANY)  # an operand the kernel streams itself
# The grid semantics of a kernel that streams through ``stream_ahead``: batch and heads may
# split across a chip's cores (megacore); the last axis runs in order on one, its ring's state
# carried from step to step. A TPU v5e has one TensorCore: nothing is given up there.
STREAMS_AHEAD = ("parallel", "parallel", "arbitrary")


def _pallas_call(kernel, *, semantics: tuple[str, ...], **kwargs):
    """``pl.pallas_call`` that picks, when lowered, Mosaic for TPU or interpret mode for CPU
    (the fast HLO interpreter; ``pltpu.force_tpu_interpret_mode`` still overrides it)."""

    def call(interpret: bool, *args):
        token = _INTERPRETING.set(interpret)  # read while pallas_call traces the kernel
        try:
            return pl.pallas_call(kernel, interpret=interpret, compiler_params=pltpu.CompilerParams(
                dimension_semantics=semantics), **kwargs)(*args)
        finally:
            _INTERPRETING.reset(token)

    return lambda *args: lax.platform_dependent(
        *args, tpu=functools.partial(call, False), cpu=functools.partial(call, True))


def _kv_run(reach: Reach, q_block, block_q: int, block_kv: int, kv_len: int):
    """``(first, count)``: the run of K/V blocks query block ``q_block`` sees
    (``Reach.kv_blocks``)."""
    return reach.kv_blocks(q_block * block_q, block_q, block_kv, kv_len // block_kv,
                           _TRACED_OPS)


def _kv_sources(k_hbm, v_hbm, kv_ids_hbm, group: int) -> list:
    """The K, V (and kv segment ids) the grid's (batch, q_head) reads, left in HBM."""
    batch, kv_head = pl.program_id(0), _div(pl.program_id(1), group)
    sources = [k_hbm.at[batch, kv_head], v_hbm.at[batch, kv_head]]
    return sources + ([kv_ids_hbm.at[batch]] if kv_ids_hbm is not None else [])


def _kv_ring(k, v, block_kv: int, segmented: bool, depth: int) -> list:
    """The scratch of ``_stream_kv``: the ring of K, V (and kv segment ids) blocks."""
    blocks = [((block_kv, k.shape[3]), k.dtype), ((block_kv, v.shape[3]), v.dtype),
              ((SUBLANES, block_kv), jnp.int32)]
    return ring_scratch(blocks[:2 + segmented], depth)


def _stream_kv(body, k_hbm, v_hbm, kv_ids_hbm, ring: list, reach: Reach, *, group: int,
               block_q: int, block_kv: int, depth: int) -> None:
    """Streams the run of K/V blocks the grid's query block sees (``Reach.kv_blocks``: blocks
    above the causal diagonal or outside the window are never fetched), with their kv segment
    ids when given, through ``body(k_ref, v_ref, kv_ids_ref or None, kv_block)``; the grid of
    the calling kernel is (batch, q_head, q_block), its scratch ends with ``ring``
    (``_kv_ring``). By ``stream_ahead``: the last steps of one query block's run fetch the
    next query block's first K/V blocks."""
    sources = _kv_sources(k_hbm, v_hbm, kv_ids_hbm, group)
    run_of = functools.partial(_kv_run, reach, block_q=block_q, block_kv=block_kv,
                               kv_len=k_hbm.shape[2])
    first = run_of(pl.program_id(2))[0]

    def windows(q_block, t):  # K, V (and kv ids) of step t of q_block's run
        start = (run_of(q_block)[0] + t) * block_kv
        return [window(source, axis, start, block_kv)
                for source, axis in zip(sources, (0, 0, 1), strict=False)]

    def step(t, k_ref, v_ref, kv_ids_ref=None):
        body(k_ref, v_ref, kv_ids_ref, first + t)

    stream_ahead(step, windows, lambda q_block: run_of(q_block)[1], ring, depth)


def _forward_kernel(q_ref, k_hbm, v_hbm, *refs, logits: Logits, segmented: bool, group: int,
                    block_kv: int, block_kv_compute: int, depth: int, save_stats: bool):
    (q_ids_ref, kv_ids_hbm), refs = _segment_refs(refs, segmented)
    ring_size = 4 + segmented  # _kv_ring's: K, V (kv ids), their semaphores, the next slot
    (*outs, m_ref, l_ref, acc_ref), ring = refs[:-ring_size], refs[-ring_size:]
    o_ref, stats_ref, low_ref = (*outs, None, None)[:3]
    block_q, head_dim = q_ref.shape
    q0 = pl.program_id(2) * block_q
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(k_ref, v_ref, kv_ids_ref, kv_block):
        def compute(start):
            k = k_ref[pl.ds(start, block_kv_compute), :]
            v = v_ref[pl.ds(start, block_kv_compute), :]
            s = logits.of(q_ref[...], k)
            mask = logits.visible(s.shape, q0, kv_block * block_kv + start,
                                  _same_segment(q_ids_ref, kv_ids_ref, start, block_kv_compute))
            if mask is not None:
                s = jnp.where(mask, s, MASK_VALUE)
            m_prev = m_ref[...]  # (block_q, 128): stats stay lane-replicated, whole vregs
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - _lanes(m_next, block_kv_compute))
            l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
            m_ref[...] = m_next
            pv = _mxu(p.astype(v.dtype), v)
            acc_ref[...] = acc_ref[...] * _lanes(alpha, head_dim) + pv

        def sub_block(sub, carry):
            # A loaded block may still hold sub-blocks no query sees: skip their compute.
            start = pl.multiple_of(sub * block_kv_compute, block_kv_compute)
            seen = logits.reach.sees(q0, block_q, kv_block * block_kv + start, block_kv_compute)
            _when_seen(seen, lambda: compute(start), logits.reach)
            return carry

        # Bounds the live f32 logits to (block_q, block_kv_compute) per iteration.
        lax.fori_loop(0, block_kv // block_kv_compute, sub_block, 0)

    _stream_kv(step, k_hbm, v_hbm, kv_ids_hbm, ring, logits.reach, group=group,
               block_q=block_q, block_kv=block_kv, depth=depth)
    # A row whose every computed logit was masked (m still MASK_VALUE) saw no key: zeros. Any
    # other row's masked terms were scaled away by alpha = exp(MASK_VALUE - m) = 0.
    inv_l = jnp.where(m_ref[...] > MASK_VALUE, 1.0 / l_ref[...], 0.0)
    out = acc_ref[...] * _lanes(inv_l, head_dim)
    o_ref[...] = out.astype(o_ref.dtype)
    if low_ref is not None:  # what rounding to bf16 lost, for the backward's delta
        low_ref[...] = (out - o_ref[...].astype(jnp.float32)).astype(low_ref.dtype)
    if save_stats:
        # Stored rows on lanes, (rows, block_q) (one XLU transpose of the lane-replicated
        # (block_q, 128) values): a (q_len, rows) column would be padded to 128 lanes in HBM,
        # 128x / rows the bytes for every pass that writes or reads it.
        if _saves_m_and_inv_l(q_ref.dtype):
            # m and 1 / l apart: P = exp(S - m) / l in the backward. A row that saw no key
            # gets m = +inf and 1 / l = 0: each P is 0. m in lane M_ROW, 1 / l in the next.
            m = jnp.where(m_ref[...] > MASK_VALUE, m_ref[...], jnp.inf)
            lane = lax.broadcasted_iota(jnp.int32, m.shape, 1)
            stats_ref[...] = jnp.where(lane == M_ROW, m, inv_l).T[:STATS_ROWS]
        else:
            # The logsumexp m + log l: P = exp(S - lse) in the backward. A row that saw no key
            # gets +inf, so its every P is exp(-inf) = 0. lse is rounded to the ulp of m (large
            # for large logits), an error every recomputed probability of the row shares:
            # splash's trade, for one statistic instead of two and no multiply by 1/l per logit.
            lse = jnp.where(m_ref[...] > MASK_VALUE, m_ref[...] + jnp.log(l_ref[...]),
                            jnp.inf)
            stats_ref[...] = lse.T[:1]


def _q_block_spec(block_q: int, head_dim: int) -> pl.BlockSpec:
    """A (block_q, head_dim) window of q (or dO, or the output) on a (batch, q_head, q_block)
    grid."""
    return pl.BlockSpec((None, None, block_q, head_dim), lambda b, h, i: (b, h, i, 0))


def _stat_rows(dtype) -> int:
    """Rows of the forward's saved statistics for inputs of ``dtype``: m and 1 / l, or the
    logsumexp (``_saves_m_and_inv_l``)."""
    return STATS_ROWS if _saves_m_and_inv_l(dtype) else 1


def _row_spec(block_q: int, rows: int = 1) -> pl.BlockSpec:
    """A (rows, block_q) window of row statistics [batch, q_heads, rows, q_len] on a (batch,
    q_head, q_block) grid."""
    return pl.BlockSpec((None, None, rows, block_q), lambda b, h, i: (b, h, 0, i))


def _q_ids_spec(block_q: int) -> pl.BlockSpec:
    """A (block_q, 128) window of the lane-replicated q segment ids on a (batch, q_head,
    q_block) grid."""
    return pl.BlockSpec((None, block_q, LANES), lambda b, h, i: (b, i, 0))


def _forward(q, k, v, segments, config: FlashConfig, logits: Logits, save_stats: bool):
    batch, q_heads, q_len, head_dim = q.shape
    bq = config.block_q
    q_spec = _q_block_spec(bq, head_dim)
    out_shape = [varying_struct(q.shape, q.dtype, q, k, v)]
    out_specs = [q_spec]
    if save_stats:  # m and 1 / l or the logsumexp, [batch, q_heads, rows, q_len]: rows on lanes
        rows = _stat_rows(q.dtype)
        out_shape.append(varying_struct((batch, q_heads, rows, q_len), jnp.float32, q, k, v))
        out_specs.append(_row_spec(bq, rows))
        if q.dtype != jnp.float32:
            out_shape.append(varying_struct(q.shape, q.dtype, q, k, v))
            out_specs.append(q_spec)
    kernel = functools.partial(
        _forward_kernel, logits=logits, segmented=segments is not None,
        group=q_heads // k.shape[1],
        block_kv=config.block_kv, block_kv_compute=config.block_kv_compute,
        depth=config.pipeline_depth, save_stats=save_stats)
    outs = _pallas_call(
        kernel,
        grid=(batch, q_heads, q_len // bq),
        in_specs=[q_spec, _IN_HBM, _IN_HBM,
                  *_segment_specs(_q_ids_spec(bq), _IN_HBM, segments is not None)],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((bq, LANES), jnp.float32),  # running max
                        pltpu.VMEM((bq, LANES), jnp.float32),  # running sum
                        pltpu.VMEM((bq, head_dim), jnp.float32),  # output accumulator
                        *_kv_ring(k, v, config.block_kv, segments is not None,
                                  config.pipeline_depth)],
        semantics=STREAMS_AHEAD,
        name="flash_fwd",
    )(q, k, v, *_segment_layouts(segments))
    if not save_stats:
        return outs[0], None, None
    return outs[0], outs[1], (outs[2] if len(outs) > 2 else None)


def _dkv_kernel(q_hbm, do_hbm, stats_hbm, delta_hbm, k_ref, v_ref, *refs, logits: Logits,
                segmented: bool, group: int, block_q: int, depth: int, fused: bool):
    (q_ids_hbm, kv_ids_ref), (dk_ref, dv_ref, *refs) = _segment_refs(refs, segmented)
    dq_ref, *refs = refs if fused else (None, *refs)
    dk_acc, dv_acc, *refs = refs
    dq_acc, ring = (refs[0], refs[1:]) if fused else (None, refs)
    block_kv = k_ref.shape[0]
    kv_block = pl.program_id(2)
    k0 = kv_block * block_kv
    dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
    dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)
    # Fused: dQ of the group's queries, summed over this (batch, kv head)'s kv blocks, which
    # run in order on one core (the grid's last axis is "arbitrary", as the ring's state needs):
    # the first zeroes it, the last writes it out.
    if fused:
        @pl.when(kv_block == 0)
        def _():
            dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)
    # Only the run of query blocks that see a kv block is streamed (none above the causal
    # diagonal or outside the window is fetched), for each query head of its group in turn.
    seen_by = logits.reach.transposed()
    q_len = q_hbm.shape[2]

    def run_of(kv_block):
        return seen_by.kv_blocks(kv_block * block_kv, block_kv, block_q, q_len // block_q,
                                 _TRACED_OPS)

    first, count = run_of(kv_block)
    batch, head0 = pl.program_id(0), pl.program_id(1) * group

    def place(kv_block, t):  # (head of the group, first query) of step t of kv_block's run
        first, count = run_of(kv_block)
        return _div(t, count), (first + _rem(t, count)) * block_q

    def windows(kv_block, t):  # Q, dO, statistics, delta (and q ids) of step t of its run
        head, start = place(kv_block, t)
        head += head0
        views = [(q_hbm.at[batch, head], 0), (do_hbm.at[batch, head], 0),
                 (stats_hbm.at[batch, head], 1), (delta_hbm.at[batch, head], 1)]
        if segmented:
            views.append((q_ids_hbm.at[batch], 0))
        return [window(view, axis, start, block_q) for view, axis in views]

    def step(t, q_ref, do_ref, stats_ref, delta_ref, q_ids_ref=None):
        head, q0 = place(kv_block, t)

        def run():
            # P and dS as the forward and the dQ kernel compute them (queries x keys), then
            # dV += P^T dO and dK += dS^T Q as transposed-lhs products (TN: contract the query
            # axis, 0, of both), as upstream's kernel does: Mosaic transposes the lhs on the
            # XLU before the MXU pass. Transposed logits (k @ q.T) would avoid that transpose
            # but round differently from the forward's, so P no longer matches the saved m and
            # l: with few keys on a CPU, dV missed tokamax's tolerance (2.7e-5 off float64).
            # With m and 1 / l, P's 1 / l costs a multiply per logit here: dK and dV sum over
            # queries, so a query's 1 / l cannot wait until after the sum, as in dQ.
            q, do, k = q_ref[...], do_ref[...], k_ref[...]
            inv_l = _column(stats_ref, INV_L_ROW) if _saves_m_and_inv_l(q.dtype) else None
            p, ds = _probs_and_ds(q, k, v_ref[...], do, _column(stats_ref), inv_l,
                                  _column(delta_ref), logits, q0, k0,
                                  _same_segment(q_ids_ref, kv_ids_ref, 0, block_kv))
            dv_acc[...] += _mxu(p.astype(do.dtype), do, _TN)
            dk_acc[...] += _ds_dot(ds, q, _TN)
            if fused:  # this block pair's share of dQ (P holds 1 / l, so dS does too)
                rows = window(dq_acc.at[head], 0, q0, block_q)
                rows[...] += _ds_dot(ds, k)

        # A kv block no query sees (kv_len > q_len, causal) still gets one step: skip it.
        _when_seen(seen_by.sees(k0, block_kv, q0, block_q), run, logits.reach)

    stream_ahead(step, windows, lambda kv_block: group * run_of(kv_block)[1], ring, depth)
    dk_ref[...] = (dk_acc[...] * logits.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)
    if fused:  # the last kv block: dQ to its output block, written back once per kv head
        pl.when(kv_block == pl.num_programs(2) - 1)(
            lambda: _scaled_copy(dq_acc, dq_ref, logits.sm_scale, block_q))


@_in_32_bits
def _scaled_copy(source, target, scale: float, block: int) -> None:
    """``target = source * scale`` (cast to its dtype) for (heads, rows, columns) refs, one
    (head, ``block`` rows) tile at a time: a whole sequence at once would unroll into one
    straight run of vector ops, its temporaries that large."""
    blocks = source.shape[1] // block

    def copy(i, carry):
        head, start = _div(i, blocks), _rem(i, blocks) * block
        window(target.at[head], 0, start, block)[...] = (
            window(source.at[head], 0, start, block)[...] * scale).astype(target.dtype)
        return carry

    lax.fori_loop(0, source.shape[0] * blocks, copy, 0)


def _backward_dkv(q, k, v, d_out, stats, delta, segments, config: FlashConfig,
                  logits: Logits):
    """(dK, dV, dQ or None): one grid step per kv block, its Q/dO pipeline summing over the
    query heads of its group and over the query blocks, in a VMEM accumulator. Fused
    (``config.fused_bwd``), dQ too: a query block's dQ sums over every kv block, which run in
    different grid steps, so the dQ of all the group's queries stays in an f32 VMEM accumulator
    across the kv blocks of its (batch, kv head), written out once after the last (splash's
    fused kernel writes a partial dQ per kv block to HBM instead, which XLA sums: kv_len /
    block_kv_dkv times dQ's bytes each way, for short sequences the larger cost)."""
    batch, kv_heads, kv_len, head_dim = k.shape
    q_heads, q_len = q.shape[1:3]
    bq, bkv, segmented = config.block_q_dkv, config.block_kv_dkv, segments is not None
    group, fused = q_heads // kv_heads, config.fused_bwd
    kv_spec = pl.BlockSpec((None, None, bkv, head_dim), lambda b, h, j: (b, h, j, 0))
    kernel = functools.partial(_dkv_kernel, logits=logits, segmented=segmented, group=group,
                               block_q=bq, depth=config.pipeline_depth_dkv, fused=fused)
    kv_ids_spec = pl.BlockSpec((None, SUBLANES, bkv), lambda b, h, j: (b, 0, j))
    streamed = [((bq, head_dim), q.dtype), ((bq, head_dim), d_out.dtype),
                ((_stat_rows(q.dtype), bq), jnp.float32), ((1, bq), jnp.float32),
                ((bq, LANES), jnp.int32)]
    # fused: the group's dQ, one block over every kv block of a (batch, kv head)
    dq_spec = pl.BlockSpec((None, group, q_len, head_dim), lambda b, h, j: (b, h, 0, 0))
    dk, dv, *dq = _pallas_call(
        kernel,
        grid=(batch, kv_heads, kv_len // bkv),
        in_specs=[_IN_HBM, _IN_HBM, _IN_HBM, _IN_HBM, kv_spec, kv_spec,
                  *_segment_specs(_IN_HBM, kv_ids_spec, segmented)],
        out_specs=[kv_spec, kv_spec, *[dq_spec] * fused],
        out_shape=[varying_struct(x.shape, x.dtype, q, k, v, d_out)
                   for x in (k, v, *[q] * fused)],
        scratch_shapes=[pltpu.VMEM((bkv, head_dim), jnp.float32),
                        pltpu.VMEM((bkv, head_dim), jnp.float32),
                        *[pltpu.VMEM((group, q_len, head_dim), jnp.float32)] * fused,
                        *ring_scratch(streamed[:4 + segmented], config.pipeline_depth_dkv)],
        semantics=STREAMS_AHEAD,
        name="flash_bwd_dkv",
    )(q, d_out, stats, delta, k, v, *_segment_layouts(segments))
    return dk, dv, (dq[0] if fused else None)


def _dq_kernel(q_ref, do_ref, stats_ref, delta_ref, k_hbm, v_hbm, *refs, logits: Logits,
               segmented: bool, group: int, block_kv: int, depth: int):
    (q_ids_ref, kv_ids_hbm), (dq_ref, dq_acc, *ring) = _segment_refs(refs, segmented)
    block_q = q_ref.shape[0]
    q0 = pl.program_id(2) * block_q
    dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    def step(k_ref, v_ref, kv_ids_ref, kv_block):
        def run():
            # With m and 1 / l, dS l (no 1 / l per logit): dQ = (1 / l) sum over keys of
            # dS l K, multiplied once below.
            k = k_ref[...]
            _, ds = _probs_and_ds(q_ref[...], k, v_ref[...], do_ref[...], _column(stats_ref),
                                  None, _column(delta_ref), logits, q0, kv_block * block_kv,
                                  _same_segment(q_ids_ref, kv_ids_ref, 0, block_kv))
            dq_acc[...] += _ds_dot(ds, k)

        _when_seen(logits.reach.sees(q0, block_q, kv_block * block_kv, block_kv), run,
                   logits.reach)

    _stream_kv(step, k_hbm, v_hbm, kv_ids_hbm, ring, logits.reach, group=group,
               block_q=block_q, block_kv=block_kv, depth=depth)
    scale = logits.sm_scale
    if _saves_m_and_inv_l(q_ref.dtype):
        scale = _column(stats_ref, INV_L_ROW) * scale
    dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


def _backward_dq(q, k, v, d_out, stats, delta, segments, config: FlashConfig,
                 logits: Logits):
    """dQ: the forward's grid and K/V pipeline, with its own block sizes and depth."""
    batch, q_heads, q_len, head_dim = q.shape
    bq = config.block_q_dq
    q_spec = _q_block_spec(bq, head_dim)
    kernel = functools.partial(_dq_kernel, logits=logits, segmented=segments is not None,
                               group=q_heads // k.shape[1], block_kv=config.block_kv_dq,
                               depth=config.pipeline_depth_dq)
    return _pallas_call(
        kernel,
        grid=(batch, q_heads, q_len // bq),
        in_specs=[q_spec, q_spec, _row_spec(bq, _stat_rows(q.dtype)), _row_spec(bq),
                  _IN_HBM, _IN_HBM,
                  *_segment_specs(_q_ids_spec(bq), _IN_HBM, segments is not None)],
        out_specs=q_spec,
        out_shape=varying_struct(q.shape, q.dtype, q, k, v, d_out),
        scratch_shapes=[pltpu.VMEM((bq, head_dim), jnp.float32),
                        *_kv_ring(k, v, config.block_kv_dq, segments is not None,
                                  config.pipeline_depth_dq)],
        semantics=STREAMS_AHEAD,
        name="flash_bwd_dq",
    )(q, d_out, stats, delta, k, v, *_segment_layouts(segments))
