"""The correctness gate's reference: attention in float32 at ``highest`` precision, in bounded
memory.

The full reference (:func:`kernel.contract.reference_attention`) holds every logit at once and,
differentiated, their gradient too: one Llama-3-8B layer at 8k tokens (batch 2, 32 query
heads) needs 24 GB of temporaries on a TPU, where the kernels it checks need under 1 GB. This
one computes the same attention over blocks of queries (``lax.map``), each against every key,
so at most one block's logits (about :data:`BLOCK_LOGIT_BYTES`) live at a time; its backward
recomputes a block's logits (``jax.checkpoint``) instead of keeping them.

Pure Python at import; jax loads where used.
"""

from __future__ import annotations

import functools
from typing import Any

from kernel.problem import Problem

# The float32 logits of one query block (every head and key): a few such arrays (logits,
# probabilities, their gradients) are the reference's temporaries.
BLOCK_LOGIT_BYTES = 64 * 2**20


def query_block(batch: int, q_heads: int, kv_len: int,
                budget: int = BLOCK_LOGIT_BYTES) -> int:
    """Queries per block: the largest power of two whose float32 logits (``batch * q_heads *
    block * kv_len`` of them) stay within ``budget`` bytes, at least 1."""
    rows = max(1, budget // (batch * q_heads * kv_len * 4))
    return 1 << (rows.bit_length() - 1)


def blockwise_reference(q: Any, k: Any, v: Any, q_segment_ids: Any = None,
                        kv_segment_ids: Any = None, *, causal: bool = False,
                        sm_scale: float | None = None, window: tuple[int, int] | None = None,
                        softcap: float | None = None, query_offset: int = 0,
                        block: int | None = None) -> Any:
    """:func:`kernel.contract.reference_attention`'s attention (same arguments, same masks, a
    query that sees no key gets zeros) computed in float32 at ``highest`` precision over
    blocks of ``block`` queries (default :func:`query_block`); the output in q's dtype."""
    import jax
    import jax.numpy as jnp

    batch, q_heads, q_len, _ = q.shape
    block = min(q_len, block or query_block(batch, q_heads, k.shape[2]))
    count = -(-q_len // block)
    wide = jnp.promote_types(q.dtype, jnp.float32)
    pad = count * block - q_len  # padded queries are computed, then dropped
    padded = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0)))
    blocks = jnp.moveaxis(padded.reshape(batch, q_heads, count, block, -1), 2, 0)
    ids = None
    if q_segment_ids is not None:
        ids = jnp.moveaxis(jnp.pad(q_segment_ids, ((0, 0), (0, pad))).reshape(
            batch, count, block), 1, 0)
    attend = jax.checkpoint(functools.partial(
        _attend_block, k.astype(wide), v.astype(wide), kv_segment_ids, causal=causal,
        scale=q.shape[-1] ** -0.5 if sm_scale is None else sm_scale, window=window,
        softcap=softcap))
    firsts = query_offset + jnp.arange(count) * block
    out = jax.lax.map(lambda step: attend(*step), (firsts, blocks, ids))
    out = jnp.moveaxis(out, 0, 2).reshape(batch, q_heads, count * block, -1)
    return out[:, :, :q_len]


def _attend_block(k: Any, v: Any, kv_segment_ids: Any, first: Any, q: Any, q_segment_ids: Any,
                  *, causal: bool, scale: float, window: tuple[int, int] | None,
                  softcap: float | None) -> Any:
    """Attention of one block of queries (``q`` ``[batch, q_heads, block, head_dim]``, the
    first at position ``first``) over every key (``k``, ``v`` in float32), grouped-query heads
    without repeating K/V; the output in q's dtype."""
    import jax
    import jax.numpy as jnp

    batch, q_heads, block, head_dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.astype(k.dtype).reshape(batch, kv_heads, q_heads // kv_heads, block, head_dim)
    highest = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bhgqd,bhkd->bhgqk", grouped, k, precision=highest) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    mask = attention_mask(block, k.shape[2], causal=causal, window=window, first_query=first,
                          q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    logits = jnp.where(mask[:, :, None], logits, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total == 0, 1, total)  # a row with no key: zeros
    out = jnp.einsum("bhgqk,bhkd->bhgqd", probs, v, precision=highest)
    return out.reshape(batch, q_heads, block, head_dim).astype(q.dtype)


def attention_mask(q_len: int, kv_len: int, *, causal: bool = False,
                   window: tuple[int, int] | None = None, q_segment_ids: Any = None,
                   kv_segment_ids: Any = None, first_query: Any = 0) -> Any:
    """Which keys each query sees, a bool array ``[batch or 1, 1, q_len, kv_len]``: key j is
    seen by query i at position p when ``j <= p`` (``causal``), ``p - left <= j <= p + right``
    (``window``) and their segment ids are equal (when given). ``first_query``: the position p
    of the first of the ``q_len`` queries (0: top-left aligned; ``kv_len - q_len``:
    bottom-right; or a block of a longer sequence)."""
    import jax.numpy as jnp

    rows = first_query + jnp.arange(q_len)[:, None]
    cols = jnp.arange(kv_len)[None, :]
    mask = jnp.ones((q_len, kv_len), bool)
    if causal:
        mask &= cols <= rows
    if window is not None:
        mask &= (cols >= rows - window[0]) & (cols <= rows + window[1])
    mask = mask[None, None]
    if q_segment_ids is not None:
        mask = mask & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    return mask


def problem_reference(problem: Problem) -> Any:
    """``(q, k, v[, q_segment_ids, kv_segment_ids]) -> output`` of ``problem`` by
    :func:`blockwise_reference`, at the default scale (what the gate runs, before
    :func:`kernel.contract.measured_fn` differentiates it for ``fwd_bwd``)."""
    return functools.partial(blockwise_reference, causal=problem.causal, window=problem.window,
                             softcap=problem.softcap, query_offset=problem.query_offset)
