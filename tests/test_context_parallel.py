"""Context parallelism (``kernel.context_parallel_attention``): a sequence sharded over a mesh
axis inside ``jax.shard_map`` attends as the unsharded call does, forward and backward, each
device resolving its own problem; on one device it is the plain call.

The multi-device cases run on forced CPU devices in a fresh process (tests/test_sharded.py's
``_run``), the TPU kernels in interpret mode.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import kernel
from kernel.context_parallel import Block, plan
from tests.test_sharded import _run

WINDOWS = (None, (0, 0), (3, 0), (5, 2), (2, 7), (13, 1), (40, 40))


def _seen(rows: int, keys: int, causal: bool, window: tuple[int, int] | None,
          first: int = 0) -> np.ndarray:
    """flash_attention's mask as its docstring states it: query i, at position p = first + i,
    sees key j when j <= p (causal) and p - left <= j <= p + right (window, right 0 when
    causal)."""
    position, key = first + np.arange(rows)[:, None], np.arange(keys)[None, :]
    seen = (key <= position) | (not causal)
    if window is not None:
        seen &= (key >= position - window[0]) & (key <= position + (0 if causal else window[1]))
    return seen


def _block_mask(block: Block, seq_len: int) -> np.ndarray:
    """The keys of the whole sequence that a block's call sees."""
    first = block.keys - block.rows if block.alignment == "bottom_right" else 0
    seen = np.zeros((block.rows, seq_len), bool)
    seen[:, block.start:block.start + block.keys] = _seen(block.rows, block.keys, block.causal,
                                                          block.window, first)
    return seen


@pytest.mark.parametrize("load_balanced", [False, True])
def test_every_devices_calls_see_exactly_the_keys_of_its_queries(load_balanced: bool) -> None:
    """The plan, for 1 to 5 devices, every mask: each call's queries, under the static mask
    it passes flash_attention over its slice of keys, see what the global mask gives their
    global positions (load-balanced: the positions load_balanced_order puts there), with
    windows of non-negative sides, and every call of every device over as many keys."""
    for shards, length, causal, window in itertools.product(range(1, 6), (4, 6), (False, True),
                                                            WINDOWS):
        seq_len = shards * length
        order = (kernel.load_balanced_order(shards, seq_len) if load_balanced
                 else list(range(seq_len)))
        wanted = _seen(seq_len, seq_len, causal, window)
        devices = plan(shards, length, causal=causal, window=window,
                       load_balanced=load_balanced)
        assert len({block.keys for blocks in devices for block in blocks}) == 1
        for device, blocks in enumerate(devices):
            for block in blocks:
                first = device * length + block.first_row
                positions = order[first:first + block.rows]
                assert block.window is None or min(block.window) >= 0, block
                assert (_block_mask(block, seq_len) == wanted[positions]).all(), (
                    shards, length, causal, window, device, block)


