"""Context parallelism: attention over a sequence sharded over a mesh axis, run per device by
the wrapper (``kernel.context_parallel_attention``; docs/sharded-training.md).

Inside ``jax.shard_map`` each device holds ``length`` positions of every sequence. It
all-gathers K and V (and the kv segment ids) along the sequence and attends its own queries to
the keys they can see: a wrapper call with a static mask that puts those queries at their
global positions, so each device's problem is resolved from the table, tuned and captured as
any call's. The device's index is traced (``lax.axis_index``), so the calls are the branches of
a ``lax.switch``, one per device (one call, no switch, where every device's is the same: no
mask, or one device). The backward is autodiff's: the all-gather's transpose sums each
device's dK and dV into the shard they came from (a reduce-scatter).

Every call attends to the same number of keys, so the branches' residuals have one shape
(a switch keeps one slot per residual shape, filled by the branch that ran): the backward keeps
one copy of the gathered K and V, not one per device.

Load balancing (MaxText's ``context_parallel_load_balance``): under a causal mask device
``i`` of ``n`` holds sequence chunks ``i`` and ``2n - 1 - i`` of ``2n`` (the order
:func:`load_balanced_order` gives), so every device sees about as many keys; it then makes
two calls, one per chunk.

Pure Python at import; jax loads where used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from kernel.problem import checked_window


@dataclass(frozen=True)
class Block:
    """One wrapper call of a device: its queries ``first_row .. first_row + rows - 1`` (of its
    shard) against keys ``start .. start + keys - 1`` of the whole sequence, under the mask
    that puts them at their global positions (``flash_attention``'s arguments)."""

    first_row: int
    rows: int
    start: int
    keys: int
    causal: bool
    window: tuple[int, int] | None
    alignment: str


def load_balanced_order(shards: int, seq_len: int) -> list[int]:
    """The positions of a sequence in the order ``shards`` devices hold them load-balanced
    (MaxText's order): the sequence in ``2 * shards`` chunks, device ``i`` holding chunks
    ``i`` and ``2 * shards - 1 - i``. Reorder tokens, positions and segment ids with it
    before sharding (``jnp.take(x, order, axis)``), and the output back with its inverse
    (``np.argsort(order)``)."""
    if shards < 1 or seq_len % (2 * shards):
        raise ValueError(f"a load-balanced sequence of {shards} shards has 2 * {shards} chunks "
                         f"of equal length; seq_len {seq_len} does not divide into them (pad "
                         f"the sequence to a multiple of {2 * max(shards, 1)})")
    half = seq_len // (2 * shards)
    chunks = [chunk for device in range(shards) for chunk in (device, 2 * shards - 1 - device)]
    return [chunk * half + t for chunk in chunks for t in range(half)]


def plan(shards: int, length: int, *, causal: bool, window: Any = None,
         load_balanced: bool = False) -> tuple[tuple[Block, ...], ...]:
    """The calls of each of ``shards`` devices holding ``length`` positions each: which of
    its queries attend to which keys, under which mask (``window`` as ``flash_attention``'s;
    a malformed one raises naming the fix)."""
    if window is not None:
        window = checked_window(window, causal)
    left = window[0] if window else None  # how far back a query sees (None: to the start)
    right = 0 if causal else (window[1] if window else None)  # and ahead (None: to the end)
    total = shards * length
    queries = _query_blocks(shards, length, load_balanced and shards > 1)
    spans = [[_span(position, rows, left, right, total) for _, rows, position in device]
             for device in queries]
    keys = max(end - start for device in spans for start, end in device)
    return tuple(tuple(_block(first_row, rows, position, start, keys, total, left, right)
                       for (first_row, rows, position), (start, _) in zip(device, starts,
                                                                          strict=True))
                 for device, starts in zip(queries, spans, strict=True))


def _query_blocks(shards: int, length: int,
                  balanced: bool) -> list[list[tuple[int, int, int]]]:
    """Each device's blocks of queries as ``(first_row, rows, global position)``."""
    if not balanced:
        return [[(0, length, device * length)] for device in range(shards)]
    half = length // 2
    return [[(0, half, device * half), (half, half, (2 * shards - 1 - device) * half)]
            for device in range(shards)]


def _span(position: int, rows: int, left: int | None, right: int | None,
          total: int) -> tuple[int, int]:
    """The keys ``[start, end)`` that queries ``position .. position + rows - 1`` see."""
    start = 0 if left is None else max(0, position - left)
    end = total if right is None else min(total, position + rows + right)
    return start, end


def _block(first_row: int, rows: int, position: int, start: int, keys: int, total: int,
           left: int | None, right: int | None) -> Block:
    """The call of queries ``position ..`` against ``keys`` keys from ``start`` (moved back to
    end at the sequence's end where needed): the mask that puts them there, as
    ``flash_attention`` takes it (a window's sides are never negative, so where the queries
    sit past a window's left side it is written bottom-right aligned)."""
    start = min(start, total - keys)
    ahead = position - start  # query 0's position among the keys (top-left: 0)
    offset = keys - rows  # bottom-right's
    back = None if left is None else left - ahead  # the top-left window's sides
    forward = None if right is None else right + ahead

    def block(causal: bool, window: tuple[int, int] | None, alignment: str) -> Block:
        return Block(first_row, rows, start, keys, causal, window, alignment)

    if forward is None:  # nothing masked
        return block(False, None, "top_left")
    if forward in (0, offset):  # causal, top-left or bottom-right
        shift = 0 if forward == 0 else offset
        return block(True, None if back is None else (back + shift, 0),
                     "top_left" if forward == 0 else "bottom_right")
    if back is None or back >= 0:
        return block(False, (keys if back is None else back, forward), "top_left")
    return block(False, (back + offset, forward - offset), "bottom_right")


def sharded_attention(attention: Any, q: Any, k: Any, v: Any, segment_ids: tuple[Any, ...], *,
                      axis_name: Any, causal: bool, window: Any, load_balanced: bool) -> Any:
    """``attention(q, k, v, causal=, window=, alignment=, segment_ids=)`` (the wrapper, its
    other arguments bound) of this device's queries over the keys of every device of
    ``axis_name``, inside ``jax.shard_map``: ``q``, ``k``, ``v`` ``[batch, heads, length,
    head_dim]`` and ``segment_ids`` ``()`` or ``(q_ids, kv_ids)`` ``[batch, length]``, this
    device's shards."""
    import jax

    shards = jax.lax.axis_size(axis_name)
    balanced = load_balanced and shards > 1
    blocks = plan(shards, q.shape[2], causal=causal, window=window, load_balanced=balanced)
    if shards > 1:
        k, v = (_gathered(x, axis_name, 2, shards, balanced) for x in (k, v))
        if segment_ids:
            q_ids, kv_ids = segment_ids
            segment_ids = (q_ids, _gathered(kv_ids, axis_name, 1, shards, balanced))
    branches = [functools.partial(_calls, attention, device) for device in blocks]
    if len(set(blocks)) == 1:
        return branches[0](q, k, v, *segment_ids)
    return jax.lax.switch(jax.lax.axis_index(axis_name), branches, q, k, v, *segment_ids)


def _gathered(x: Any, axis_name: Any, axis: int, shards: int, balanced: bool) -> Any:
    """``x`` of every device along ``axis``, in sequence order (a load-balanced one
    reordered: chunk ``c < shards`` came from slot ``2c``, chunk ``2 * shards - 1 - d`` from
    slot ``2d + 1``)."""
    import jax
    import jax.numpy as jnp

    x = jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)
    if not balanced:
        return x
    half = x.shape[axis] // (2 * shards)
    slots = [2 * device for device in range(shards)] + [2 * device + 1
                                                       for device in reversed(range(shards))]
    return jnp.concatenate([jax.lax.slice_in_dim(x, slot * half, (slot + 1) * half, axis=axis)
                            for slot in slots], axis=axis)


def _calls(attention: Any, blocks: tuple[Block, ...], q: Any, k: Any, v: Any,
           *segment_ids: Any) -> Any:
    """One device's output: its blocks' calls, their outputs in its queries' order."""
    import jax.numpy as jnp

    outs = []
    for block in blocks:
        rows, keys = (block.first_row, block.rows), (block.start, block.keys)
        ids = [_part(x, 1, *part) for x, part in zip(segment_ids, (rows, keys))]
        outs.append(attention(_part(q, 2, *rows), _part(k, 2, *keys), _part(v, 2, *keys),
                              causal=block.causal, window=block.window,
                              alignment=block.alignment, segment_ids=ids or None))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)


def _part(x: Any, axis: int, start: int, size: int) -> Any:
    """``size`` entries of ``x`` from ``start`` along ``axis`` (``x`` itself when that is
    all of it)."""
    import jax

    if start == 0 and size == x.shape[axis]:
        return x
    return jax.lax.slice_in_dim(x, start, start + size, axis=axis)
