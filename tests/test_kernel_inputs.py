"""Input validation, config resolution (explicit > table > default, fwd vs fwd_bwd) and the
kernel package's import boundaries."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import plain_sources
from kernel import ConfigError, FlashConfig, LookupTable, Problem, TableEntry, \
    dot_product_attention, flash_attention, get_kernel, reference_attention, resolution_sources
from kernel.problem import SOFTCAP_RANGE
from kernel.resolve import ResolverSettings, reset_resolver


default_config = get_kernel("flash").default_config

F32, BF16 = jnp.float32, jnp.bfloat16


def _sds(shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


GOOD_Q, GOOD_KV, LONG_KV = _sds((1, 4, 256, 64)), _sds((1, 2, 256, 64)), _sds((1, 2, 512, 64))


@pytest.mark.parametrize("q, k, v, kwargs, error, message", [
    (_sds((4, 256, 64)), GOOD_KV, GOOD_KV, {}, ValueError,
     "q must have rank 4 [batch, heads, seq, head_dim], got shape (4, 256, 64)"),
    (GOOD_Q, _sds((1, 2, 1, 256, 64)), GOOD_KV, {}, ValueError, "k must have rank 4"),
    (_sds((1, 4, 256, 64), jnp.float16), _sds((1, 2, 256, 64), jnp.float16),
     _sds((1, 2, 256, 64), jnp.float16), {}, TypeError,
     "q has dtype float16; flash_attention supports bfloat16 and float32"),
    (_sds((1, 4, 256, 64), jnp.int32), GOOD_KV, GOOD_KV, {}, TypeError, "q has dtype int32"),
    (GOOD_Q, _sds((1, 2, 256, 64), BF16), _sds((1, 2, 256, 64), BF16), {}, TypeError,
     "q, k and v must share one dtype, got float32, bfloat16, bfloat16"),
    (GOOD_Q, GOOD_KV, _sds((1, 2, 128, 64)), {}, ValueError,
     "k and v must have the same shape, got (1, 2, 256, 64) and (1, 2, 128, 64)"),
    (_sds((2, 4, 256, 64)), GOOD_KV, GOOD_KV, {}, ValueError,
     "q has batch 2 but k/v have batch 1"),
    (_sds((1, 4, 256, 128)), GOOD_KV, GOOD_KV, {}, ValueError,
     "q has head_dim 128 but k/v have head_dim 64"),
    (_sds((1, 3, 256, 64)), GOOD_KV, GOOD_KV, {}, ValueError,
     "q_heads (3) must be a multiple of kv_heads (2)"),
    # with an explicit config (without one, xla runs these: the next test)
    (_sds((1, 4, 5000, 64)), GOOD_KV, GOOD_KV, {"config": FlashConfig()}, ConfigError,
     "[seq_len] q_len=5000 admits no legal block: a sequence longer than 4096 must be a "
     "multiple of 128; pad it to 5120 and mask the padding"),
    (GOOD_Q, _sds((1, 2, 1100, 64)), _sds((1, 2, 1100, 64)), {"config": FlashConfig()},
     ConfigError,  # compute block
     "[seq_len] kv_len=1100 admits no legal block: a sequence longer than 1024 must be a "
     "multiple of 128; pad it to 1152 and mask the padding"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"config": {"block_q": 128}}, TypeError,
     "config must be a FlashConfig or None, got dict; build one with FlashConfig.from_dict"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"sm_scale": -1.0}, ValueError,
     "sm_scale must be positive and finite, got -1.0"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"sm_scale": "0.1"}, TypeError,
     "sm_scale must be a Python float (static), got '0.1'"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"causal": "yes"}, TypeError,
     "causal must be a Python bool"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"config": FlashConfig(block_kv=192, block_kv_compute=192)},
     ConfigError, "[block_divides] block_kv=192 does not divide kv_len=256"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"window": (-1, 4)}, ValueError,
     "window left side must be between 0 and"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"window": 128}, ValueError,
     "window must be a (left, right) pair of key counts, got 128"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"logits_soft_cap": 0.0}, ValueError,
     "logits_soft_cap must be positive and finite, got 0.0"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"logits_soft_cap": float("nan")}, ValueError,
     "logits_soft_cap must be positive and finite, got nan"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"logits_soft_cap": float("inf")}, ValueError,
     "logits_soft_cap must be positive and finite, got inf"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"logits_soft_cap": 10 ** 400}, ValueError,  # OverflowError
     "logits_soft_cap must be positive and finite, got an integer too large for a float"),
    # Issue 62 item 5: float32 rounds these to inf and to 0: every output was NaN.
    (GOOD_Q, GOOD_KV, GOOD_KV, {"logits_soft_cap": 1e300}, ValueError,
     "logits_soft_cap must be positive and finite (logits become softcap * tanh(logits / "
     "softcap)), got 1e+300; the kernels apply it in float32, where it must lie from 1e-30 to "
     "1e+30 (beyond, outputs or gradients are NaN)"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"logits_soft_cap": 1e-300}, ValueError,
     "logits_soft_cap must be positive and finite (logits become softcap * tanh(logits / "
     "softcap)), got 1e-300"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"logits_soft_cap": "50"}, TypeError,
     "logits_soft_cap must be a Python float (static), got '50'"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"segment_ids": _sds((1, 256), jnp.int32)}, TypeError,
     "segment_ids must be a pair (q_segment_ids, kv_segment_ids) as a tuple or list, got "
     "ShapeDtypeStruct"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"segment_ids": (_sds((1, 256), jnp.int32),
                                                _sds((1, 128), jnp.int32))}, ValueError,
     "segment_ids: kv_segment_ids must have shape [batch, kv_len] = (1, 256), got (1, 128)"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"segment_ids": (_sds((256,), jnp.int32),
                                                _sds((1, 256), jnp.int32))}, ValueError,
     "segment_ids: q_segment_ids must have shape [batch, q_len] = (1, 256), got (256,)"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"segment_ids": (_sds((1, 256)), _sds((1, 256)))}, TypeError,
     "segment_ids: q_segment_ids must be integers (one id per document), got dtype float32"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"segment_ids": {"q": _sds((1, 256), jnp.int32),
                                                "kv": _sds((1, 256), jnp.int32)}}, TypeError,
     "segment_ids must be a pair (q_segment_ids, kv_segment_ids) as a tuple or list, got "
     "dict; pass segment_ids=(ids['q'], ids['kv'])"),
    # Issue 73: decode, chunked prefill and speculative decode were silently top-left.
    (GOOD_Q, LONG_KV, LONG_KV, {"causal": True}, ValueError,
     "causal=True with q_len 256 != kv_len 512 has two readings; pass "
     "alignment='bottom_right' when the queries are the last q_len tokens (query i at position "
     "i + kv_len - q_len: decode, chunked prefill, speculative decode) or alignment='top_left' "
     "for query i at position i (jax.nn.dot_product_attention's is_causal)"),
    (GOOD_Q, LONG_KV, LONG_KV, {"window": (64, 64)}, ValueError,
     "window=(64, 64) with q_len 256 != kv_len 512 has two readings"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"causal": True, "alignment": "bottom"}, ValueError,
     "alignment must be one of top_left, bottom_right, got 'bottom'"),
    (GOOD_Q, GOOD_KV, GOOD_KV, {"segment_ids": (np.zeros((1, 256), np.int64),
                                                np.full((1, 256), 2**32, np.int64))},
     ValueError, "segment_ids: kv_segment_ids holds ids from 4294967296 to 4294967296, "
     "outside int32 (-2147483648 to 2147483647)"),
], ids=["rank-q", "rank-k", "float16", "int32", "mixed-dtypes", "kv-shapes", "batch",
        "head-dim", "heads", "no-legal-block", "no-compute-block", "config-type",
        "sm-scale-negative", "sm-scale-str", "causal-type", "illegal-config",
        "window-negative", "window-not-a-pair", "soft-cap-zero", "soft-cap-nan", "soft-cap-inf",
        "soft-cap-overflow", "soft-cap-past-float32", "soft-cap-below-float32",
        "soft-cap-str", "segment-ids-not-a-pair", "segment-ids-shape", "segment-ids-rank",
        "segment-ids-float", "segment-ids-dict", "causal-alignment-unnamed",
        "window-alignment-unnamed", "alignment-unknown", "segment-ids-past-int32"])
def test_bad_input_gets_a_clear_error(q, k, v, kwargs, error, message):
    with pytest.raises(error) as raised:
        jax.eval_shape(lambda q, k, v: flash_attention(q, k, v, **kwargs), q, k, v)
    assert message in str(raised.value)


def test_the_soft_caps_range_keeps_xlas_gradients_finite_where_float32s_does_not():
    """Issue 62 item 5: why the range ends at 1e30, not at float32's largest number: autodiff
    of ``cap * tanh(logits / cap)`` multiplies the cap by the logits' cotangent."""
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, 2, 256, 128), F32) for key in keys)

    def finite_gradients(cap):
        grads = jax.grad(lambda *a: reference_attention(*a, softcap=cap).sum(),
                         argnums=(0, 1, 2))(q, k, v)
        return all(bool(jnp.isfinite(g).all()) for g in grads)

    assert all(finite_gradients(cap) for cap in SOFTCAP_RANGE)
    assert not finite_gradients(float(np.finfo(np.float32).max))


