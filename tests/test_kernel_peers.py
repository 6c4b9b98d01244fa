"""The attention test parameterizations of the peers, run over every registered kernel at the
peers' own tolerances (``atol + rtol * |truth|`` per element), on CPU in interpret mode:

- tokamax ``ops/attention/test_base.py`` (``tk-*``) and ``pallas_mosaic_tpu_test.py``
  (``tk-tpu-*``);
- JAX ``tests/pallas/gpu_ops_test.py`` FusedAttention (``jax-fused-*``) and
  ``tests/pallas/mgpu_attention_test.py`` (``jax-mgpu-*``).

Each case keeps its kind (dtype, masking, GQA/MQA, cross attention, odd lengths and head dims,
extra batch dimensions, sm_scale, input distribution, several configs of a space); sequence
lengths and head counts are scaled down where CI time demands. Differences from the peers:
the truth is float64 on the same rounded inputs (the peers: XLA in f32 or the input dtype);
gradients are those of ``sum(output)`` (what the tuner measures; tokamax draws a random
cotangent); float16 cases run in bfloat16, which the kernels support instead. A kernel that
cannot run a problem (``problem_violations``) skips with its reason. Features outside the
contract (segment ids, bias, soft-cap, sliding window, dropout) must fail with a clear error.
"""

from __future__ import annotations

import dataclasses
import math
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel import Problem, ProblemError, flash_attention, get_kernel, kernel_names
from kernel.tolerance import MAX_RELATIVE_ERROR, float64_attention, relative_error


@dataclasses.dataclass(frozen=True)
class Case:
    shape: tuple[int, int, int, int, int, int]  # batch, q_heads, kv_heads, q_len, kv_len, dim
    dtype: str = "float32"
    causal: bool = False
    atol: float = 1e-6  # output
    atol_grads: tuple[float, float, float] | None = None  # dq, dk, dv; default 2 * atol
    rtol: float | None = None  # default tokamax's max(atol / 10, 1e-6)
    sm_scale: float | None = None  # None: head_dim ** -0.5
    uniform: bool = False  # inputs uniform in [1, 2) (tokamax's small sequences)
    extra_batch: int = 0  # a leading vmapped batch dimension of this size
    configs: int = 0  # also this many other configs of the kernel's space


def _tk(shape, dtype="float32", **kw) -> Case:
    """tokamax's defaults: atol by dtype, gradients max(2 atol, 5e-6)."""
    kw.setdefault("atol", {"float32": 1e-6, "bfloat16": 1e-2}[dtype])
    kw.setdefault("atol_grads", (max(2 * kw["atol"], 5e-6),) * 3)
    return Case(shape, dtype, **kw)


TK_TPU = dict(atol=0.15, atol_grads=(1.5, 1.2, 0.15), rtol=0.0, sm_scale=0.1)
FUSED = dict(dtype="bfloat16", sm_scale=1.0, atol=0.05, atol_grads=(5e-2,) * 3, rtol=1e-2)
MGPU_FWD = dict(dtype="bfloat16", atol=2e-3, rtol=1e-3)
MGPU_BWD = dict(dtype="bfloat16", atol=2e-3, atol_grads=(7e-2, 7e-2, 5e-2), rtol=1e-2)

