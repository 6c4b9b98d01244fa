"""The flash kernel's sliding windows, soft-capping and segment ids (TPU interpret mode on
CPU), through the backend: forward and all three gradients against a float64 reference, block
skipping (the blocks counted, and unseen blocks of NaN that would poison a computed block);
the Mosaic compile of the new kernels; the window bench's counts."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import float32_bound
from kernel.backends.flash import KERNEL
from kernel.backends.flash.blocks import Reach, block_counts
from kernel.backends.flash.config import FlashConfig
from kernel.backends.flash.rules import vmem_estimate
from kernel.contract import attention_mask, reference_attention
from kernel.problem import Problem
from kernel.tolerance import relative_error

BLOCKS_128 = FlashConfig(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128,
                         block_kv_dkv=128, block_q_dq=128, block_kv_dq=128)
# Unequal tiles per kernel: a 256-key forward block computed in two 128-key sub-blocks.
MIXED = FlashConfig(block_q=128, block_kv=256, block_kv_compute=128, block_q_dkv=256,
                    block_kv_dkv=128, block_q_dq=128, block_kv_dq=256)
ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = float32_bound(2e-5)  # f32 kernel against float64: a summation order apart on a CPU


def _problem(q_len=384, kv_len=384, heads=(2, 1), batch=1, **features) -> Problem:
    return Problem(batch=batch, q_heads=heads[0], kv_heads=heads[1], q_len=q_len, kv_len=kv_len,
                   head_dim=64, dtype="float32", mode="fwd_bwd", **features)


def _inputs(problem: Problem, seed: int = 0) -> list[jax.Array]:
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    shapes = [(problem.batch, heads, length, problem.head_dim) for heads, length in (
        (problem.q_heads, problem.q_len), (problem.kv_heads, problem.kv_len),
        (problem.kv_heads, problem.kv_len), (problem.q_heads, problem.q_len))]
    return [jax.random.normal(key, shape, jnp.float32) for key, shape in zip(keys, shapes)]


def _flash(problem: Problem, config: FlashConfig, sm_scale: float, q, k, v, d_out,
           segment_ids=()):
    """(output, (dq, dk, dv)) of the flash backend, compiled once."""
    attend = KERNEL.attention(problem, lambda mode: config, sm_scale)

    def run(q, k, v, d_out, *segment_ids):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, *segment_ids), q, k, v)
        return out, vjp(d_out)

    # The interpret-mode kernels are large XLA programs; LLVM's -O0 halves their compile time.
    args = (q, k, v, d_out, *segment_ids)
    return jax.jit(run).trace(*args).lower().compile(
        {"xla_backend_optimization_level": 0})(*args)


def _float64_reference(problem: Problem, sm_scale: float, q, k, v, d_out, segment_ids=()):
    """(output, (dq, dk, dv)) of reference_attention in float64."""
    with jax.enable_x64(True):
        q, k, v, d_out = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, d_out))
        out, vjp = jax.vjp(lambda q, k, v: reference_attention(
            q, k, v, *segment_ids, causal=problem.causal, sm_scale=sm_scale,
            window=problem.window, softcap=problem.softcap), q, k, v)
        return np.asarray(out), tuple(np.asarray(g) for g in vjp(d_out))


def _packed(lengths: list[list[int]], ids: list[list[int]] | None = None) -> jax.Array:
    """Segment ids [batch, len] packing segments of ``lengths`` per row (ids 1, 2, .. unless
    given)."""
    return jnp.asarray([np.repeat(row_ids or np.arange(1, len(row) + 1), row)
                        for row, row_ids in zip(lengths, ids or [None] * len(lengths))],
                       jnp.int32)


CASES = [
    pytest.param(_problem(causal=True, window=(130, 0)), BLOCKS_128, 0.125, id="local-causal"),
    pytest.param(_problem(q_len=256, kv_len=512, window=(100, 60)), MIXED, 0.125,
                 id="window-L,R-full-q<kv"),
    pytest.param(_problem(q_len=256, kv_len=256, causal=True, window=(0, 0), heads=(2, 2)),
                 MIXED, 0.125,
                 id="window0-causal-own-key-only"),
    pytest.param(_problem(kv_len=256, window=(1000, 1000)), BLOCKS_128, 0.125,
                 id="window-wider-than-sequence"),
    pytest.param(_problem(q_len=256, kv_len=256, heads=(4, 1), softcap=3.0), MIXED, 1.0,
                 id="softcap-mqa"),
    pytest.param(_problem(q_len=512, kv_len=256, causal=True, window=(50, 0), softcap=5.0),
                 MIXED, 0.5,
                 id="softcap-window-q>kv-rows-seeing-no-key"),
]


# Two rows packed differently, each ending in a padding segment (id 0 in both q and kv, as
# MaxText pads: padding attends to padding); segments cross block boundaries.
PACKED_384 = _packed([[100, 200, 50, 34], [300, 84]], [[1, 2, 3, 0], [1, 0]])
SEGMENT_CASES = [
    pytest.param(_problem(batch=2, causal=True, segmented=True), BLOCKS_128,
                 (PACKED_384, PACKED_384), id="segments-causal-gqa-padding"),
    pytest.param(_problem(batch=2, causal=True, window=(60, 0), softcap=5.0, segmented=True),
                 BLOCKS_128, (PACKED_384, PACKED_384), id="segments-window-softcap"),
    # q padding id -1 is no key's: those queries see nothing (zeros); kv padding likewise unseen
    pytest.param(_problem(batch=1, q_len=256, kv_len=512, segmented=True), MIXED,
                 (_packed([[100, 120, 36]], [[1, 2, -1]]), _packed([[300, 100, 112]],
                                                                   [[1, 2, -2]])),
                 id="segments-full-q<kv-padding-sees-nothing"),
]


@pytest.mark.parametrize("problem, config, sm_scale", CASES)
def test_forward_and_gradients_match_float64(problem, config, sm_scale):
    _check(problem, config, sm_scale)


@pytest.mark.parametrize("problem, config, segment_ids", SEGMENT_CASES)
def test_segment_ids_match_float64(problem, config, segment_ids):
    _check(problem, config, 0.125, segment_ids)


def _check(problem: Problem, config: FlashConfig, sm_scale: float, segment_ids=()):
    assert not KERNEL.violations(problem, config, "v5e")
    inputs = _inputs(problem)
    out, grads = _flash(problem, config, sm_scale, *inputs, segment_ids)
    want, want_grads = _float64_reference(problem, sm_scale, *inputs, segment_ids)
    for name, got, expected in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, *want_grads)):
        error = _error(got, expected, want)
        assert error <= TOLERANCE, f"{name}: relative error {error:.3g} > {TOLERANCE}"


def _error(got, expected, out) -> float:
    """``relative_error``; against the output's scale where the reference is exactly zero: a
    gradient that cancels (a query that sees one key: the softmax of one logit has no
    gradient) has no scale of its own, and the kernel's is the rounding of dP - delta."""
    if np.any(expected):
        return relative_error(got, expected)
    got = np.asarray(got, np.float64)
    return float(np.abs(got).max() / np.abs(out).max()) if np.isfinite(got).all() else np.inf