def test_traced_segment_ids_wider_than_int32_are_refused():
    """Under jax_enable_x64 a jitted step's int64 ids reach the wrapper traced, their values
    unknown: cast to int32, 0 and 2**32 would be one segment (it ran, silently wrong)."""
    ids = np.array([[0] * 128 + [2**32] * 128])
    q = jnp.zeros((1, 2, 256, 64), F32)
    with jax.enable_x64(True), pytest.raises(TypeError, match=re.escape(
            "segment_ids: q_segment_ids is a traced int64 array (jax_enable_x64 is on)")):
        jax.jit(lambda q, ids: flash_attention(q, q, q, segment_ids=(ids, ids)))(q, ids)


def test_a_shape_the_kernel_has_no_block_for_runs_xla_with_one_warning(caplog):
    """Without an explicit config, a trace does not fail: the warning says how to pad."""
    import logging

    caplog.set_level(logging.WARNING, logger="kernel.resolve")
    reset_resolver(ResolverSettings())
    try:
        keys = jax.random.split(jax.random.key(3), 3)
        q, k, v = (jax.random.normal(key, (1, 2, 1100, 64), F32) for key in keys)
        for _ in range(2):
            got = jax.jit(flash_attention)(q, k, v)
        want = reference_attention(q, k, v)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
        [(key, source)] = plain_sources(resolution_sources()).items()
        assert key[0] == "xla" and source.startswith("xla (no tunable config); kernel: fallback")
        [warning] = [r.getMessage() for r in caplog.records if "instead of flash" in
                     r.getMessage()]
        assert "pad it to 1152" in warning
    finally:
        reset_resolver(ResolverSettings())