CASES = {
    # tokamax test_base.py (2, 1024, 4, 64) scaled down
    "tk-self-f32": _tk((1, 2, 2, 512, 512, 64)),
    "tk-self-bf16": _tk((1, 2, 2, 512, 512, 64), "bfloat16"),
    "tk-cross": _tk((1, 2, 2, 256, 384, 64)),
    "tk-small-q8-kv256": _tk((2, 4, 4, 8, 256, 64), uniform=True, atol_grads=(2e-5,) * 3),
    "tk-small-q256-kv8": _tk((2, 4, 4, 256, 8, 64), uniform=True, atol_grads=(2e-5,) * 3),
    "tk-small-q7-kv8": _tk((2, 4, 4, 7, 8, 64), uniform=True, atol_grads=(2e-5,) * 3),
    "tk-mqa": _tk((1, 4, 1, 256, 256, 64)),
    "tk-gqa": _tk((1, 8, 2, 256, 256, 64)),
    "tk-multiple-batch-dims": _tk((3, 2, 2, 256, 256, 64), extra_batch=2),
    "tk-q-len-112": _tk((1, 2, 2, 112, 512, 64)),
    "tk-head-dim-48": _tk((1, 2, 2, 256, 256, 48)),
    "tk-head-dim-24": _tk((1, 2, 2, 256, 256, 24)),
    "tk-causal": _tk((1, 2, 2, 512, 512, 64), causal=True),
    "tk-causal-cross-512": _tk((1, 1, 1, 1024, 512, 64), causal=True, atol=1e-5),
    "tk-causal-cross-539": _tk((1, 1, 1, 1024, 539, 64), causal=True, atol=1e-5),
    # tokamax pallas_mosaic_tpu_test.py: test_simple (f32, logits_scale 0.1) and the configs
    # of the space (test_autotune_configs / test_autotune_vjp)
    **{f"tk-tpu-kv{kv}-{'causal' if causal else 'full'}": Case(
        (2, 4, kv, 128, 128, 32), causal=causal, **TK_TPU)
       for kv in (1, 2, 4) for causal in (False, True)},
    "tk-tpu-configs": Case((2, 4, 4, 256, 256, 32), configs=3, **TK_TPU),
    "tk-tpu-vjp-configs": Case((1, 4, 4, 512, 512, 128), configs=2, **TK_TPU),
    # JAX gpu_ops_test.py FusedAttention (float16 -> bfloat16, sm_scale 1.0): 4 of each product
    "jax-fused-fwd-b2-s384-h8-d64-causal": Case((2, 8, 8, 384, 384, 64), causal=True, **FUSED),
    "jax-fused-fwd-b1-s128-h1-d32": Case((1, 1, 1, 128, 128, 32), **FUSED),
    "jax-fused-bwd-b1-s384-h1-d128": Case((1, 1, 1, 384, 384, 128), **FUSED),
    "jax-fused-bwd-b2-s384-h2-d128-causal": Case((2, 2, 2, 384, 384, 128), causal=True,
                                                  **FUSED),
    "jax-fused-bwd-b1-s384-h2-d64-causal": Case((1, 2, 2, 384, 384, 64), causal=True, **FUSED),
    "jax-fused-bwd-b2-s128-h2-d32": Case((2, 2, 2, 128, 128, 32), **FUSED),
    # JAX mgpu_attention_test.py (float16 -> bfloat16), 4096 tokens scaled down
    "jax-mgpu-fwd-mqa-d64-causal": Case((1, 4, 1, 512, 512, 64), causal=True, **MGPU_FWD),
    "jax-mgpu-fwd-gqa-d128": Case((1, 6, 3, 512, 512, 128), **MGPU_FWD),
    "jax-mgpu-fwd-mha-d256-causal": Case((1, 4, 4, 512, 512, 256), causal=True, **MGPU_FWD),
    "jax-mgpu-bwd-gqa-d128": Case((3, 6, 3, 512, 512, 128), **MGPU_BWD),
    "jax-mgpu-bwd-mqa-q512-kv384-d64": Case((1, 4, 1, 512, 384, 64), **MGPU_BWD),
    "jax-mgpu-bwd-mha-d256": Case((1, 4, 4, 256, 256, 256), **MGPU_BWD),
}


def _inputs(case: Case, scale_q: float):
    batch, q_heads, kv_heads, q_len, kv_len, dim = case.shape
    lead = (case.extra_batch,) if case.extra_batch else ()
    shapes = [(*lead, batch, q_heads, q_len, dim)] + [(*lead, batch, kv_heads, kv_len, dim)] * 2
    rng = np.random.default_rng(0)
    draw = (lambda s: rng.uniform(1, 2, s)) if case.uniform else rng.standard_normal
    # sm_scale other than head_dim ** -0.5: q scaled before the call (and rounded)
    return [jnp.asarray(draw(s) * (scale_q if i == 0 else 1.0), case.dtype)
            for i, s in enumerate(shapes)]


def _check(name: str, got, want, atol: float, rtol: float) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.isfinite(got).all(), f"{name}: non-finite values"
    excess = np.abs(got - want) / (atol + rtol * np.abs(want))
    assert excess.max() <= 1, (f"{name}: {int((excess > 1).sum())} elements over atol {atol:g} "
                               f"rtol {rtol:g}, worst {excess.max():.2f}x")


def _run(kernel, problem: Problem, config, inputs, extra_batch: int):
    fn = kernel.build(problem, config)
    if extra_batch:
        fn = jax.vmap(fn)
    return jax.jit(fn)(*inputs)


