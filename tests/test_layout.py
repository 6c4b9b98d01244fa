"""Issue 46 item 5: the layout of the arrays. ``flash_attention`` takes ``[batch, heads, seq,
head_dim]`` or, with ``layout="BSHD"``, ``jax.nn``'s ``[batch, seq, heads, head_dim]``;
``kernel.dot_product_attention`` is a drop-in for ``jax.nn.dot_product_attention``; a mix-up
the shapes reveal is refused saying so, instead of a silently wrong result."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel


def _bshd(seq: int = 128, heads: int = 2, kv_heads: int = 1) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = [(1, seq, heads, 64), (1, seq, kv_heads, 64), (1, seq, kv_heads, 64)]
    return tuple(jax.random.normal(key, shape, jnp.float32) for key, shape in zip(keys, shapes))


def test_bshd_arrays_give_jax_nn_results_both_ways():
    q, k, v = _bshd()
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    got = kernel.flash_attention(q, k, v, causal=True, layout="BSHD")
    assert got.shape == q.shape
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(kernel.dot_product_attention(q, k, v, is_causal=True), want,
                               atol=1e-5)
    unbatched = kernel.dot_product_attention(q[0], k[0], v[0], is_causal=True, scale=0.3)
    np.testing.assert_allclose(unbatched, jax.nn.dot_product_attention(
        q[0], k[0], v[0], is_causal=True, scale=0.3), atol=1e-5)
    grad = jax.grad(lambda q: kernel.dot_product_attention(q, k, v).sum())(q)
    want_grad = jax.grad(lambda q: jax.nn.dot_product_attention(q, k, v).sum())(q)
    np.testing.assert_allclose(grad, want_grad, atol=1e-4)


def test_dot_product_attention_keeps_jax_nn_s_top_left_mask_when_lengths_differ():
    """jax.nn's is_causal and local_window_size are top-left (query i at position i) whatever
    the lengths, and it has no other alignment: the drop-in keeps that, where
    ``flash_attention`` refuses to guess (issue 73)."""
    q, k, v = _bshd(seq=256)
    for options in (dict(is_causal=True), dict(local_window_size=(64, 0))):
        want = jax.nn.dot_product_attention(q[:, :128], k, v, **options)
        np.testing.assert_allclose(kernel.dot_product_attention(q[:, :128], k, v, **options),
                                   want, atol=1e-5)


def test_jax_nn_arrays_passed_as_bhsd_are_refused_naming_the_layout():
    """The issue's case: 512 positions of 4 heads read as 512 heads over 4 positions."""
    q, k, v = _bshd(seq=512, heads=4, kv_heads=4)
    with pytest.raises(ValueError, match=r"512 heads over 4 positions.*layout='BSHD'"):
        kernel.flash_attention(q, k, v)


def test_256_positions_of_a_few_heads_passed_as_bhsd_are_refused_naming_both_readings():
    """Issue 62 item 6: 256 positions of 4 query heads and 1 key head ran as 256 heads over 4
    query and 1 key position, 4.19 off jax.nn's result, without an error (512 was refused)."""
    q, k, v = _bshd(seq=256, heads=4, kv_heads=1)
    with pytest.raises(ValueError, match=r"^q \(1, 256, 4, 64\) reads as 256 heads over 4 "
                                         r"positions \(models use at most 128 heads\) or, as "
                                         r"\[batch, seq, heads, head_dim\], as 256 positions of "
                                         r"4 heads: .*pass layout='BSHD'.*layout='BHSD'"):
        kernel.flash_attention(q, k, v, causal=True)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(kernel.flash_attention(q, k, v, causal=True, layout="BSHD"),
                               want, atol=1e-5)


def test_the_most_heads_of_a_model_over_one_position_still_run():
    """A decoding step of 128 heads (the most a published model's attention has) over one
    query position, in the default layout, is no mix-up."""
    q = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 128, 256, 64), jnp.float32)
    assert jax.eval_shape(kernel.flash_attention, q, k, k).shape == q.shape


def test_head_counts_only_bshd_makes_consistent_are_refused_naming_the_layout():
    q, k, v = _bshd(seq=96, heads=4, kv_heads=2)  # read as BHSD: 96 heads over 64 kv heads
    k, v = (x[:, :64] for x in (k, v))
    with pytest.raises(ValueError, match=r"as \[batch, seq, heads, head_dim\] they would be 4 "
                                         r"and 2.*layout='BSHD'"):
        kernel.flash_attention(q, k, v)


def test_meant_shapes_run_when_the_layout_is_given():
    q = jnp.ones((1, 300, 8, 64), jnp.float32)  # 300 heads over 8 positions, meant
    assert kernel.flash_attention(q, q, q, layout="BHSD").shape == q.shape


@pytest.mark.parametrize("kwargs, message", [
    (dict(layout="SBHD"), "layout must be one of BHSD, BSHD"),
    (dict(layout="BSHD", config=None, mask=1), "'mask'"),
])
def test_bad_layout_arguments_are_named(kwargs, message):
    q, k, v = _bshd()
    with pytest.raises((ValueError, TypeError), match=message):
        kernel.flash_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("argument", ["bias", "mask", "query_seq_lengths", "implementation"])
def test_dot_product_attention_names_what_it_does_not_support(argument):
    q, k, v = _bshd()
    with pytest.raises(TypeError, match=f"'{argument}'"):
        kernel.dot_product_attention(q, k, v, **{argument: "xla"})