@pytest.mark.parametrize(("shapes", "message"), [
    (((1, 2, 256, 4, 64),) * 3, "query must have rank 4 [batch, seq, heads, head_dim] or rank "
     "3 [seq, heads, head_dim], got shape (1, 2, 256, 4, 64)"),
    (((256, 4, 64), (1, 2, 256, 4, 64), (256, 4, 64)),
     "key must have the query's rank 3 [seq, heads, head_dim], got shape (1, 2, 256, 4, 64)"),
    (((1, 256, 4, 64), (1, 256, 4, 64), (256, 4, 64)),
     "value must have the query's rank 4 [batch, seq, heads, head_dim], got shape "
     "(256, 4, 64)"),
], ids=["rank-5-query", "rank-3-query-rank-5-key", "rank-4-query-rank-3-value"])
def test_dot_product_attention_reports_the_callers_shape(shapes, message):
    """A rank-5 query is refused as rank 5, and a key or value of another rank than the
    query's by its own shape (not as the shapes the batching of a rank-3 call would make)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        jax.eval_shape(dot_product_attention, *map(_sds, shapes))


def test_non_array_input_is_refused():
    k = jnp.zeros((1, 2, 128, 64))
    with pytest.raises(TypeError, match="q must be a jax array, got list"):
        flash_attention([[1.0]], k, k)


def _pallas_grids(fn, *args) -> dict[str, tuple[int, ...]]:
    """Grid of every Pallas kernel in ``fn``'s jaxpr, by kernel name."""
    grids = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                name = getattr(eqn.params["name"], "name", eqn.params["name"])
                grids[str(name)] = tuple(eqn.params["grid_mapping"].grid)
            for value in eqn.params.values():
                for item in value if isinstance(value, tuple | list) else (value,):
                    inner = getattr(item, "jaxpr", item)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return grids