@pytest.mark.parametrize("kernel_name", kernel_names())
@pytest.mark.parametrize("case_id", list(CASES))
def test_peer_case(kernel_name, case_id):
    case = CASES[case_id]
    kernel = get_kernel(kernel_name)
    batch, q_heads, kv_heads, q_len, kv_len, dim = case.shape
    problem = Problem(batch, q_heads, kv_heads, q_len, kv_len, dim, case.dtype, case.causal,
                      "fwd_bwd")
    if broken := kernel.problem_violations(problem):
        pytest.skip(f"{kernel_name} cannot run {problem.label()}: {broken[0]}")
    scale_q = 1.0 if case.sm_scale is None else case.sm_scale * math.sqrt(dim)
    inputs = _inputs(case, scale_q)
    out_shape = inputs[0].shape
    lead = inputs[0].shape[:1] if case.extra_batch else ()
    truth = [np.stack(parts) if lead else parts[0] for parts in zip(*[
        float64_attention(*(x[i] if lead else x for x in inputs), np.ones(out_shape[len(lead):]),
                          causal=case.causal, sm_scale=dim ** -0.5)
        for i in range(lead[0] if lead else 1)])]
    rtol = max(case.atol / 10, 1e-6) if case.rtol is None else case.rtol
    atol_grads = case.atol_grads or (2 * case.atol,) * 3
    default = kernel.default_config(problem)
    configs = [default]
    if case.configs:
        others = [c for c in kernel.search_space(problem) if c != default]
        configs += random.Random(case_id).sample(others, min(case.configs, len(others)))
    for config in configs:
        fwd = Problem(**{**problem.to_dict(), "mode": "fwd"})
        out = _run(kernel, fwd, config, inputs, case.extra_batch)
        grads = _run(kernel, problem, config, inputs, case.extra_batch)
        _check(f"out {config.label()}", out, truth[0], case.atol, rtol)
        for name, got, want, atol in zip(("dq", "dk", "dv"), grads, truth[1:], atol_grads):
            # dq of the scaled q, back to the caller's sm_scale
            factor = scale_q if name == "dq" else 1.0
            _check(f"{name} {config.label()}", np.asarray(got, np.float64) * factor,
                   want * factor, atol, rtol)
        if case.sm_scale is None and not case.uniform:  # the gate's own kind of inputs
            for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), truth):
                bound = MAX_RELATIVE_ERROR[case.dtype]
                assert relative_error(got, want) <= bound, (
                    f"{name} {config.label()}: over the tuner's gate bound {bound:g}")


# --- inputs the issue found that the kernels mishandled -------------------------------------

@pytest.mark.parametrize("kernel_name", kernel_names())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_logits_are_as_accurate_as_xla(kernel_name, causal):
    """q x 1e4, f32: each of out, dq, dk, dv within 2x XLA's error against float64 (the
    gradients were 1e3x worse when the backward recomputed P from one saved logsumexp)."""
    kernel = get_kernel(kernel_name)
    problem = Problem(1, 2, 2, 256, 256, 64, "float32", causal, "fwd_bwd")
    if broken := kernel.problem_violations(problem):
        pytest.skip(str(broken[0]))
    q, k, v = _inputs(Case((1, 2, 2, 256, 256, 64)), 1e4)
    truth = float64_attention(q, k, v, np.ones(q.shape), causal=causal, sm_scale=0.125)
    fwd = Problem(**{**problem.to_dict(), "mode": "fwd"})
    config = kernel.default_config(problem)
    got = (jax.jit(kernel.build(fwd, config))(q, k, v),
           *jax.jit(kernel.build(problem, config))(q, k, v))
    xla = (jax.jit(kernel.reference(fwd))(q, k, v), *jax.jit(kernel.reference(problem))(q, k, v))
    for name, ours, theirs, want in zip(("out", "dq", "dk", "dv"), got, xla, truth):
        assert relative_error(ours, want) <= 2 * relative_error(theirs, want) + 1e-7, name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_logits_below_any_fixed_mask_value_stay_exact(causal):
    """Every logit about -8e30 (below the old mask value -1e30): all equal, so the output is
    the mean of the visible values, not NaN."""
    q = jnp.full((1, 1, 128, 64), -1e30, jnp.float32)
    k = jnp.ones((1, 1, 128, 64), jnp.float32)
    v = jax.random.normal(jax.random.key(1), k.shape, jnp.float32)
    out = np.asarray(flash_attention(q, k, v, causal=causal))
    counts = np.arange(1, 129)[:, None] if causal else 128
    values = np.asarray(v[0, 0])
    want = (np.cumsum(values, axis=0) / counts if causal
            else np.broadcast_to(values.mean(0), values.shape))
    np.testing.assert_allclose(out[0, 0], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kernel_name", kernel_names())
def test_runs_with_jax_enable_x64(kernel_name):
    kernel = get_kernel(kernel_name)
    problem = Problem(1, 2, 1, 128, 128, 64, "float32", True, "fwd_bwd")
    q = jax.random.normal(jax.random.key(0), (1, 2, 128, 64), jnp.float32)
    k = q[:, :1]
    with jax.enable_x64(True):
        grads = jax.jit(kernel.build(problem, kernel.default_config(problem)))(q, k, k)
    truth = float64_attention(q, k, k, np.ones(q.shape), causal=True, sm_scale=0.125)
    for got, want in zip(grads, truth[1:]):
        assert relative_error(got, want) <= MAX_RELATIVE_ERROR["float32"]


@pytest.mark.parametrize("feature", ["segment_ids", "bias", "logits_soft_cap",
                                     "sliding_window", "dropout_rate"])
def test_unsupported_features_fail_with_a_clear_error(feature):
    q = jnp.ones((1, 1, 128, 64), jnp.float32)
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{feature}'"):
        flash_attention(q, q, q, **{feature: None})
    fields = {**Problem(1, 1, 1, 128, 128, 64, "float32").to_dict(), feature: 1}
    with pytest.raises(ProblemError, match=f"unknown problem field.*{feature}"):
        Problem.from_dict(fields)
