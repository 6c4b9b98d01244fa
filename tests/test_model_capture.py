"""kernel.capture(): exactly the attention problems a model's trace runs, in the mode each runs,
under the transformations a training step uses; shapes files that ``tune --shapes`` reads."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import kernel
from autotune.problem_options import load_shapes
from kernel import Problem

# Two attention layers of different shapes: grouped-query causal self-attention, then
# cross-attention of a longer sequence over the first layer's output.
SELF = Problem(batch=2, q_heads=4, kv_heads=2, q_len=128, kv_len=128, head_dim=128,
               dtype="float32", causal=True)
CROSS = Problem(batch=2, q_heads=2, kv_heads=2, q_len=256, kv_len=128, head_dim=128,
                dtype="float32", causal=False)
LAYERS = 3  # self-attention layers, for the scan


def self_attention(w, x):
    """[b, 128, 512] -> [b, 128, 512]: 4 query heads over 2 key/value heads."""
    b = x.shape[0]
    q = (x * w).reshape(b, 128, 4, 128).transpose(0, 2, 1, 3)
    out = kernel.flash_attention(q, q[:, :2], q[:, :2], causal=True)
    return out.transpose(0, 2, 1, 3).reshape(b, 128, 512)


def cross_attention(w, y, memory):
    """[b, 256, 256] over the memory [b, 128, 512] -> [b, 2, 256, 128]."""
    b = y.shape[0]
    q = (y * w).reshape(b, 256, 2, 128).transpose(0, 2, 1, 3)
    kv = memory.reshape(b, 128, 4, 128).transpose(0, 2, 1, 3)[:, :2]
    return kernel.flash_attention(q, kv, kv)


def forward(params, x, y):
    return cross_attention(params["cross"], y, self_attention(params["self"], x))


def loss(params, x, y):
    return forward(params, x, y).sum()


def scanned_loss(params, x, y):
    memory, _ = jax.lax.scan(lambda h, w: (self_attention(w, h), None), x, params["layers"])
    return cross_attention(params["cross"], y, memory).sum()


def per_example_loss(params, x, y):
    return loss(params, x[None], y[None])


def abstract(batch=2, layers=False):
    params = {"self": jax.ShapeDtypeStruct((512,), jnp.float32),
              "cross": jax.ShapeDtypeStruct((256,), jnp.float32)}
    if layers:
        params["layers"] = jax.ShapeDtypeStruct((LAYERS, 512), jnp.float32)
    return (params, jax.ShapeDtypeStruct((batch, 128, 512), jnp.float32),
            jax.ShapeDtypeStruct((batch, 256, 256), jnp.float32))


def captured(fn, *args):
    with kernel.capture() as problems:
        jax.eval_shape(fn, *args)
    return problems.problems


def moded(*problems, mode, **changes):
    return [dataclasses.replace(p, mode=mode, **changes) for p in problems]


def test_forward_only_is_fwd():
    assert captured(forward, *abstract()) == moded(SELF, CROSS, mode="fwd")


@pytest.mark.smoke
def test_grad_is_fwd_bwd():
    assert captured(jax.grad(loss), *abstract()) == moded(SELF, CROSS, mode="fwd_bwd")


def test_a_call_not_differentiated_in_a_training_step_is_fwd():
    """The cross-attention of a stopped memory with no parameter of its own is no part of the
    gradient: it runs forward only, in the same step."""
    def step(params, x, y):
        memory = jax.lax.stop_gradient(self_attention(params["self"], x))
        return jax.value_and_grad(lambda p: (self_attention(p["self"], x).sum()
                                             + cross_attention(1.0, y, memory).sum()))(params)

    assert captured(step, *abstract()) == [*moded(SELF, mode="fwd"), *moded(SELF, mode="fwd_bwd"),
                                           *moded(CROSS, mode="fwd")]


def test_vmap_over_the_batch_is_the_per_example_problem():
    step = jax.grad(lambda p, x, y: jax.vmap(per_example_loss, (None, 0, 0))(p, x, y).sum())
    assert captured(step, *abstract(batch=4)) == moded(SELF, CROSS, mode="fwd_bwd", batch=1)


def test_checkpointed_layers_are_fwd_bwd_only():
    """jax.checkpoint traces each layer's primal before differentiating it."""
    def remat_loss(params, x, y):
        memory = jax.checkpoint(self_attention)(params["self"], x)
        return jax.checkpoint(cross_attention)(params["cross"], y, memory).sum()

    assert captured(jax.grad(remat_loss), *abstract()) == moded(SELF, CROSS, mode="fwd_bwd")


@pytest.mark.smoke
def test_scan_over_layers_is_one_problem_per_shape_fwd_bwd():
    """lax.scan traces its body's primal before differentiating it too (how JAX traces a
    custom VJP is version sensitive: a smoke test)."""
    args = abstract(layers=True)
    assert captured(jax.grad(scanned_loss), *args) == moded(SELF, CROSS, mode="fwd_bwd")
    assert captured(scanned_loss, *args) == moded(SELF, CROSS, mode="fwd")


def test_scan_of_checkpointed_layers_under_grad():
    def loss_of(params, x, y):
        def body(h, w):
            return jax.checkpoint(self_attention)(w, h), None
        memory, _ = jax.lax.scan(body, x, params["layers"])
        return cross_attention(params["cross"], y, memory).sum()

    assert captured(jax.grad(loss_of), *abstract(layers=True)) == moded(SELF, CROSS,
                                                                         mode="fwd_bwd")


def test_a_function_traced_before_is_captured_again():
    step = jax.jit(jax.grad(loss))
    jax.eval_shape(step, *abstract())  # cached by JAX: the capture must not reuse it
    with kernel.capture() as problems:
        step.lower(*abstract())
    assert problems.problems == moded(SELF, CROSS, mode="fwd_bwd")


def test_capture_compiles_nothing_and_is_not_a_miss():
    compiles = []

    def listener(event: str, duration: float, **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    before = kernel.untuned()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        with kernel.capture() as problems:
            jax.jit(jax.grad(loss)).lower(*abstract())
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(problems) == 2
    assert compiles == []
    assert kernel.untuned() == before  # an abstract trace runs nothing


def test_nested_captures_both_record(tmp_path):
    with kernel.capture() as outer:
        jax.eval_shape(forward, *abstract())
        with kernel.capture() as inner:
            jax.eval_shape(jax.grad(loss), *abstract())
    assert inner.problems == moded(SELF, CROSS, mode="fwd_bwd")
    assert outer.problems == [*moded(SELF, CROSS, mode="fwd"),
                              *moded(SELF, CROSS, mode="fwd_bwd")]


def test_saved_shapes_file_is_what_tune_shapes_reads(tmp_path):
    path = tmp_path / "shapes.yaml"
    with kernel.capture() as problems:
        jax.eval_shape(jax.grad(loss), *abstract())
        jax.eval_shape(forward, *abstract())
    problems.save(path)
    assert load_shapes(path) == problems.problems == [*moded(SELF, CROSS, mode="fwd_bwd"),
                                                      *moded(SELF, CROSS, mode="fwd")]