# A GQA problem: batch 1, 4 query heads over 2 kv heads, 512 queries, 256 keys.
Q, KV = _sds((1, 4, 512, 64)), _sds((1, 2, 256, 64))
FWD = Problem(batch=1, q_heads=4, kv_heads=2, q_len=512, kv_len=256, head_dim=64,
              dtype="float32", causal=True, mode="fwd")
FWD_BWD = Problem(**{**FWD.to_dict(), "mode": "fwd_bwd"})


def _forward(**kwargs):
    return lambda q, k, v: flash_attention(q, k, v, causal=True, alignment="top_left", **kwargs)


def _gradients(**kwargs):
    return jax.grad(lambda q, k, v: _forward(**kwargs)(q, k, v).sum(), argnums=(0, 1, 2))


def _grids(config: FlashConfig, with_backward: bool) -> dict[str, tuple[int, ...]]:
    """The outer grids the config gives (the streamed operands' blocks are pipelined inside
    each step): forward and dQ over query blocks, dK/dV over key blocks."""
    grids = {"flash_fwd": (1, 4, 512 // config.block_q)}
    if with_backward:
        grids["flash_bwd_dkv"] = (1, 2, 256 // config.block_kv_dkv)
        grids["flash_bwd_dq"] = (1, 4, 512 // config.block_q_dq)
    return grids


@pytest.fixture
def fresh_resolver():
    """A resolver with no table and no service; the environment's one is restored after."""
    yield lambda **settings: reset_resolver(ResolverSettings(**settings))
    reset_resolver()


def test_default_config_resolved_per_mode(fresh_resolver):
    """A plain call resolves the fwd-tuned config; a differentiated one the fwd_bwd one."""
    fresh_resolver()
    assert _pallas_grids(_forward(), Q, KV, KV) == _grids(default_config(FWD), False)
    assert plain_sources(resolution_sources()) == {("flash", "cpu", FWD): "default"}
    assert _pallas_grids(_gradients(), Q, KV, KV) == _grids(default_config(FWD_BWD), True)
    assert plain_sources(resolution_sources()) == {("flash", "cpu", FWD): "default", ("flash", "cpu", FWD_BWD): "default"}


def _table(tmp_path, *entries: tuple[Problem, FlashConfig]) -> str:
    table = LookupTable(kernel="flash", kernel_version="1", device_kind="cpu",
                        entries=tuple(TableEntry(p, c) for p, c in entries))
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table.to_dict()))
    return str(path)


FWD_TUNED = FlashConfig(block_q=128, block_kv=256, block_kv_compute=128)
FWD_BWD_TUNED = FlashConfig(block_q=256, block_kv=128, block_kv_compute=128, block_q_dkv=128,
                            block_kv_dkv=256, block_q_dq=512, block_kv_dq=128, pipeline_depth=1)


def test_pinned_table_wins_over_default_and_explicit_wins_over_table(fresh_resolver, tmp_path):
    fresh_resolver(table_paths=(_table(tmp_path, (FWD, FWD_TUNED), (FWD_BWD, FWD_BWD_TUNED)),))
    assert _pallas_grids(_forward(), Q, KV, KV) == _grids(FWD_TUNED, False)
    assert _pallas_grids(_gradients(), Q, KV, KV) == _grids(FWD_BWD_TUNED, True)
    assert plain_sources(resolution_sources()) == {("flash", "cpu", FWD): "table", ("flash", "cpu", FWD_BWD): "table"}

    explicit = FlashConfig(block_q=512, block_kv=128, block_kv_compute=128, block_q_dkv=512,
                           block_kv_dkv=128, block_q_dq=128, block_kv_dq=256)
    assert _pallas_grids(_forward(config=explicit), Q, KV, KV) == _grids(explicit, False)
    assert _pallas_grids(_gradients(config=explicit), Q, KV, KV) == _grids(explicit, True)


def test_resolved_config_that_breaks_a_rule_falls_back_to_the_default(fresh_resolver, tmp_path):
    illegal = FlashConfig(block_q=384, block_kv=128, block_kv_compute=128)
    fresh_resolver(table_paths=(_table(tmp_path, (FWD, illegal)),))
    assert _pallas_grids(_forward(), Q, KV, KV) == _grids(default_config(FWD), False)


def test_jitted_call_resolves_at_trace_time_only(fresh_resolver):
    fresh_resolver()
    fn = jax.jit(_forward())
    q, k = jnp.ones(Q.shape, F32), jnp.ones(KV.shape, F32)
    np.testing.assert_allclose(np.asarray(fn(q, k, k)), 1.0)
    assert plain_sources(resolution_sources()) == {("flash", "cpu", FWD): "default"}
    fresh_resolver()  # a new, empty resolver: a per-call lookup would show up in it
    fn(q, k, k)
    assert plain_sources(resolution_sources()) == {}


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)


def test_import_kernel_does_not_import_jax():
    result = _python("import sys, kernel; kernel.FlashConfig(); kernel.get_kernel('flash'); "
                     "print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax'))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_kernel_never_imports_the_service_stack():
    code = """
import sys
import jax.numpy as jnp
import kernel
q = jnp.ones((1, 2, 128, 64), jnp.float32)
out = kernel.flash_attention(q, q, q, causal=True)
flash = kernel.get_kernel("flash").discover()
flash.search_space(kernel.Problem(1, 2, 2, 128, 128, 64, "float32", True, "fwd_bwd"))
assert out.shape == q.shape
print(sorted({m.split('.')[0] for m in sys.modules}
             & {"storage", "api", "autotune", "optuna", "fastapi", "sqlalchemy", "httpx"}))
"""
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- windows, soft caps and segment ids: the problem, and the kernel that runs it ------------

FEATURED = Problem(1, 2, 1, 128, 128, 64, "float32", causal=True)
WINDOWED = FEATURED.__class__(**{**FEATURED.to_dict(), "window": (32, 0)})
SEGMENTED = FEATURED.__class__(**{**FEATURED.to_dict(), "segmented": True})
CAPPED = FEATURED.__class__(**{**FEATURED.to_dict(), "causal": False, "softcap": 20.0})


def _choice_table(tmp_path, problem: Problem, ranked: list[str]) -> str:
    """A pinned table whose one kernel choice for ``problem`` ranks ``ranked``."""
    from kernel.table import TABLE_SCHEMA_VERSION

    table = {"schema_version": TABLE_SCHEMA_VERSION, "kernel": "flash", "kernel_version": "1",
             "device_kind": "cpu", "entries": [], "choices": [{
                 "problem": problem.to_dict(), "kernel": ranked[0], "config": {},
                 "candidates": {name: {"median_ms": float(i + 1), "iqr_ms": 0.0}
                                for i, name in enumerate(ranked)}}]}
    path = tmp_path / "choice.json"
    path.write_text(json.dumps(table))
    return str(path)


def _featured_call(problem: Problem):
    """``flash_attention`` on ``problem`` (jitted), its features as arguments, and its error
    against the reference."""
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (1, 2, 128, 64), F32)
    k, v = (jax.random.normal(key, (1, 1, 128, 64), F32) for key in keys[1:])
    ids = jnp.asarray([[1] * 50 + [2] * 60 + [0] * 18])
    segment_ids = (ids, ids) if problem.segmented else None
    got = jax.jit(lambda q, k, v: flash_attention(
        q, k, v, causal=problem.causal, window=problem.window,
        logits_soft_cap=problem.softcap, segment_ids=segment_ids))(q, k, v)
    want = reference_attention(q, k, v, *(segment_ids or ()), causal=problem.causal,
                               window=problem.window, softcap=problem.softcap)
    return float(jnp.max(jnp.abs(got - want)))


@pytest.mark.parametrize(("problem", "ranked", "runs", "rule"), [
    # upstream's TPU kernel has no window, pallas_gpu no segment ids: the next best runs
    (WINDOWED, ["jax_tpu_flash", "splash"], "splash", "[window]"),
    (SEGMENTED, ["pallas_gpu", "jax_tpu_flash"], "jax_tpu_flash", "[segment_ids]"),
    # none ranked can: the always-safe xla
    (CAPPED, ["pallas_gpu", "jax_tpu_flash"], "xla", "[softcap]"),
], ids=["window", "segment-ids", "soft-cap"])
def test_a_featured_call_runs_the_next_best_kernel_that_implements_it(
        fresh_resolver, tmp_path, problem, ranked, runs, rule):
    fresh_resolver(table_paths=(_choice_table(tmp_path, problem, ranked),))
    assert _featured_call(problem) < 1e-5
    [(key, source)] = plain_sources(resolution_sources()).items()
    assert key[0] == runs and "next best" in source and rule in source, source
    assert (key[2].window, key[2].softcap, key[2].segmented) == (
        problem.window, problem.softcap, problem.segmented)  # what the capture records


@pytest.mark.parametrize("problem", [WINDOWED, SEGMENTED], ids=["window", "segment-ids"])
def test_a_platform_kernel_that_lacks_a_feature_falls_back_to_xla(problem):
    """Without a choice, AUTOTUNE_TPU_KERNEL's kernel runs on a TPU unless it cannot run the
    problem: upstream's TPU kernel runs segment ids natively, not windows."""
    from kernel.resolve import Resolver
    from kernel.targets import device_target

    resolver = Resolver(ResolverSettings(tpu_kernel="jax_tpu_flash"))
    pick = resolver.pick(problem, "TPU v5 lite", "tpu", device_target("tpu", "TPU v5 lite"))
    if not problem.window:
        assert (pick.kernel.name, pick.by) == ("jax_tpu_flash", "")
    else:
        assert pick.kernel.name == "xla" and pick.by.startswith("fallback") and (
            "[window] kernel 'jax_tpu_flash' does not implement a sliding window" in pick.by)


def test_the_capture_records_a_calls_features(fresh_resolver):
    """A Gemma-2-style local layer's training step, traced abstractly: the captured problem
    (both modes) carries its window and soft cap. (Segment ids: once the platform's kernel,
    which a capture resolves, takes them; the routing tests above show they are recorded.)"""
    import kernel

    fresh_resolver()
    q, kv = _sds((2, 4, 256, 64)), _sds((2, 2, 256, 64))

    def loss(q, k, v):
        return flash_attention(q, k, v, causal=True, window=(127, 0), logits_soft_cap=50.0).sum()

    with kernel.capture() as problems:
        jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
    assert [(p.mode, p.window, p.softcap, p.segmented) for p in problems] == [
        ("fwd_bwd", (127, 0), 50.0, False)]  # a differentiated call: its training problem


# --- valid KV lengths per row (issue 73 item 6) ---------------------------------------------

# (q_len, kv_len, lengths, causal, alignment): decode, a prefill chunk (a row shorter than its
# queries: its first queries see no key), top-left over padded rows, no mask.
LENGTHS = {"decode": (1, 256, [256, 100, 7, 1], True, "bottom_right"),
           "chunked-prefill": (64, 256, [256, 130, 64, 10], True, "bottom_right"),
           "top-left": (64, 256, [256, 130, 64, 10], True, "top_left"),
           "full": (64, 256, [256, 130, 64, 10], False, None)}


def _lengths_inputs(q_len: int, kv_len: int) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(keys[0], (4, 2, q_len, 64), F32)
    k, v = (jax.random.normal(key, (4, 1, kv_len, 64), F32) for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], q.shape, F32)


