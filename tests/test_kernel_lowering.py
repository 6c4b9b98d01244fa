"""The kernels lower for TPU (Mosaic) on this CPU-only host: every config of a small problem's
search space, the discovered pipeline depths, the refusal of illegal configs, and one real
deviceless Mosaic compile for v5e."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import kernel
from kernel import ConfigError, FlashConfig, Problem
from kernel.backends.flash import pallas
from kernel.backends.flash.depths import pipeline_depth_lowers, supported_pipeline_depths
from kernel.backends.flash.rules import MAX_PROBED_DEPTH

FLASH = kernel.get_kernel("flash").discover()

PROBLEM = Problem(batch=1, q_heads=4, kv_heads=2, q_len=512, kv_len=512, head_dim=128,
                  dtype="bfloat16", causal=True)


def _specs(problem: Problem) -> list[jax.ShapeDtypeStruct]:
    dtype = jnp.dtype(problem.dtype)
    q = (problem.batch, problem.q_heads, problem.q_len, problem.head_dim)
    kv = (problem.batch, problem.kv_heads, problem.kv_len, problem.head_dim)
    return [jax.ShapeDtypeStruct(shape, dtype) for shape in (q, kv, kv)]


def _attention(problem: Problem, config: FlashConfig):
    """The forward pass, or all three gradients in ``fwd_bwd`` mode."""
    def attend(q, k, v):
        return kernel.flash_attention(q, k, v, causal=problem.causal, config=config)

    if problem.mode == "fwd":
        return attend
    return jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))


def _tpu_kernels(problem: Problem, config: FlashConfig) -> list[str]:
    """Names of the Mosaic kernels in the StableHLO exported for TPU."""
    exported = jax.export.export(jax.jit(_attention(problem, config)),
                                 platforms=["tpu"])(*_specs(problem))
    text = exported.mlir_module()
    assert text.count("@tpu_custom_call") == len(re.findall(r'kernel_name = "', text))
    return re.findall(r'kernel_name = "(\w+)"', text)


def _kernel_keys(config: FlashConfig) -> set[tuple]:
    """The fields each of the three kernels is built from."""
    return {("fwd", config.block_q, config.block_kv, config.block_kv_compute,
             config.pipeline_depth),
            ("dkv", config.block_q_dkv, config.block_kv_dkv),
            ("dq", config.block_q_dq, config.block_kv_dq, config.pipeline_depth)}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_every_forward_config_lowers_for_tpu(causal):
    problem = Problem(**{**PROBLEM.to_dict(), "causal": causal, "mode": "fwd"})
    configs = FLASH.search_space(problem, "v5e")
    assert len(configs) >= 30
    for config in configs:
        assert _tpu_kernels(problem, config) == ["flash_fwd"], config.label()


def test_every_kernel_of_the_fwd_bwd_space_lowers_for_tpu():
    """The fwd_bwd space is the product of three kernels' tiles; lowering a subset that
    contains every distinct tiling of each kernel covers all of it."""
    problem = Problem(**{**PROBLEM.to_dict(), "mode": "fwd_bwd"})
    space = FLASH.search_space(problem, "v5e")
    needed = set().union(*map(_kernel_keys, space))
    covered: set[tuple] = set()
    for config in space:
        if _kernel_keys(config) <= covered:
            continue
        covered |= _kernel_keys(config)
        assert sorted(_tpu_kernels(problem, config)) == [
            "flash_bwd_dkv", "flash_bwd_dq", "flash_fwd"], config.label()
    assert covered == needed


def test_default_config_compiles_with_mosaic_for_v5e():
    """A real deviceless compile (libtpu's Mosaic compiler) of forward and backward."""
    from kernel.aot import input_specs, topology_device

    problem = Problem(**{**PROBLEM.to_dict(), "mode": "fwd_bwd"})
    specs = input_specs(problem, topology_device("v5e"))
    config = FLASH.default_config(problem, "v5e")
    compiled = jax.jit(_attention(problem, config)).trace(*specs).lower().compile()
    assert "tpu_custom_call" in compiled.as_text()


@pytest.mark.parametrize("changes, rule", [
    ({"block_q": 384}, "[block_divides] block_q=384 does not divide q_len=512"),
    ({"block_kv": 1024}, "[block_max] block_kv=1024 is larger than kv_len=512"),
    ({"block_q": 64}, "[block_tiling] block_q=64"),
    ({"pipeline_depth": MAX_PROBED_DEPTH + 1}, f"[pipeline_depth] pipeline_depth="
                                                f"{MAX_PROBED_DEPTH + 1} is not supported"),
])
def test_illegal_config_is_refused_naming_the_rule(changes, rule):
    config = FlashConfig().replace(**changes)
    with pytest.raises(ConfigError) as error:
        jax.eval_shape(_attention(Problem(**{**PROBLEM.to_dict(), "mode": "fwd"}), config),
                       *_specs(PROBLEM))
    assert rule in str(error.value)


def test_backward_tiles_are_checked_when_differentiating():
    config = FlashConfig(block_q_dq=384)  # only the dQ kernel uses it
    forward = Problem(**{**PROBLEM.to_dict(), "mode": "fwd"})
    jax.eval_shape(_attention(forward, config), *_specs(PROBLEM))
    with pytest.raises(ConfigError, match=r"\[block_divides\] block_q_dq=384 does not divide"):
        jax.eval_shape(_attention(Problem(**{**PROBLEM.to_dict(), "mode": "fwd_bwd"}), config),
                       *_specs(PROBLEM))


def test_supported_pipeline_depths_are_exactly_those_that_lower():
    depths = supported_pipeline_depths()
    assert {1, 2} <= set(depths)
    assert depths == tuple(range(1, len(depths) + 1))
    assert all(pipeline_depth_lowers(depth) for depth in depths)
    if len(depths) < MAX_PROBED_DEPTH:
        assert not pipeline_depth_lowers(len(depths) + 1)
    problem = Problem(**{**PROBLEM.to_dict(), "mode": "fwd_bwd"})
    assert {c.pipeline_depth for c in FLASH.search_space(problem, "v5e")} == set(depths)


def test_depth_probe_lowers_for_real_inside_forced_interpret_mode():
    from jax.experimental.pallas import tpu as pltpu

    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        assert pipeline_depth_lowers(1)


@pytest.mark.parametrize("depth_ok", [True, False], ids=["supported", "first-unsupported"])
def test_kernels_buffer_kv_with_the_configured_depth(depth_ok):
    """The forward and dQ kernels really pass pipeline_depth to Mosaic: the first depth that
    discovery rejects makes both fail to lower (the config check is bypassed here)."""
    depth = max(supported_pipeline_depths()) + (0 if depth_ok else 1)
    config = FlashConfig(pipeline_depth=depth)
    q, k, v = _specs(PROBLEM)
    cols = jax.ShapeDtypeStruct((*q.shape[:3], pallas.STATS + 1), jnp.float32)
    calls = {
        "fwd": lambda q, k, v: pallas._forward(q, k, v, config, True, 0.1, save_stats=False)[0],
        "dq": lambda q, k, v, do, cols: pallas._backward_dq(q, k, v, do, cols, config, True,
                                                            0.1),
    }
    args = {"fwd": (q, k, v), "dq": (q, k, v, q, cols)}
    for name, call in calls.items():
        export = jax.export.export(jax.jit(call), platforms=["tpu"])
        if depth_ok:
            export(*args[name])
        else:
            with pytest.raises(Exception, match="buffering"):
                export(*args[name])
