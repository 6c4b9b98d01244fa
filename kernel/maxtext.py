"""A drop-in for MaxText's attention op on TPU (``AttentionOp.tpu_flash_attention`` in its
``layers/attention_op.py``): the same inputs, masks and sharding, running
:func:`kernel.flash_attention` (the tuned kernel choice) where MaxText builds and calls splash.

What it does as MaxText does:
- ``query``, ``key``, ``value``: ``[batch, seq, heads, head_dim]`` (BSHD), transposed to
  ``[batch, heads, seq, head_dim]`` before the ``jax.shard_map`` and back after it;
- the ``shard_map`` over the whole mesh with ``check_vma=False``, in and out specs the
  PartitionSpecs MaxText resolves from its logical axes (``axis_names_q`` from
  ``flash_axis_names_q``, ``axis_names_kv`` from ``flash_axis_names_kv``), the segment ids'
  specs their batch and sequence entries;
- the mask of ``attention_type`` (MaxText's ``AttentionType`` or its value): ``"global"``
  causal, ``"local_sliding"`` causal within ``sliding_window_size`` keys (the query's own and
  the ``sliding_window_size - 1`` before it: its ``CausalMask & LocalMask``), ``"full"`` none;
  top-left aligned (its masks' ``offset=0``);
- ``decoder_segment_ids`` (``[batch, seq]``, the keys' too unless ``decoder_segment_ids_kv``
  is given) and ``attn_logits_soft_cap``; no scale (MaxText scales the query before, in its
  projection or by ``query_pre_attn_scalar``).

Inside the ``shard_map`` every axis is manual, so the problem resolved, tuned and captured is
each device's (docs/sharded-training.md). Only batch and heads may be sharded: a sharded
sequence (MaxText's context parallelism) or head_dim is refused naming the fix, as are the
attention types MaxText runs otherwise (chunk, MLA, compressed, block diffusion).
"""

from __future__ import annotations

from typing import Any

from kernel.attention import flash_attention
from kernel.sharded import padded, unshardable_axes

# MaxText's AttentionType values this op runs, and the mask options of each.
ATTENTION_TYPES = ("global", "local_sliding", "full")
# MaxText's BSHD layout to the wrapper's BHSD, and back (its own transposes).
TO_BHSD = (0, 2, 1, 3)


def tpu_flash_attention(query: Any, key: Any, value: Any, decoder_segment_ids: Any = None,
                        attn_logits_soft_cap: float | None = None, *, mesh: Any,
                        axis_names_q: Any, axis_names_kv: Any, attention_type: Any = "global",
                        sliding_window_size: int | None = None,
                        decoder_segment_ids_kv: Any = None) -> Any:
    """MaxText's ``tpu_flash_attention(query, key, value, decoder_segment_ids,
    attn_logits_soft_cap)``, the attributes of its ``AttentionOp`` it reads passed by name
    (``mesh``: ``self.mesh``; ``axis_names_q``, ``axis_names_kv``:
    ``self._logical_to_mesh_axes(self.flash_axis_names_q)`` and ``..._kv``;
    ``attention_type``, ``sliding_window_size``). Returns the attention output,
    ``[batch, seq, q_heads, head_dim]``, sharded as ``query``."""
    import jax
    import jax.numpy as jnp

    masks = _masks(getattr(attention_type, "value", attention_type), sliding_window_size)
    q_spec, kv_spec = (_checked_spec(name, spec) for name, spec in
                       (("axis_names_q", axis_names_q), ("axis_names_kv", axis_names_kv)))
    q, k, v = (jnp.transpose(x, TO_BHSD) for x in (query, key, value))
    ids = _segment_ids(decoder_segment_ids, decoder_segment_ids_kv)
    P = jax.sharding.PartitionSpec
    ids_specs = (P(q_spec[0], q_spec[2]), P(kv_spec[0], kv_spec[2]))[:len(ids)]

    def attend(q: Any, k: Any, v: Any, *ids: Any) -> Any:
        return flash_attention(q, k, v, sm_scale=1.0, logits_soft_cap=attn_logits_soft_cap,
                               segment_ids=ids or None, layout="BHSD", alignment="top_left",
                               **masks)

    out = jax.shard_map(attend, mesh=mesh,
                        in_specs=(P(*q_spec), P(*kv_spec), P(*kv_spec), *ids_specs),
                        out_specs=P(*q_spec), check_vma=False)(q, k, v, *ids)
    return jnp.transpose(out, TO_BHSD)


def _masks(attention_type: Any, sliding_window_size: int | None) -> dict[str, Any]:
    """The wrapper's mask options of MaxText's ``attention_type``; anything it runs another
    way raises naming the fix."""
    if attention_type not in ATTENTION_TYPES:
        raise ValueError(f"attention_type {attention_type!r} is not run by this op; it runs "
                         f"{', '.join(ATTENTION_TYPES)} (MaxText's AttentionType values): keep "
                         "MaxText's own attention for the others")
    if attention_type == "full":
        return {"causal": False}
    if attention_type == "global":
        return {"causal": True}
    if isinstance(sliding_window_size, bool) or not isinstance(sliding_window_size, int) \
            or sliding_window_size < 1:
        raise ValueError(f"attention_type 'local_sliding' needs sliding_window_size, a positive "
                         f"int (the keys each query sees, its own included), got "
                         f"{sliding_window_size!r}")
    return {"causal": True, "window": (sliding_window_size - 1, 0)}


def _checked_spec(name: str, spec: Any) -> tuple[Any, ...]:
    """``spec`` (a PartitionSpec of ``[batch, heads, seq, head_dim]``) as four entries; one
    sharding the sequence or head_dim raises naming the fix."""
    entries = padded(spec)
    sharded = unshardable_axes(entries, shardable=("batch", "heads"))
    if sharded:
        raise ValueError(f"{name} {spec} shards the {' and '.join(sharded)} axis: this op "
                         "runs whole sequences per device, so shard batch and heads only "
                         "(MaxText's logical axis rules: leave the length and kv axes "
                         "unsharded); for a sharded sequence (context parallelism) call "
                         "kernel.context_parallel_attention inside your shard_map")
    return entries


def _segment_ids(q_ids: Any, kv_ids: Any) -> tuple[Any, ...]:
    """The ``(q, kv)`` segment ids MaxText passes splash, or ``()`` without."""
    if q_ids is None:
        if kv_ids is not None:
            raise ValueError("decoder_segment_ids_kv was given without decoder_segment_ids: "
                             "pass the queries' segment ids too")
        return ()
    return q_ids, q_ids if kv_ids is None else kv_ids