def _rowwise_reference(q, k, v, lengths, causal, alignment):
    """Each row on its own valid keys only, its queries placed by ``alignment``."""
    q_len = q.shape[2]
    return jnp.concatenate([reference_attention(
        q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], causal=causal,
        query_offset=n - q_len if alignment == "bottom_right" else 0)
        for b, n in enumerate(lengths)])


@pytest.mark.parametrize("case", LENGTHS)
def test_kv_lengths_match_each_row_on_its_valid_keys(fresh_resolver, case):
    """Forward and all three gradients through the wrapper (flash, interpreted): each row as
    if its cache held its valid keys only; padding keys get no gradient."""
    fresh_resolver()
    q_len, kv_len, lengths, causal, alignment = LENGTHS[case]
    q, k, v, d_out = _lengths_inputs(q_len, kv_len)

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v) * d_out)

    ours = functools.partial(flash_attention, causal=causal, alignment=alignment,
                             kv_lengths=jnp.asarray(lengths, jnp.int32))
    theirs = functools.partial(_rowwise_reference, lengths=lengths, causal=causal,
                               alignment=alignment)
    got = jax.jit(ours)(q, k, v), *jax.jit(jax.grad(loss(ours), (0, 1, 2)))(q, k, v)
    want = theirs(q, k, v), *jax.grad(loss(theirs), (0, 1, 2))(q, k, v)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=name)