def test_blocks_outside_the_window_are_not_computed():
    """NaN keys and values before query block 2's window, and NaN queries and output
    gradients in query block 0: a kernel computing a masked block pair with them gets NaN
    (0 * NaN), so the rows, gradients and keys beyond their reach stay finite only if every
    kernel (forward, dQ, dK/dV) skips those blocks."""
    problem = _problem(q_len=512, kv_len=512, causal=True, window=(128, 0))
    q, k, v, d_out = _inputs(problem)
    want, (want_dq, _, _) = _float64_reference(problem, 0.125, q, k, v, d_out)
    k, v = (x.at[:, :, :128].set(jnp.nan) for x in (k, v))
    out, (dq, _, _) = _flash(problem, BLOCKS_128, 0.125, q, k, v, d_out)
    # queries 256.. see keys 128.. only
    assert relative_error(out[:, :, 256:], want[:, :, 256:]) <= TOLERANCE
    assert relative_error(dq[:, :, 256:], want_dq[:, :, 256:]) <= TOLERANCE
    q, d_out = (x.at[:, :, :128].set(jnp.nan) for x in (q, d_out))
    _, (_, dk, dv) = _flash(problem, BLOCKS_128, 0.125, q, k, v, d_out)
    assert np.isfinite(np.asarray(dk[:, :, 256:])).all()  # keys 256.. are seen by queries 256..
    assert np.isfinite(np.asarray(dv[:, :, 256:])).all()


