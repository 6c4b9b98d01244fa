"""JAX's own splash attention tests (tests/pallas/tpu_splash_attention_kernel_test.py in
jax-ml/jax), the parameterizations that apply to our problem key, at their tolerances, on CPU
(interpret mode).

Ported: causal and full masks; heads as upstream draws them ((1, 1), (2, 2), (4, 1), (6, 2):
plain, grouped and multi-query); float32 and bfloat16; square and rectangular sequences;
uniform inputs against an f32 reference; the forward's tolerance (atol = rtol = 3e-3) and the backward's (atol 2e-2, rtol 3e-2). The problem
cases run over every kernel that runs on a CPU, at its default config; the block-size sweeps
(blocks of 128-512, a compute block below its block, each layout of q, k and v, the fused and
the unfused backward) over splash, whose config holds them. The gradients are those the tuner
measures, of the output's sum (upstream draws a random cotangent). Sequences are 128-256 instead of
upstream's 1024-4096 so that interpreted kernels fit CI's time; upstream's masks beyond causal
(local, random), segment ids, soft caps and dynamic masks are outside our key (issue 48)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel import Problem, get_kernel, kernel_names
from kernel.contract import input_specs
from conftest import installed

FWD_TOLERANCE = dict(atol=3e-3, rtol=3e-3)
BWD_TOLERANCE = dict(atol=2e-2, rtol=3e-2)
ON_CPU = [installed(name) for name in kernel_names() if "cpu" in get_kernel(name).targets]

# (mode, q_heads, kv_heads, q_len, kv_len, dtype, causal)
PROBLEMS = [("fwd", 4, 1, 256, 256, "float32", True),
            ("fwd", 2, 2, 128, 256, "bfloat16", False),
            ("fwd_bwd", 6, 2, 128, 128, "float32", True),
            ("fwd_bwd", 1, 1, 128, 128, "bfloat16", False)]

# (mode, dtype, causal, splash config changes): upstream's block_sizes_strategy, drawn by hand
SWEEP = [("fwd", "float32", True, dict(block_q=128, block_kv=256, block_kv_compute=128,
                                       q_layout="SEQ_MINOR", v_layout="SEQ_MINOR")),
         ("fwd", "bfloat16", False, dict(block_q=256, block_kv=128, block_kv_compute=128,
                                         k_layout="SEQ_MINOR")),
         ("fwd_bwd", "float32", True, dict(block_q=128, block_kv=256, block_kv_compute=128,
                                           block_q_dkv=128, block_kv_dkv=256,
                                           block_kv_dkv_compute=128, block_q_dq=256,
                                           block_kv_dq=128, k_layout="SEQ_MINOR")),
         ("fwd_bwd", "bfloat16", True, dict(block_q_dkv=256, block_kv_dkv=128,
                                            block_kv_dkv_compute=128, block_q_dq=None,
                                            block_kv_dq=None, use_fused_bwd_kernel=True,
                                            q_layout="SEQ_MINOR", v_layout="SEQ_MINOR"))]


def _problem(mode: str, q_heads: int, kv_heads: int, q_len: int, kv_len: int, dtype: str,
             causal: bool) -> Problem:
    return Problem(batch=1, q_heads=q_heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len,
                   head_dim=128, dtype=dtype, causal=causal, mode=mode)


def _check(name: str, problem: Problem, config) -> None:
    """What the tuner measures (the output, or the three gradients of its sum) against the
    f32 reference on the same inputs, cast to f32."""
    kernel = get_kernel(name)
    keys = jax.random.split(jax.random.key(0), 3)
    args = [jax.random.uniform(key, spec.shape, spec.dtype)
            for key, spec in zip(keys, input_specs(problem), strict=True)]
    # The interpreted kernels are large XLA programs; LLVM's -O0 halves their compile time.
    got = jax.jit(kernel.build(problem, config)).trace(*args).lower().compile(
        {"xla_backend_optimization_level": 0})(*args)
    want = jax.jit(kernel.reference(problem))(*[x.astype(jnp.float32) for x in args])
    tolerance = FWD_TOLERANCE if problem.mode == "fwd" else BWD_TOLERANCE
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.float32(g), np.float32(w), **tolerance,
                                   err_msg=f"{name} {config.label()} {problem.label()}")


@pytest.mark.parametrize("name", ON_CPU)
@pytest.mark.parametrize("case", PROBLEMS, ids=lambda c: "-".join(map(str, c)))
def test_upstream_problem_cases_at_the_default_config(name, case):
    problem = _problem(*case)
    _check(name, problem, get_kernel(name).default_config(problem))


@pytest.mark.parametrize("mode, dtype, causal, changes", SWEEP,
                         ids=[f"{m}-{d}-{'causal' if c else 'full'}-{i}"
                              for i, (m, d, c, _) in enumerate(SWEEP)])
def test_upstream_block_sweeps_over_splash(mode, dtype, causal, changes):
    problem = _problem(mode, 2, 1, 256, 256, dtype, causal)
    splash = get_kernel("splash")
    _check("splash", problem, splash.default_config(problem).replace(**changes))
