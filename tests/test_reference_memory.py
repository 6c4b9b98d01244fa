"""A reference that fits wherever the kernel fits (issue 60 item 2), on this machine's CPU.

The gate's reference (``TunableKernel.reference``: :func:`kernel.reference.blockwise_reference`)
computes what the full reference computes, over blocks of queries, in bounded memory forward
and backward (compiled, never run, for a model-sized problem).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel import Problem, get_kernel, reference_attention
from kernel.contract import input_specs
from kernel.reference import blockwise_reference

GIB = 2**30
# Grid problem 6: one Llama-3-8B layer at 8k tokens; the full reference's fwd_bwd needs 24 GB
# of temporaries on a TPU v5e (69 GB compiled for a CPU), the kernels under 1 GB.
LLAMA_8K = Problem(batch=2, q_heads=32, kv_heads=8, q_len=8192, kv_len=8192, head_dim=128,
                   dtype="bfloat16", causal=True, mode="fwd_bwd")
XLA = get_kernel("xla")


def _inputs(q_len: int, kv_len: int) -> list[jax.Array]:
    """q (4 heads), k and v (2 heads), float32, head_dim 16, batch 2."""
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.standard_normal(shape), jnp.float32)
            for shape in ((2, 4, q_len, 16), (2, 2, kv_len, 16), (2, 2, kv_len, 16))]


def _segment_ids(q_len: int, kv_len: int) -> tuple[jax.Array, jax.Array]:
    """Sorted ids 0..2 of the keys, the queries' those of their positions, but the last five
    queries' an id no key has: they see no key at all (zeros out, no gradient)."""
    kv = np.sort(np.random.default_rng(1).integers(0, 3, (2, kv_len)), axis=1)
    q = kv[:, :q_len].copy()
    q[:, -5:] = 9
    return jnp.asarray(q, jnp.int32), jnp.asarray(kv, jnp.int32)


def _error(got: Any, want: Any) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


@pytest.mark.parametrize(("q_len", "kv_len", "causal", "window", "softcap", "segmented"), [
    (70, 70, False, None, None, False),
    (70, 70, True, None, None, False),
    (70, 70, False, (5, 3), None, False),
    (70, 70, False, None, 2.0, True),
    (70, 70, True, (5, 0), 2.0, True),
    (48, 80, False, None, None, False),
    (48, 80, True, (9, 0), 2.0, True),
])
def test_the_blockwise_reference_agrees_with_the_full_one(
        q_len: int, kv_len: int, causal: bool, window: tuple[int, int] | None,
        softcap: float | None, segmented: bool) -> None:
    """Forward and gradients within 1e-6 of ``reference_attention`` (float32), over every
    feature, grouped-query heads, a scale, and query blocks that do not divide the queries."""
    q, k, v = _inputs(q_len, kv_len)
    ids = _segment_ids(q_len, kv_len) if segmented else ()
    options = {"causal": causal, "window": window, "softcap": softcap, "sm_scale": 0.3}

    def full(*qkv: Any) -> Any:
        return reference_attention(*qkv, *ids, **options)

    def blocked(*qkv: Any) -> Any:
        return blockwise_reference(*qkv, *ids, block=16, **options)

    def with_gradients(attend: Any) -> Any:
        return jax.jit(lambda *qkv: (attend(*qkv), *jax.grad(
            lambda *a: attend(*a).sum(), (0, 1, 2))(*qkv)))

    want, got = (with_gradients(attend)(q, k, v) for attend in (full, blocked))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert _error(g, w) <= 1e-6, name


def test_the_gate_reference_of_a_llama_layer_at_8k_compiles_to_under_2gb() -> None:
    """Compiled (never run) for the CPU: the fwd_bwd reference's temporaries stay under 2 GB
    (69 GB with the full reference), with a window and a soft cap too."""
    for problem in (LLAMA_8K, dataclasses.replace(LLAMA_8K, window=(1024, 0), softcap=30.0)):
        compiled = jax.jit(XLA.reference(problem)).lower(*input_specs(problem)).compile()
        assert compiled.memory_analysis().temp_size_in_bytes < 2 * GIB, problem.label()