def _mask_tiles(problem: Problem, rows: int, cols: int) -> int:
    """Tiles of the reference mask (``rows`` x ``cols``) holding a visible pair: what an ideal
    kernel computes."""
    mask = np.asarray(attention_mask(problem.q_len, problem.kv_len, causal=problem.causal,
                                     window=problem.window))[0, 0]
    tiles = mask.reshape(problem.q_len // rows, rows, problem.kv_len // cols, cols)
    return int(tiles.any(axis=(1, 3)).sum())


@pytest.mark.parametrize("features", [
    {}, {"causal": True}, {"causal": True, "window": (512, 0)}, {"window": (300, 100)},
    {"causal": True, "window": (0, 0)}, {"window": (5000, 5000)},
])
def test_block_counts_are_the_tiles_the_mask_touches(features):
    problem = _problem(q_len=1024, kv_len=2048, heads=(1, 1), **features)
    counts = block_counts(problem, MIXED)
    assert counts["fwd"]["computed"] == _mask_tiles(problem, 128, 128)
    assert counts["dq"]["computed"] == _mask_tiles(problem, 128, 256)
    assert counts["dkv"]["computed"] == _mask_tiles(problem, 256, 128)
    # the forward loads 256-key blocks, each computed as two 128-key sub-blocks
    assert counts["fwd"]["loaded"] * 2 >= counts["fwd"]["computed"]


def test_a_local_window_loads_and_computes_fewer_blocks_than_causal():
    causal = block_counts(_problem(q_len=1024, kv_len=1024, causal=True), BLOCKS_128)
    local = block_counts(_problem(q_len=1024, kv_len=1024, causal=True, window=(128, 0)),
                         BLOCKS_128)
    # 8 query blocks by 8 key blocks, 2 heads: causal 36 block pairs each, a 128-key window
    # 1 + 7 * 2 (the diagonal block and the one before it)
    assert {kernel: counts["computed"] for kernel, counts in causal.items()} == dict.fromkeys(
        ("fwd", "dq", "dkv"), 2 * 36)
    assert {kernel: counts["loaded"] for kernel, counts in local.items()} == dict.fromkeys(
        ("fwd", "dq", "dkv"), 2 * 15)


def test_reach_masks_nothing_for_full_attention_or_a_window_wider_than_the_sequence():
    assert not Reach.of(_problem()).masks
    assert not Reach.of(_problem(window=(384, 384))).masks
    assert _problem(window=(383, 383)).window is None  # covers every key: no window
    assert Reach.of(_problem(window=(382, 384))).masks_left  # query 383 misses key 0


def test_window_softcap_and_segment_kernels_compile_for_a_tpu_within_the_estimate():
    """Mosaic lowers and compiles the window masks, the block runs' traced bounds, the soft
    cap and the segment-id blocks (deviceless, for v5e), both ways, under a scoped VMEM limit
    of the estimate (which counts the segment-id blocks)."""

    from kernel.aot import topology_device
    from kernel.contract import input_specs

    flash = KERNEL.discover()
    problem = Problem(batch=1, q_heads=2, kv_heads=1, q_len=4096, kv_len=4096, head_dim=128,
                      dtype="bfloat16", mode="fwd_bwd", window=(700, 300), softcap=30.0,
                      segmented=True)
    config = FlashConfig(block_q=1024, block_kv=1024, block_kv_compute=512, block_q_dkv=1024,
                         block_kv_dkv=1024, block_q_dq=1024, block_kv_dq=1024)
    estimate = vmem_estimate(problem, config)
    unsegmented = vmem_estimate(dataclasses.replace(problem, segmented=False), config)
    assert all(estimate[name] > unsegmented[name] for name in estimate)
    attend = flash.attention(problem, lambda mode: config, 0.1)
    grads = jax.grad(lambda *args: attend(*args).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    device = topology_device("v5e")
    # input_specs gives a segmented problem's two id arrays after q, k and v
    jax.jit(grads).trace(*input_specs(problem, device)).lower().compile(
        {"xla_tpu_scoped_vmem_limit_kib": -(-max(estimate.values()) // 1024)})


def test_window_bench_counts_the_blocks_each_kernel_computes(tmp_path):
    out = tmp_path / "window.json"
    subprocess.run([sys.executable, "bench/kernels/window.py", "--seq", "2048", "--out", str(out)],
                   check=True, capture_output=True, cwd=ROOT)
    rows = {(row["kernel"], row["pass"]): row for row in json.loads(out.read_text())["rows"]}
    # 4 blocks of 512 queries and keys, 8 heads: causal 10 block pairs each; a 512-key window
    # the diagonal and the block before it, 1 + 3 * 2
    assert (rows["flash", "fwd"]["causal"], rows["flash", "fwd"]["window"]) == (80, 56)
    assert (rows["splash", "fwd"]["causal"], rows["splash", "fwd"]["window"]) == (80, 56)
    assert {"dq", "dkv"} <= {name for kernel, name in rows if kernel == "splash"}
