"""The flash kernels' in-kernel pipelines under TPU interpret mode's simulation of the chip:
DMAs that complete as soon as they start and signal their semaphores (``eager``), and memory
that starts as NaN. A copy still in flight when a kernel ends leaves its semaphore signalled
(the interpreter reports it at kernel exit), as it did on a TPU v5e at pipeline depth 4,
where it corrupted that kernel's results and every kernel's after it (pallas-facts §10); a
block read before it is written reads NaN. Forward and the three gradients against float64,
at every pipeline depth and for the pipelines of 1 to 4 steps that masks and GQA make."""

from __future__ import annotations

import dataclasses

import pytest
from jax.experimental.pallas import tpu as pltpu

from test_flash_features import BLOCKS_128, MIXED, TOLERANCE, _error, _flash, \
    _float64_reference, _inputs, _packed, _problem

from kernel.backends.flash import KERNEL
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
