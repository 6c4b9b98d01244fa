"""The flash kernel's fused backward (issue 74, ``FlashConfig.fused_bwd``): the dK/dV kernel
computes dQ too, summing it over its kv blocks in a VMEM accumulator of the whole sequence;
the dQ kernel does not run.

Its numerics against float64 in TPU interpret mode, with memory that starts as NaN (an
accumulator not zeroed, or a query block no kv block sees left unwritten, would show) and
DMAs run only when waited on; its rules (dQ fields None exactly when fused, the VMEM of the
resident dQ), the space and seeds, old configs loading unfused; the real deviceless Mosaic
compile for v5e under the estimate.
"""

from __future__ import annotations

import dataclasses
import json
import random

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_flash_features import (
    BLOCKS_128,
    MIXED,
    PACKED_384,
    TOLERANCE,
    _error,
    _flash,
    _float64_reference,
    _inputs,
    _problem,
)
from test_flash_pipeline import LEAK, _depths

from autotune.precheck import candidates
from autotune.tune import kernel_space
from kernel import FlashConfig, Problem, get_target
from kernel.backends.flash import KERNEL
from kernel.backends.flash.blocks import block_counts
from kernel.backends.flash.config import DQ_FIELDS
from kernel.backends.flash.rules import vmem_estimate
from kernel.rules import tile_bytes

ON_WAIT = pltpu.InterpretParams(dma_execution_mode="on_wait", uninitialized_memory="nan")

CASES = [
    # two kv blocks of dK/dV, each adding to every query's dQ
    pytest.param(_problem(q_len=256, kv_len=256), MIXED.fused(), 0.125, (), id="full-gqa"),
    # kv blocks past the causal diagonal see no query: they add nothing
    pytest.param(_problem(q_len=256, kv_len=512, causal=True), _depths(BLOCKS_128, 4).fused(),
                 0.125, (), id="causal-q<kv-depth4"),
    pytest.param(_problem(q_len=256, kv_len=512, window=(100, 60)), MIXED.fused(), 0.125, (),
                 id="window-L,R-full-q<kv"),
    pytest.param(_problem(q_len=256, kv_len=256, heads=(4, 1), softcap=3.0), MIXED.fused(), 1.0,
                 (), id="softcap-mqa"),
    pytest.param(_problem(batch=2, causal=True, segmented=True), _depths(BLOCKS_128, 1).fused(),
                 0.125, (PACKED_384, PACKED_384), id="segments-causal-gqa-padding-depth1"),
    # queries no kv block sees: zeros; a run's clamped step no query sees adds nothing
    pytest.param(_problem(q_len=512, kv_len=256, causal=True, window=(50, 0), softcap=5.0),
                 _depths(MIXED, 3).fused(), 0.5, (), id="rows-seeing-no-key-depth3"),
]


@pytest.mark.parametrize("problem, config, sm_scale, segment_ids", CASES)
def test_fused_backward_matches_float64(problem, config, sm_scale, segment_ids, capfd):
    assert not KERNEL.violations(problem, config, "v5e")
    inputs = _inputs(problem)
    with pltpu.force_tpu_interpret_mode(ON_WAIT):
        out, grads = _flash(problem, config, sm_scale, *inputs, segment_ids)
    assert LEAK not in capfd.readouterr().out
    want, want_grads = _float64_reference(problem, sm_scale, *inputs, segment_ids)
    for name, got, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads)):
        error = _error(got, expected, want)
        assert error <= TOLERANCE, f"{name}: relative error {error:.3g} > {TOLERANCE}"


def test_fused_runs_no_dq_kernel():
    problem = _problem(q_len=256, kv_len=512)
    q, k, v, d_out = _inputs(problem)
    attend = KERNEL.attention(problem, lambda mode: MIXED.fused(), 0.125)
    text = str(jax.make_jaxpr(lambda *args: jax.vjp(attend, *args)[1](d_out))(q, k, v))
    assert "flash_bwd_dkv" in text and "flash_bwd_dq" not in text
    assert set(block_counts(problem, MIXED.fused())) == {"fwd", "dkv"}


# --- rules, space, seeds, stored configs ----------------------------------------------------

PROBLEM = Problem(8, 16, 16, 2048, 2048, 128, "bfloat16", False, "fwd_bwd")


def test_dq_fields_are_none_exactly_when_fused():
    default = KERNEL.default_config(PROBLEM, "v5e")
    assert not default.fused_bwd  # the tuner decides; the default stays unfused
    assert not KERNEL.violations(PROBLEM, default.fused(), "v5e")
    assert "fused" in default.fused().label() and "dq" not in default.fused().label()
    for config in (default.replace(fused_bwd=True), default.replace(block_kv_dq=None),
                   default.fused().replace(pipeline_depth_dq=2)):
        assert [v.rule for v in KERNEL.violations(PROBLEM, config, "v5e")] == ["dq_unused"]
    # a dQ block that would be illegal is not checked where no dQ kernel runs
    forward = dataclasses.replace(PROBLEM, mode="fwd")
    assert not KERNEL.violations(forward, default.fused(), "v5e")


def test_a_config_stored_before_the_flag_loads_unfused_and_a_fused_one_round_trips():
    stored = {k: v for k, v in FlashConfig().to_dict().items() if k != "fused_bwd"}
    old = KERNEL.config_from_dict(stored)
    assert old == FlashConfig() and not old.fused_bwd
    assert not KERNEL.stored_violations(PROBLEM, old)
    fused = KERNEL.default_config(PROBLEM, "v5e").fused()
    loaded = KERNEL.config_from_dict(json.loads(json.dumps(fused.to_dict())))
    assert loaded == fused and all(getattr(loaded, f) is None for f in DQ_FIELDS)
    assert not KERNEL.stored_violations(PROBLEM, loaded)


