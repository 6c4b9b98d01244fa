"""The flash kernels' in-kernel pipelines under TPU interpret mode's simulation of the chip:
DMAs that complete as soon as they start and signal their semaphores (``eager``), and memory
that starts as NaN. A copy still in flight when a kernel ends leaves its semaphore signalled
(the interpreter reports it at kernel exit), as it did on a TPU v5e at pipeline depth 4,
where it corrupted that kernel's results and every kernel's after it (pallas-facts §10); a
block read before it is written reads NaN. Forward and the three gradients against float64,
at every pipeline depth and for the pipelines of 1 to 4 steps that masks and GQA make."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from test_flash_features import BLOCKS_128, MIXED, TOLERANCE, _error, _flash, \
    _float64_reference, _inputs, _packed, _problem

from kernel.backends.flash import KERNEL, pallas
from kernel.backends.flash.config import FlashConfig

CHIP_LIKE = pltpu.InterpretParams(dma_execution_mode="eager", uninitialized_memory="nan")
LEAK = "non-zero count"  # the interpreter's words for a semaphore still signalled at kernel exit


def _depths(config: FlashConfig, depth: int) -> FlashConfig:
    return dataclasses.replace(config, pipeline_depth=depth, pipeline_depth_dkv=depth,
                               pipeline_depth_dq=depth)


CAUSAL_512 = _problem(q_len=512, kv_len=512, heads=(1, 1), causal=True)
CASES = [
    # causal, 128-blocks: each kernel's pipelines run 1, 2, 3 and 4 steps
    *(pytest.param(CAUSAL_512, _depths(BLOCKS_128, depth), (), id=f"causal-depth{depth}")
      for depth in (1, 2, 3, 4)),
    # GQA: dK/dV's pipeline walks (query head of the group, query block)
    pytest.param(_problem(q_len=256, kv_len=256, heads=(2, 1), causal=True),
                 _depths(BLOCKS_128, 4), (), id="gqa-causal-depth4"),
    pytest.param(_problem(q_len=512, kv_len=512, heads=(1, 1), causal=True, window=(128, 0)),
                 _depths(BLOCKS_128, 4), (), id="window-depth4"),
    pytest.param(_problem(q_len=512, kv_len=256, heads=(1, 1), causal=True, window=(50, 0),
                          softcap=5.0), _depths(MIXED, 4), (), id="rows-seeing-no-key-depth4"),
    pytest.param(_problem(q_len=256, kv_len=256, heads=(2, 2), causal=True, window=(0, 0)),
                 _depths(MIXED, 3), (), id="own-key-only-depth3"),
    pytest.param(_problem(q_len=256, kv_len=256, heads=(1, 1), causal=True, segmented=True),
                 _depths(BLOCKS_128, 4), (_packed([[100, 156]]),) * 2, id="segments-depth4"),
]


@pytest.mark.parametrize("problem, config, segment_ids", CASES)
def test_no_copy_in_flight_at_exit_and_no_block_read_before_written(problem, config,
                                                                    segment_ids, capfd):
    assert not KERNEL.violations(problem, config, "v5e")
    inputs = _inputs(problem)
    with pltpu.force_tpu_interpret_mode(CHIP_LIKE):
        out, grads = _flash(problem, config, 0.125, *inputs, segment_ids)
    report = capfd.readouterr().out
    assert LEAK not in report, report
    want, want_grads = _float64_reference(problem, 0.125, *inputs, segment_ids)
    for name, got, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads)):
        error = _error(got, expected, want)
        assert error <= TOLERANCE, f"{name}: relative error {error:.3g} > {TOLERANCE}"


# stream_ahead (the backward kernels' pipeline): a probe kernel on a (1, 1, STEPS) grid whose
# step o streams 1 + 2o mod 3 blocks (runs of 1 to 3: shorter than a depth-4 pipeline's
# lookahead), block (o, t) of the source holding the value 3 o + t.
STEPS, ROWS = 6, 8


def _stream_ahead_probe(depth: int):
    """(the block each body call got, at its (o, t) place; the ring slot each grid step
    leaves for the next, read as that step ends)."""
    size = (3 * STEPS * ROWS, 128)

    def kernel(x_hbm, seen_ref, next_ref, *ring):
        o = pl.program_id(2)

        def body(t, tile):
            seen_ref[pl.ds(pl.multiple_of((3 * o + t) * ROWS, ROWS), ROWS), :] = tile[...]

        pallas.stream_ahead(body, lambda outer, t: [pallas.window(x_hbm, 0, (3 * outer + t)
                                                                   * ROWS, ROWS)],
                            lambda outer: 1 + pallas._rem(2 * outer, 3), ring, depth)
        buffer, _, next_slot = ring
        next_ref[pl.ds(pl.multiple_of(o * ROWS, ROWS), ROWS), :] = buffer[next_slot[0]]

    whole = pl.BlockSpec(memory_space=pltpu.VMEM)
    call = pl.pallas_call(
        kernel, grid=(1, 1, STEPS), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(size, jnp.float32),
                   jax.ShapeDtypeStruct((STEPS * ROWS, 128), jnp.float32)],
        scratch_shapes=pallas.ring_scratch([((ROWS, 128), jnp.float32)], depth),
        compiler_params=pltpu.CompilerParams(dimension_semantics=pallas.STREAMS_AHEAD))
    x = jnp.repeat(jnp.arange(3 * STEPS, dtype=jnp.float32), ROWS * 128).reshape(size)
    seen, next_block = call(x)
    return seen[::ROWS, 0], next_block[::ROWS, 0]


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_stream_ahead_hands_each_block_in_order_and_leaves_no_copy_in_flight(depth, capfd):
    with pltpu.force_tpu_interpret_mode(CHIP_LIKE):
        seen, _ = _stream_ahead_probe(depth)
    assert LEAK not in capfd.readouterr().out
    for o in range(STEPS):
        run = [3 * o + t for t in range(1 + 2 * o % 3)]
        assert seen[np.array(run)].tolist() == run, (o, seen)


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_stream_ahead_fetches_the_next_grid_steps_first_block_during_this_one(depth):
    """Lead (d) of issue 61: the first fetch of grid step o + 1 overlaps step o's compute; it
    has landed in its ring slot (eager DMAs) before o ends."""
    with pltpu.force_tpu_interpret_mode(CHIP_LIKE):
        _, next_block = _stream_ahead_probe(depth)
    assert next_block[:-1].tolist() == [3 * (o + 1) for o in range(STEPS - 1)]


@pytest.mark.parametrize("segmented", [False, True])
def test_the_forward_streams_its_kv_blocks_ahead_across_grid_steps(segmented, monkeypatch):
    """Lead (d) of issue 61, the forward: its K/V (and kv segment ids) stream through
    stream_ahead (the test above: the next grid step's first blocks are fetched during this
    one), not through a pipeline started cold at each grid step."""
    rings = []

    def recording(body, windows, count, ring, depth):
        rings.append([tuple(buffer.shape) for buffer in ring[:-2]])
        real(body, windows, count, ring, depth)

    real = pallas.stream_ahead
    monkeypatch.setattr(pallas, "stream_ahead", recording)
    problem = dataclasses.replace(_problem(q_len=512, kv_len=512, heads=(2, 1), causal=True,
                                           segmented=segmented), mode="fwd")
    config = dataclasses.replace(MIXED, pipeline_depth=3)
    attend = KERNEL.attention(problem, lambda mode: config, 0.125)
    q, k, v, _ = _inputs(problem)
    ids = (_packed([[200, 312]]),) * 2 if segmented else ()
    jax.eval_shape(attend, q, k, v, *ids)
    kv_blocks = [(3, 256, 64)] * 2 + [(3, 8, 256)] * segmented
    assert rings and all(ring == kv_blocks for ring in rings), rings