def test_one_device_is_the_plain_call() -> None:
    """On a mesh axis of one device (load-balanced or not), the step's program is the plain
    call's: no gather, no switch, the same problem."""
    mesh = jax.make_mesh((1,), ("seq",))
    spec = P(None, None, "seq")
    shape = jax.ShapeDtypeStruct((1, 2, 128, 64), jnp.float32, sharding=NamedSharding(mesh, spec))

    def program(attention):
        sharded = jax.shard_map(attention, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        step = jax.grad(lambda q, k, v: jnp.sum(sharded(q, k, v) ** 2), argnums=(0, 1, 2))
        return str(jax.make_jaxpr(step)(shape, shape, shape))

    options = {"causal": True, "window": (48, 0)}
    plain = program(lambda q, k, v: kernel.flash_attention(q, k, v, **options))
    assert plain == program(lambda q, k, v: kernel.context_parallel_attention(
        q, k, v, axis_name="seq", load_balanced=True, **options))


def test_bad_calls_raise_naming_the_fix() -> None:
    q = jnp.zeros((1, 2, 128, 64), jnp.float32)
    with pytest.raises(ValueError, match="inside jax.shard_map over a mesh axis 'seq'"):
        kernel.context_parallel_attention(q, q, q, axis_name="seq")
    mesh = jax.make_mesh((1,), ("seq",))

    spec = P(None, None, "seq")
    short, long = (jax.ShapeDtypeStruct((1, 2, seq, 64), jnp.float32,
                                        sharding=NamedSharding(mesh, spec)) for seq in (64, 128))
    attend = jax.shard_map(lambda q, k: kernel.context_parallel_attention(q, k, k,
                                                                          axis_name="seq"),
                           mesh=mesh, in_specs=(spec, spec), out_specs=spec)
    with pytest.raises(ValueError, match="q holds 64 positions per device but k and v 128"):
        jax.eval_shape(attend, short, long)
    with pytest.raises(ValueError, match="pad the sequence to a multiple of 4"):
        kernel.load_balanced_order(2, 130)


def test_masks_match_the_unsharded_call_forward_and_backward() -> None:
    """On 4 forced CPU devices, grouped-query heads: causal over a sequence sharded over 4
    devices under plain jax.jit (the wrapper runs context parallelism itself; the middle two
    devices as windows over every key, the last bottom-right), and on a 2 x 2 mesh in the
    model's shard_map as MaxText's (check_vma=False; batch and sequence sharded together) a
    load-balanced sequence under a two-sided (non-causal) sliding window with segment ids,
    whose calls take both alignments. Outputs and dQ, dK, dV match the unsharded call; the
    problems captured for the causal step are each device's."""
    out = _run(4, """
        import numpy as np
        q, k, v = arrays(2, 4, 2, 256, 32)
        ids = jnp.concatenate([jnp.zeros((2, 100), jnp.int32), jnp.ones((2, 156), jnp.int32)], 1)

        def with_grads(attention):
            def run(q, k, v, ids):
                out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, ids), q, k, v)
                return out, vjp(out)
            return jax.jit(run)

        def sharded(mesh, batch, own_shard_map, segments=False, **options):
            specs = (P(batch, None, "seq"),) * 3 + (P(batch, "seq"),)
            segment_ids = lambda ids: (ids, ids) if segments else None
            if own_shard_map:  # MaxText's style: the attention op in the model's shard_map
                attend = jax.shard_map(lambda q, k, v, ids: kernel.context_parallel_attention(
                    q, k, v, axis_name="seq", segment_ids=segment_ids(ids), **options),
                    mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)
            else:  # plain jit over sharded inputs: the wrapper's own shard_map
                attend = lambda q, k, v, ids: kernel.flash_attention(
                    q, k, v, segment_ids=segment_ids(ids), **options)
            run = with_grads(attend)
            return lambda *args: run(*(jax.device_put(x, NamedSharding(mesh, spec))
                                       for x, spec in zip(args, specs)))

        def plain(segments=False, **options):
            return with_grads(lambda q, k, v, ids: kernel.flash_attention(
                q, k, v, segment_ids=(ids, ids) if segments else None, **options))(q, k, v, ids)

        seq = jax.make_mesh((4,), ("seq",))
        both = jax.make_mesh((2, 2), ("data", "seq"))
        window = {"window": (40, 24), "segments": True}
        cases = {"causal": (seq, None, False, {"causal": True}, plain(causal=True)),
                 "load-balanced window": (both, "data", True, {**window, "load_balanced": True},
                                          plain(**window))}
        errors = {}
        for name, (mesh, batch, own, options, (want, want_grads)) in cases.items():
            order = np.arange(256)
            if options.get("load_balanced"):
                order = np.asarray(kernel.load_balanced_order(2, 256))
            got, grads = sharded(mesh, batch, own, **options)(
                *(x[:, :, order] for x in (q, k, v)), ids[:, order])
            errors[name] = [largest_error(np.asarray(g)[:, :, np.argsort(order)], w)
                            for g, w in zip((got, *grads), (want, *want_grads))]
        spec = NamedSharding(seq, P(None, None, "seq"))
        step = jax.grad(lambda q, k, v: jnp.sum(kernel.flash_attention(q, k, v, causal=True)))
        with kernel.capture() as captured:
            jax.eval_shape(step, *(jax.device_put(x, spec) for x in (q, k, v)))
        print(json.dumps({"errors": errors, "captured": [p.label() for p in captured]}))
    """)
    assert len(out["errors"]) == 2
    for name, errors in out["errors"].items():
        assert max(errors) < 1e-5, (name, errors)
    local = "b2 h4/2 q64 kv256 d32 float32 {} fwd_bwd"
    assert sorted(out["captured"]) == sorted(local.format(mask) for mask in (
        "causal", "full window256,64", "full window256,128", "causal bottom-right"))