def test_the_space_draws_fused_as_a_flag_and_never_its_unused_dq_fields():
    params = KERNEL.space_params(PROBLEM)
    assert params["fused_bwd"] == [False, True]
    assert all(params[f][0] is None for f in DQ_FIELDS)
    assert "fused_bwd" not in KERNEL.space_params(dataclasses.replace(PROBLEM, mode="fwd"))
    space, _ = kernel_space(KERNEL, PROBLEM, get_target("v5e"))
    rng, taken = random.Random(0), set()
    draws = [space.random_legal(rng, taken) for _ in range(100)]
    assert 0.3 < sum(d["fused_bwd"] for d in draws) / len(draws) < 0.7
    fused = next(d for d in draws if d["fused_bwd"])
    assert all(fused[f] is None for f in DQ_FIELDS)
    # the dQ fields drawn under the flag are one config, measured once
    assert space.key({**fused, "block_q_dq": 512, "block_kv_dq": 256}) == space.key(fused)
    assert all(n["fused_bwd"] != fused["fused_bwd"] or n["block_q_dq"] is None
               for n in space.neighbours(fused))


def test_the_seeds_are_the_uniform_blocks_unfused_and_fused():
    seeds = KERNEL.seed_configs(PROBLEM, "v5e")
    default = KERNEL.default_config(PROBLEM, "v5e")
    fused = [s for s in seeds if s.fused_bwd]
    assert default.fused() in fused
    assert {s.fused() for s in seeds if not s.fused_bwd
            if KERNEL.is_legal(PROBLEM, s.fused(), "v5e")} <= set(fused)
    assert all(KERNEL.is_legal(PROBLEM, s, "v5e") for s in fused)
    assert not any(s.fused_bwd for s in KERNEL.seed_configs(dataclasses.replace(
        PROBLEM, mode="fwd"), "v5e"))


def test_the_estimate_counts_the_resident_dq_and_drops_the_dq_kernel():
    config = KERNEL.default_config(PROBLEM, "v5e")
    unfused, fused = vmem_estimate(PROBLEM, config), vmem_estimate(PROBLEM, config.fused())
    assert set(unfused) == {"fwd", "dkv", "dq"} and set(fused) == {"fwd", "dkv"}
    d, rows = PROBLEM.head_dim, PROBLEM.q_len  # bf16 output block, double buffered; f32 sum
    resident = 2 * tile_bytes(rows, d, 2) + tile_bytes(rows, d, 4)
    assert fused["dkv"] - unfused["dkv"] > resident


def test_a_resident_dq_the_scoped_vmem_cannot_hold_is_refused():
    """The group's dQ of the whole sequence: at 16k queries, 4 query heads per kv head and
    d128, 16 MiB of f32 alone, over v5e's scoped 16 MiB at any dK/dV tiling; unfused, the
    same problem runs."""
    long = Problem(1, 32, 8, 16384, 16384, 128, "bfloat16", True, "fwd_bwd")
    default = KERNEL.default_config(long, "v5e")
    assert not KERNEL.violations(long, default, "v5e")
    for block in (128, 512):
        fused = default.replace(block_q_dkv=block, block_kv_dkv=block).fused()
        broken = KERNEL.violations(long, fused, "v5e")
        assert [v.rule for v in broken] == ["vmem"] and "dkv" in broken[0].message
    assert not KERNEL.stored_violations(long, default.fused())  # a CPU has no VMEM limit


def test_precheck_compiles_the_fused_kernel_at_every_dkv_tiling():
    """The flag is in dK/dV's compile part (it changes that kernel), and the dQ fields it
    leaves unused are made None: every dK/dV tiling is compiled fused too."""
    problem = Problem(1, 2, 1, 512, 512, 128, "bfloat16", True, "fwd_bwd")
    configs = [c.config for c in candidates(problem, get_target("v5e"), KERNEL.discover())]
    fused = {(c.block_q_dkv, c.block_kv_dkv, c.pipeline_depth_dkv) for c in configs
             if c.fused_bwd}
    unfused = {(c.block_q_dkv, c.block_kv_dkv, c.pipeline_depth_dkv) for c in configs
               if not c.fused_bwd}
    assert fused == unfused and len(fused) > 1


# --- Mosaic ---------------------------------------------------------------------------------

@pytest.mark.parametrize("problem", [
    Problem(1, 2, 1, 2048, 2048, 128, "bfloat16", False, "fwd_bwd"),
    Problem(1, 2, 2, 1024, 1024, 64, "float32", True, "fwd_bwd", window=(300, 0),
            segmented=True),
], ids=["full-gqa-bf16-d128", "causal-window-segments-f32-d64"])
def test_fused_kernels_compile_for_v5e_within_the_estimate(problem):
    """A real deviceless compile (libtpu's Mosaic) of the fused dK/dV kernel, its dQ rows
    at traced places, under a scoped VMEM limit of the estimate."""
    from kernel.aot import topology_device
    from kernel.contract import input_specs

    config = KERNEL.default_config(problem, "v5e").fused()
    estimate = vmem_estimate(problem, config)
    attend = KERNEL.attention(problem, lambda mode: config, 0.1)
    grads = jax.grad(lambda *args: attend(*args).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    compiled = jax.jit(grads).trace(*input_specs(problem, topology_device("v5e"))).lower().compile(
        {"xla_tpu_scoped_vmem_limit_kib": -(-max(estimate.values()) // 1024)})
    text = compiled.as_text()
    assert "flash_bwd_dkv" in text and "flash_bwd_dq" not in text