@pytest.mark.parametrize("ranked", [["xla"], ["splash"]], ids=["xla", "splash"])
def test_kv_lengths_run_on_every_kernel_that_takes_segment_ids_and_bottom_right(
        fresh_resolver, tmp_path, ranked):
    q_len, kv_len, lengths, causal, alignment = LENGTHS["chunked-prefill"]
    problem = Problem(4, 2, 1, q_len, kv_len, 64, "float32", causal=True, segmented=True,
                      bottom_right=True)
    fresh_resolver(table_paths=(_choice_table(tmp_path, problem, ranked),))
    q, k, v, _ = _lengths_inputs(q_len, kv_len)
    got = jax.jit(functools.partial(flash_attention, causal=True, alignment=alignment,
                                    kv_lengths=jnp.asarray(lengths, jnp.int32)))(q, k, v)
    [(key, _)] = plain_sources(resolution_sources()).items()
    assert key[0] == ranked[0] and key[2] == problem
    want = _rowwise_reference(q, k, v, lengths, True, alignment)
    seen = np.arange(q_len)[None, :] >= q_len - np.asarray(lengths)[:, None]  # splash: average
    np.testing.assert_allclose(np.asarray(got)[seen[:, None].repeat(2, 1)],
                               np.asarray(want)[seen[:, None].repeat(2, 1)], atol=2e-5)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"kv_lengths": np.array([1, 2])}, ValueError,
     "kv_lengths must have shape [batch] = (1,), got (2,)"),
    ({"kv_lengths": np.array([1.5])}, TypeError,
     "kv_lengths must be integers (valid keys per row), got dtype float64; cast them"),
    ({"kv_lengths": np.array([300])}, ValueError,
     "kv_lengths holds lengths from 300 to 300, outside 0 to kv_len=256"),
    ({"kv_lengths": [3]}, TypeError, "kv_lengths must be a jax array, got list"),
    ({"kv_lengths": np.array([3]), "causal": True}, ValueError,
     "causal=True with kv_lengths has two readings; pass alignment='bottom_right' when the "
     "queries are the last q_len tokens (query i at position i + kv_lengths[b] - q_len"),
    ({"kv_lengths": np.array([3]), "segment_ids": (np.ones((1, 256), np.int32),) * 2},
     ValueError, "kv_lengths and segment_ids cannot be combined"),
], ids=["shape", "float", "past-kv-len", "list", "alignment-unnamed", "with-segment-ids"])
def test_bad_kv_lengths_get_a_clear_error(kwargs, error, message):
    with pytest.raises(error) as raised:
        jax.eval_shape(lambda q, k, v: flash_attention(q, k, v, **kwargs), GOOD_Q, GOOD_KV,
                       GOOD_KV)
    assert message in str(raised.value)
