"""The Pallas kernels (TPU interpret mode on CPU) against jax.nn.dot_product_attention:
forward output and all three gradients, over GQA/MQA, causal, q_len != kv_len, both dtypes
and configs that exercise several q/kv blocks, compute sub-blocks and every pipeline depth
(1 to 4) in each of the three kernels (ids: ``depths<fwd>/<dkv>/<dq>``), with f32 and bf16,
causal or not, grouped-query; and the fused backward (``fused_bwd``: no dQ kernel)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import float32_bound
from kernel import FlashConfig
from kernel import flash_attention, reference_attention

# (batch, q_heads, kv_heads, q_len, kv_len, head_dim), dtype, causal, config, sm_scale
CASES = [
    pytest.param((2, 2, 2, 256, 256, 64), "float32", False,
                 FlashConfig(block_q=128, block_kv=128, block_kv_compute=128,
                             block_q_dkv=128, block_kv_dkv=128, block_q_dq=128, block_kv_dq=128,
                             pipeline_depth=3, pipeline_depth_dkv=4, pipeline_depth_dq=1),
                 0.3, id="mha-f32-full-2x2blocks-sm_scale-depths3/4/1"),
    pytest.param((1, 4, 2, 512, 512, 128), "float32", True,
                 FlashConfig(block_q=128, block_kv=256, block_kv_compute=128,
                             block_q_dkv=128, block_kv_dkv=256, block_q_dq=256, block_kv_dq=128,
                             pipeline_depth=1, pipeline_depth_dkv=1, pipeline_depth_dq=1),
                 None, id="gqa-f32-causal-subblocks-depths1/1/1"),
    pytest.param((1, 4, 1, 256, 512, 64), "float32", True,
                 FlashConfig(block_q=128, block_kv=128, block_kv_compute=128,
                             block_q_dkv=256, block_kv_dkv=128, block_q_dq=128, block_kv_dq=256,
                             pipeline_depth=4, pipeline_depth_dkv=3, pipeline_depth_dq=4),
                 None, id="mqa-f32-causal-q<kv-depths4/3/4"),
    pytest.param((1, 4, 2, 512, 256, 64), "float32", True,
                 FlashConfig(block_q=256, block_kv=128, block_kv_compute=128,
                             block_q_dkv=128, block_kv_dkv=128, block_q_dq=128, block_kv_dq=256,
                             pipeline_depth=2, pipeline_depth_dkv=1, pipeline_depth_dq=3),
                 None, id="gqa-f32-causal-q>kv-depths2/1/3"),
    pytest.param((1, 4, 1, 128, 384, 64), "float32", False,
                 FlashConfig(block_q=128, block_kv=384, block_kv_compute=128,
                             block_q_dkv=128, block_kv_dkv=128, block_q_dq=128, block_kv_dq=384,
                             pipeline_depth=1, pipeline_depth_dkv=2, pipeline_depth_dq=4),
                 None, id="mqa-f32-full-q<kv-3subblocks-depths1/2/4"),
    pytest.param((1, 2, 2, 200, 200, 64), "float32", True, None, None,
                 id="f32-causal-unaligned-len-resolved-config"),
    pytest.param((1, 4, 2, 512, 512, 128), "bfloat16", True,
                 FlashConfig(block_q=256, block_kv=512, block_kv_compute=256,
                             block_q_dkv=256, block_kv_dkv=128, block_q_dq=128, block_kv_dq=128,
                             pipeline_depth=3, pipeline_depth_dkv=4, pipeline_depth_dq=3),
                 None, id="gqa-bf16-causal-subblocks-depths3/4/3"),
    pytest.param((1, 4, 1, 256, 512, 128), "bfloat16", True,
                 FlashConfig(block_q=128, block_kv=256, block_kv_compute=128,
                             block_q_dkv=128, block_kv_dkv=256, block_q_dq=128, block_kv_dq=128,
                             pipeline_depth=1, pipeline_depth_dkv=3, pipeline_depth_dq=2),
                 None, id="mqa-bf16-causal-q<kv-depths1/3/2"),
    pytest.param((2, 4, 2, 512, 256, 64), "bfloat16", False,
                 FlashConfig(block_q=128, block_kv=128, block_kv_compute=128,
                             block_q_dkv=256, block_kv_dkv=128, block_q_dq=256, block_kv_dq=128,
                             pipeline_depth=4, pipeline_depth_dkv=2, pipeline_depth_dq=4),
                 None, id="gqa-bf16-full-q>kv-depths4/2/4"),
    # issue 74: dQ fused into dK/dV (f32 partials per kv block, summed in XLA)
    pytest.param((2, 4, 2, 256, 512, 128), "bfloat16", False,
                 FlashConfig(block_q=128, block_kv=256, block_kv_compute=128,
                             block_q_dkv=128, block_kv_dkv=256, pipeline_depth_dkv=3).fused(),
                 None, id="gqa-bf16-full-q<kv-fused-depth3"),
]


def _inputs(shape, dtype):
    batch, q_heads, kv_heads, q_len, kv_len, head_dim = shape
    keys = jax.random.split(jax.random.PRNGKey(sum(shape)), 4)
    q = jax.random.normal(keys[0], (batch, q_heads, q_len, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, kv_heads, kv_len, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, kv_heads, kv_len, head_dim), dtype)
    d_out = jax.random.normal(keys[3], q.shape, dtype)
    return q, k, v, d_out


def _assert_close(name, got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), f"{name} has non-finite values"
    # f32: a different summation order only (on a CPU). bf16: inputs to the MXU products are
    # rounded to bf16 (8 mantissa bits), so compare relative to the size of the values.
    scale = float(np.abs(want).max())
    tol = float32_bound(2e-5) * max(scale, 1.0) if dtype == "float32" else 1e-2 * scale
    err = float(np.abs(got - want).max())
    assert err <= tol, f"{name}: max abs error {err:.3g} > {tol:.3g} (max |ref| {scale:.3g})"


def _flash_and_reference(q, k, v, d_out, causal, config, sm_scale=None, alignment="top_left"):
    """(plain output, vjp output, grads) of the kernel and (output, grads) of the reference,
    one jit each so every case compiles once."""
    offset = k.shape[2] - q.shape[2] if alignment == "bottom_right" else 0

    @jax.jit
    def run_flash(q, k, v, d_out):
        fn = lambda q, k, v: flash_attention(q, k, v, causal=causal,  # noqa: E731
                                             sm_scale=sm_scale, config=config,
                                             alignment=alignment)
        out_vjp, vjp = jax.vjp(fn, q, k, v)  # custom_vjp forward: also emits the row statistics
        return fn(q, k, v), out_vjp, vjp(d_out)  # plain path: no statistics output

    @jax.jit
    def run_reference(q, k, v, d_out):
        # In f32 on the same (possibly bf16-rounded) inputs.
        fn = lambda q, k, v: reference_attention(q, k, v, causal=causal,  # noqa: E731
                                                 sm_scale=sm_scale, query_offset=offset)
        q, k, v, d_out = (x.astype(jnp.float32) for x in (q, k, v, d_out))
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(d_out)

    return _run(run_flash, q, k, v, d_out), _run(run_reference, q, k, v, d_out)


def _run(fn, *args):
    # The interpret-mode kernels are large XLA programs; LLVM's -O0 halves their compile time.
    compiled = fn.trace(*args).lower().compile({"xla_backend_optimization_level": 0})
    return compiled(*args)


def _check(shape, dtype, causal, config, sm_scale=None, alignment="top_left"):
    q, k, v, d_out = _inputs(shape, jnp.dtype(dtype))
    (out, out_vjp, grads), (want, want_grads) = _flash_and_reference(
        q, k, v, d_out, causal, config, sm_scale, alignment)
    assert out.dtype == q.dtype and out.shape == q.shape
    _assert_close("out", out, want, dtype)
    _assert_close("out (vjp forward)", out_vjp, want, dtype)
    for name, got, want_grad, primal in zip(("dq", "dk", "dv"), grads, want_grads, (q, k, v)):
        assert got.dtype == primal.dtype and got.shape == primal.shape
        _assert_close(name, got, want_grad, dtype)


@pytest.mark.parametrize("shape, dtype, causal, config, sm_scale", CASES)
def test_forward_and_gradients_match_reference(shape, dtype, causal, config, sm_scale):
    _check(shape, dtype, causal, config, sm_scale)


# The causal cases with q_len != kv_len again, their queries bottom-right aligned (the last
# q_len positions; with more queries than keys the first see none and get zeros).
BOTTOM_RIGHT = [case for case in CASES if "causal-q" in case.id]


@pytest.mark.parametrize("shape, dtype, causal, config, sm_scale", BOTTOM_RIGHT)
def test_bottom_right_forward_and_gradients_match_reference(shape, dtype, causal, config,
                                                            sm_scale):
    _check(shape, dtype, causal, config, sm_scale, alignment="bottom_right")


def test_causal_top_left_alignment_is_jax_nn_s():
    """Query i sees keys j <= i even when q_len < kv_len: row 0 attends to key 0 only."""
    q, k, v, _ = _inputs((1, 1, 1, 128, 256, 64), jnp.float32)
    out = flash_attention(q, k, v, causal=True, alignment="top_left")
    bound = float32_bound(1e-6)
    np.testing.assert_allclose(np.asarray(out[0, 0, 0]), np.asarray(v[0, 0, 0]), rtol=bound,
                               atol=bound)


def test_causal_bottom_right_decode_sees_every_key():
    """One query bottom-right aligned sits at the last position: it sees the whole cache, as
    attention without a mask does (issue 73: top-left it saw key 0 only)."""
    q, k, v, _ = _inputs((1, 2, 1, 1, 512, 64), jnp.float32)
    out = flash_attention(q, k, v, causal=True, alignment="bottom_right")
    np.testing.assert_allclose(out, reference_attention(q, k, v), atol=float32_bound(2e-6))


def test_jit_matches_eager():
    q, k, v, _ = _inputs((1, 2, 2, 256, 256, 64), jnp.bfloat16)
    fn = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True))
    np.testing.assert_array_equal(np.asarray(fn(q, k, v), np.float32),
                                  np.asarray(flash_attention(q, k, v, causal=True), np.float32))


def test_tpu_simulator_finds_no_uninitialised_reads_or_races():
    """Pallas' TPU simulator fills unwritten VMEM with NaN and checks DMAs for races."""
    from jax.experimental.pallas import tpu as pltpu

    config = FlashConfig(block_q=128, block_kv=256, block_kv_compute=128, block_q_dkv=128,
                         block_kv_dkv=128, block_q_dq=128, block_kv_dq=128, pipeline_depth=1)
    params = pltpu.InterpretParams(uninitialized_memory="nan", detect_races=True)
    with pltpu.force_tpu_interpret_mode(params):
        _check((1, 2, 1, 128, 256, 64), "float32", True, config)
