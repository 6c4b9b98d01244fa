"""The kernels lower for TPU (Mosaic) on this CPU-only host: every config of a small problem's
search space, the discovered pipeline depths, the refusal of illegal configs, and one real
deviceless Mosaic compile for v5e."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import kernel
from kernel import ConfigError, FlashConfig, Problem
from kernel.backends.flash import pallas
from kernel.backends.flash.blocks import Reach
from kernel.backends.flash.depths import pipeline_depth_lowers, supported_pipeline_depths
from kernel.backends.flash.config import DEPTH_FIELDS
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
        return kernel.flash_attention(q, k, v, causal=problem.causal, config=config,
                                      alignment=problem.alignment)

    if problem.mode == "fwd":
        return attend
    return jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))


# The kernels of a gradient, by fused_bwd.
_KERNELS = {False: ["flash_bwd_dkv", "flash_bwd_dq", "flash_fwd"],
            True: ["flash_bwd_dkv", "flash_fwd"]}


def _tpu_kernels(problem: Problem, config: FlashConfig) -> list[str]:
    """Names of the Mosaic kernels in the StableHLO exported for TPU."""
    exported = jax.export.export(jax.jit(_attention(problem, config)),
                                 platforms=["tpu"])(*_specs(problem))
    text = exported.mlir_module()
    assert text.count("@tpu_custom_call") == len(re.findall(r'kernel_name = "', text))
    return re.findall(r'kernel_name = "(\w+)"', text)


def _kernel_keys(config: FlashConfig) -> set[tuple]:
    """The fields each of the three kernels is built from."""
    return {(fields[0], *(getattr(config, f) for f in fields)) for fields in FLASH.compile_parts}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_every_forward_config_lowers_for_tpu(causal):
    problem = Problem(**{**PROBLEM.to_dict(), "causal": causal, "mode": "fwd"})
    # every depth with the causal mask; the full one's tilings at depth 2
    configs = (FLASH if causal else dataclasses.replace(FLASH, depths=(2,))).search_space(
        problem, "v5e")
    assert len(configs) >= (60 if causal else 15)
    for config in configs:
        assert _tpu_kernels(problem, config) == ["flash_fwd"], config.label()


def test_every_kernel_of_the_fwd_bwd_space_lowers_for_tpu():
    """The fwd_bwd space is the product of three kernels' tiles; lowering a subset that
    contains every distinct tiling of each kernel covers all of it. Every tiling at depth 2,
    and every depth at the default tiles (a depth changes only the buffer count of the
    pipelines: test_each_kernel_buffers_its_streamed_operands_with_its_own_depth). A fused
    config (``fused_bwd``) runs no dQ kernel: its dK/dV kernel computes dQ too."""
    problem = Problem(**{**PROBLEM.to_dict(), "mode": "fwd_bwd"})
    default = FLASH.default_config(problem, "v5e")
    space = dataclasses.replace(FLASH, depths=(2,)).search_space(problem, "v5e") + [
        default.replace(**dict.fromkeys(DEPTH_FIELDS, depth)) for depth in FLASH.depths]
    needed = set().union(*map(_kernel_keys, space))
    covered: set[tuple] = set()
    for config in space:
        if _kernel_keys(config) <= covered:
            continue
        covered |= _kernel_keys(config)
        assert sorted(_tpu_kernels(problem, config)) == _KERNELS[config.fused_bwd], config.label()
    assert covered == needed
    assert {key[-1] for key in needed if key[0] == "block_q_dkv"} == {False, True}  # fused


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("depth", [1, MAX_PROBED_DEPTH])
def test_every_kernel_lowers_for_tpu_under_x64(depth, fused):
    """jax_enable_x64 makes a Python int index int64: the in-kernel DMAs' semaphore indices
    must stay int32 beside the grid's, or Mosaic rejects the kernel (the fused backward's
    copies of its dQ partials too)."""
    problem = Problem(**{**PROBLEM.to_dict(), "mode": "fwd_bwd"})
    config = FLASH.default_config(problem, "v5e").replace(
        **dict.fromkeys(DEPTH_FIELDS, depth))
    config = config.fused() if fused else config
    with jax.enable_x64(True):
        assert sorted(_tpu_kernels(problem, config)) == _KERNELS[fused]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_default_config_compiles_with_mosaic_for_v5e(head_dim):
    """A real deviceless compile (libtpu's Mosaic compiler) of forward and backward, at a
    length where the default's blocks are full size (its backward tiles as large as the
    forward's). Its kernels are the instructions ``profile`` timing counts on a TPU, one per
    declared name (on a GPU, Triton's are all ``pallas_call.N``: see tests/data/h200_traces)."""
    from autotune.timing import kernel_op_matcher, op_names
    from kernel.aot import topology_device
    from kernel.contract import input_specs

    problem = Problem(**{**PROBLEM.to_dict(), "mode": "fwd_bwd", "q_len": 4096,
                         "kv_len": 4096, "head_dim": head_dim})
    specs = input_specs(problem, topology_device("v5e"))
    config = FLASH.default_config(problem, "v5e")
    compiled = jax.jit(_attention(problem, config)).trace(*specs).lower().compile()
    assert "tpu_custom_call" in compiled.as_text()
    counts = kernel_op_matcher((), FLASH.profile_names)
    counted = [op.split(".")[0] for op in op_names(compiled) if counts(op)]
    assert sorted(counted) == sorted(FLASH.profile_names)


@pytest.mark.parametrize("q_len, kv_len", [(200, 200), (136, 520), (384, 200)])
@pytest.mark.parametrize("dtype, causal, features", [
    ("float32", True, "plain"),  # the kernel test files' case that failed on a TPU v5e
    ("bfloat16", False, "window"),
    ("bfloat16", True, "segments"),
])
def test_lengths_off_the_lane_tile_compile_with_mosaic_for_v5e(q_len, kv_len, dtype, causal,
                                                               features):
    """A sequence not a multiple of 128 gets one block as long as the axis (``block_tiling``),
    which the kernels' hand-made DMAs of its K/V, statistics rows and segment ids take at a
    traced offset: they compile (a real deviceless compile: Mosaic rejected such lane offsets,
    which it cannot prove multiples of 128, on a TPU v5e; interpret mode does not check them).
    ``bench/kernels/unaligned_compile.py`` runs the whole sweep."""
    from bench.kernels.unaligned_compile import FEATURES, compiles

    problem = Problem(**{**PROBLEM.to_dict(), "mode": "fwd_bwd", "q_len": q_len,
                         "kv_len": kv_len, "dtype": dtype, "causal": causal,
                         "segmented": features == "segments",
                         "window": FEATURES[features].get("window")})
    assert compiles(problem, FEATURES[features]) is None


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
    assert {c.pipeline_depth for c in FLASH.search_space(PROBLEM, "v5e")} == set(depths)
    params = FLASH.space_params(Problem(**{**PROBLEM.to_dict(), "mode": "fwd_bwd"}))
    # the dQ kernel's depth is None too where the fused backward leaves it unused
    assert all([d for d in params[field] if d is not None] == list(depths)
               for field in DEPTH_FIELDS)


def test_depth_probe_lowers_for_real_inside_forced_interpret_mode():
    from jax.experimental.pallas import tpu as pltpu

    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        assert pipeline_depth_lowers(1)


def _traced_kernels(config: FlashConfig) -> dict[str, str]:
    """The jaxpr (text) of each kernel traced with ``config`` for PROBLEM (causal, unsegmented)."""
    q, k, v = _specs(PROBLEM)
    row = jax.ShapeDtypeStruct((*q.shape[:2], 1, q.shape[2]), jnp.float32)  # lse, delta
    logits = pallas.Logits(0.1, Reach.of(PROBLEM))
    calls = {
        "fwd": (lambda q, k, v: pallas._forward(q, k, v, None, config, logits, False)[0],
                (q, k, v)),
        "dkv": (lambda q, k, v, do, lse, delta: pallas._backward_dkv(
            q, k, v, do, lse, delta, None, config, logits), (q, k, v, q, row, row)),
        "dq": (lambda q, k, v, do, lse, delta: pallas._backward_dq(
            q, k, v, do, lse, delta, None, config, logits), (q, k, v, q, row, row)),
    }
    return {name: str(jax.make_jaxpr(call)(*args)) for name, (call, args) in calls.items()}


@pytest.mark.parametrize("depth", range(1, MAX_PROBED_DEPTH + 1))
def test_each_kernel_buffers_its_streamed_operands_with_its_own_depth(depth):
    """Every streamed operand gets ``depth`` VMEM buffers of its block in its kernel's pipeline
    (K, V in fwd and dq; Q, dO and the per-query statistics in dkv), and only its kernel's depth
    field sets it."""
    others = 1 if depth != 1 else 2
    configs = {field: FlashConfig(block_q=256, block_kv=128, block_q_dkv=128, block_kv_dkv=256,
                                  block_q_dq=128, block_kv_dq=256).replace(
        **{**dict.fromkeys(DEPTH_FIELDS, others), field: depth}) for field in DEPTH_FIELDS}
    d = PROBLEM.head_dim
    buffers = {"fwd": [f"bf16[{depth},128,{d}]"] * 2,
               "dkv": [f"bf16[{depth},128,{d}]"] * 2 + [f"f32[{depth},1,128]"],
               "dq": [f"bf16[{depth},256,{d}]"] * 2}
    for field, name in zip(DEPTH_FIELDS, ("fwd", "dkv", "dq"), strict=True):
        traced = _traced_kernels(configs[field])
        for kernel_name, text in traced.items():
            found = set(re.findall(r"\w+\[\d+,\d+,\d+\]", text))
            if kernel_name == name:
                assert set(buffers[name]) <= found, (name, found)
            else:  # the other kernels keep their own depth
                assert not any(b.startswith(tuple(f"{t}[{depth}," for t in ("bf16", "f32")))
                               for b in found), (field, kernel_name, found)


# Issue 61: what each kernel computes per logit and how the statistics travel (a chip-only
# cost: interpret mode runs either way).
SHAPED = FlashConfig(block_q=256, block_kv=256, block_kv_compute=256, block_q_dkv=256,
                     block_kv_dkv=512, block_q_dq=256, block_kv_dq=512)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_backward_statistics_travel_as_rows_not_lane_padded_columns(dtype):
    """The forward's statistics (bf16: the logsumexp, [batch, heads, 1, q_len]; float32, issue
    74: m and 1 / l, [batch, heads, 2, q_len]) and delta ([batch, heads, 1, q_len]) reach the
    backward as rows: no (q_len, n < 128) f32 column (the TPU pads each to 128 lanes, 32x a
    statistic's bytes)."""
    problem = dataclasses.replace(PROBLEM, mode="fwd_bwd", dtype=dtype)
    text = str(jax.make_jaxpr(_attention(problem, SHAPED))(*_specs(problem)))
    b, h, q = problem.batch, problem.q_heads, problem.q_len
    columns = set(re.findall(rf"f32\[{b},{h},{q},(\d+)\]", text)) - {str(problem.head_dim)}
    assert not columns, f"statistics as (q_len, {columns}) columns"
    rows = {int(n) for n in re.findall(rf"f32\[{b},{h},(\d+),{q}\]", text)}
    assert rows == ({1, pallas.STATS_ROWS} if dtype == "float32" else {1}), rows

