"""The rpa backend (JAX's ragged paged attention) on a CPU: its legal space and every rule, the
VMEM estimate against deviceless v5e compiles, a default legal on every key of issue 73's grid,
upstream's heads per block and table read as JAX reads them, the batch compositions a trial
measures, the measured program traced on a deviceless v5e, and the gate's float32 reference
against upstream's. The kernel itself runs on a TPU only (docs/serving.md, "What a CPU can
check")."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as upstream
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

from kernel import ConfigError
from kernel.aot import topology_device
from kernel.backends.rpa import (
    FALLBACK,
    RpaConfig,
    batch_compositions,
    batch_inputs,
    heads_per_block,
    jax_key,
    vmem_estimate,
)
from kernel.registry import SERVING_KERNELS, get_kernel
from kernel.serving import ServingProblem
from kernel.targets import MiB

RPA = SERVING_KERNELS["rpa"].discover()

# Issue 73's grid, per chip: (q heads, kv heads, head_dim, window, softcap).
MODELS = {"Llama-3-8B": (32, 8, 128, None, None), "Llama-3-70B TP8": (8, 1, 128, None, None),
          "Qwen2-7B": (28, 4, 128, None, None), "Gemma-2-9B local": (16, 8, 256, 4096, 50.0),
          "Mistral-7B": (32, 8, 128, 4096, None)}
PAGE_SIZES = (16, 32, 64, 128)
MAX_MODEL_LENS = (2048, 8192, 32768)
TOKENS = (512, 2048, 8192)


def _serving(model: str, page_size: int, max_model_len: int, tokens: int,
             seqs: int = 64) -> ServingProblem:
    q_heads, kv_heads, head_dim, window, softcap = MODELS[model]
    return ServingProblem(q_heads, kv_heads, head_dim, page_size, max_model_len // page_size,
                          tokens, seqs, window=window, softcap=softcap)


GRID = [_serving(*key) for key in itertools.product(MODELS, PAGE_SIZES, MAX_MODEL_LENS, TOKENS)]
LLAMA = _serving("Llama-3-8B", 16, 2048, 512)

# Deviceless v5e compiles (kernel.aot.compile_for_target) of the Llama-3-8B key above, page 16,
# 128 pages a sequence, 512 tokens, 64 sequences (docs/serving.md): whether each compiled.
V5E_COMPILES = {(8, 32): True, (128, 32): False, (128, 256): False}
# Peak scoped VMEM of configs of five grid problems, deviceless v5e (bench/kernels/rpa_vmem_sizes.py).
V5E_PEAKS = Path(__file__).resolve().parent.parent / "bench/kernels/data/rpa_vmem/v5e.jsonl"


def test_serving_backends_are_apart_from_the_attention_ones():
    assert RPA.problem_type is ServingProblem
    with pytest.raises(ConfigError, match="runs a serving step.*choose one of flash"):
        get_kernel("rpa")


def test_every_config_of_the_space_is_legal_or_names_its_rules():
    problem = dataclasses.replace(LLAMA, pages_per_seq=100, max_num_batched_tokens=300)
    params = RPA.space_params(problem)
    assert params["num_kv_pages_per_block"][-1] == 100 and 64 in params["num_kv_pages_per_block"]
    assert params["num_queries_per_block"][-1] == 300 and 256 in params["num_queries_per_block"]
    legal = RPA.search_space(problem, "v5e")
    assert legal and RPA.default_config(problem, "v5e") in legal
    for values in itertools.product(*params.values()):
        config = RpaConfig(*values)
        rules = {v.rule for v in RPA.violations(problem, config, "v5e")}
        assert (config in legal) == (not rules)
        assert rules <= {"vmem", "vmem_limit_unneeded"}, rules  # sizes the other rules admit
    # one VMEM limit per block pair, the smallest that holds it: no two trials of one kernel
    blocks = [(c.num_kv_pages_per_block, c.num_queries_per_block) for c in legal]
    assert len(blocks) == len(set(blocks))
    assert {c.vmem_limit_mib for c in legal} == {None, 32, 64}


@pytest.mark.parametrize(("changes", "rule"), [
    (dict(num_kv_pages_per_block=129), "kv_pages_range"),
    (dict(num_queries_per_block=1024), "queries_max"),
    (dict(num_queries_per_block=48), "queries_pow2"),
    (dict(num_kv_pages_per_block=128), "vmem"),
    (dict(vmem_limit_mib=64), "vmem_limit_unneeded"),
])
def test_each_rule_refuses_and_names_the_fix(changes, rule):
    config = RpaConfig(8, 32).replace(**changes)
    broken = RPA.violations(LLAMA, config, "v5e")
    assert [v.rule for v in broken] == [rule]
    assert "use" in broken[0].message or "must" in broken[0].message


def test_the_whole_token_budget_is_a_legal_query_block():
    odd = dataclasses.replace(LLAMA, max_num_batched_tokens=100)
    assert not RPA.violations(odd, RpaConfig(8, 100), "v5e")


def test_heads_upstream_cannot_tile_are_a_problem_rule():
    problem = dataclasses.replace(LLAMA, q_heads=30, kv_heads=6)  # 12 combined bf16 heads
    assert [v.rule for v in RPA.problem_violations(problem)] == ["heads_tiling"]
    with pytest.raises(ValueError, match="can not be XLA fully tiled"):
        upstream.get_min_heads_per_blk(30, 12, jnp.bfloat16, jnp.bfloat16)
    with pytest.raises(ConfigError, match="heads_tiling"):
        RPA.check_problem(problem)


def test_x64_is_refused_while_on():
    with jax.enable_x64(True):
        assert "x64" in {v.rule for v in RPA.violations(LLAMA, RpaConfig(8, 32), "v5e")}
    assert not RPA.violations(LLAMA, RpaConfig(8, 32), "v5e")


def test_a_vmem_limit_raises_what_the_estimate_is_checked_against():
    config = RpaConfig(128, 32)
    assert vmem_estimate(LLAMA, config) > 16 * MiB
    assert [v.rule for v in RPA.violations(LLAMA, config, "v5e")] == ["vmem"]
    assert not RPA.violations(LLAMA, config.replace(vmem_limit_mib=64), "v5e")
    assert [v.rule for v in RPA.violations(LLAMA, config.replace(vmem_limit_mib=32),
                                           "v4")] == ["vmem_limit"]  # a v4 core has 16 MiB
    assert not RPA.violations(LLAMA, config, "cpu")  # interpreted: no VMEM


@pytest.mark.parametrize(("blocks", "compiles"), V5E_COMPILES.items())
def test_the_estimate_agrees_with_deviceless_v5e_compiles(blocks, compiles):
    config = RpaConfig(*blocks)
    assert RPA.is_legal(LLAMA, config, "v5e") == compiles, vmem_estimate(LLAMA, config) / MiB


def test_the_estimate_bounds_every_measured_peak():
    """Precision 1.0 (no config admitted that the compiler refuses, at any limit measured: the
    estimate is at least each peak) and recall at the v5e's 16 MiB of at least 0.9."""
    points = [json.loads(line) for line in V5E_PEAKS.read_text().splitlines()]
    fitting = admitted = 0
    for point in points:
        problem, config = ServingProblem(**point["problem"]), RpaConfig(**point["config"])
        assert vmem_estimate(problem, config) >= point["peak_bytes"], point
        fitting += point["peak_bytes"] <= 16 * MiB
        admitted += RPA.is_legal(problem, config, "v5e")
    assert len(points) >= 30 and admitted >= 0.9 * fitting


def test_heads_per_block_is_upstreams():
    for problem in GRID[::len(PAGE_SIZES) * len(MAX_MODEL_LENS) * len(TOKENS)]:
        for dtype, kv_dtype in itertools.product(("bfloat16", "float32"), repeat=2):
            typed = dataclasses.replace(problem, dtype=dtype, kv_dtype=kv_dtype)
            assert heads_per_block(typed) == upstream.get_min_heads_per_blk(
                typed.q_heads, 2 * typed.kv_heads, jnp.dtype(dtype), jnp.dtype(kv_dtype))


def test_jax_config_is_jaxs_table_entry_clamped_else_its_fallback():
    v5 = tuned_block_sizes.TUNED_BLOCK_SIZES["TPU v5"]
    found = 0
    for problem in GRID:
        key = tuned_block_sizes.simplify_key(jax_key(problem))
        pages, queries = v5.get(key, FALLBACK)
        found += key in v5
        assert RPA.jax_config(problem, "v5e") == RpaConfig(
            min(pages, problem.pages_per_seq), min(queries, problem.max_num_batched_tokens))
    assert found  # the grid meets JAX's table
    qwen = _serving("Qwen2-7B", 16, 2048, 512)  # 28/4 heads: looked up as 32/4, always a miss
    assert RPA.jax_config(qwen, "v5e") == RpaConfig(*FALLBACK)
    assert RPA.jax_config(LLAMA, "v4") == RpaConfig(32, 32)  # JAX's v4 fallback


def test_head_dims_other_than_128_are_a_problem_rule():
    """Gemma-2's head_dim 256 does not compile (deviceless v5e, JAX 0.10.2): no config can."""
    gemma = _serving("Gemma-2-9B local", 16, 2048, 512)
    assert [v.rule for v in RPA.problem_violations(gemma)] == ["head_dim"]
    assert not RPA.search_space(gemma, "v5e")


@pytest.mark.parametrize("target", ["v5e", "v5p", "v6e", "v4"])
def test_the_default_is_legal_on_every_grid_key(target):
    shrunk = 0
    for problem in GRID:
        if problem.head_dim != 128:  # Gemma-2: a problem rule (the test above)
            continue
        default = RPA.default_config(problem, target)
        assert not RPA.violations(problem, default, target), (problem, default)
        shrunk += default != RPA.jax_config(problem, target)
        known = {RPA.jax_config(problem, target), RPA.table_entry(problem, target)}
        seeds = RPA.seed_configs(problem, target)
        assert set(seeds) <= known and len(seeds) == len(set(seeds))
        assert all(RPA.is_legal(problem, seed, target) for seed in seeds)
    if target == "v5e":
        assert shrunk  # JAX's own choice overflows some keys there


def test_without_jaxs_table_the_default_starts_from_the_fallback():
    bare = SERVING_KERNELS["rpa"]  # not discovered: the service's view
    assert bare.jax_config(LLAMA, "v5e") == RpaConfig(*FALLBACK)
    assert not bare.violations(LLAMA, bare.default_config(LLAMA, "v5e"), "v5e")


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, 20.0)])
def test_the_gates_reference_is_upstreams_on_every_batch(window, softcap):
    """The gate's reference (``RPA.reference``: ours, jitted, per batch composition) against
    upstream's eager ``ref_ragged_paged_attention`` in float32 on each batch; rows past a
    batch's tokens are zero."""
    problem = ServingProblem(4, 2, 128, page_size=4, pages_per_seq=6, max_num_batched_tokens=12,
                             max_num_seqs=3, dtype="float32", kv_dtype="float32", window=window,
                             softcap=softcap)
    inputs = RPA.example_inputs(problem, seed=3)
    outputs = jax.jit(RPA.reference(problem))(*inputs)
    assert len(outputs) == len(batch_compositions(problem)) == 4
    for index, out in enumerate(outputs):
        batch = batch_inputs(inputs, index)
        want = upstream.ref_ragged_paged_attention(*batch, sm_scale=problem.head_dim ** -0.5,
                                                   sliding_window=window, soft_cap=softcap)
        used = want.shape[0]
        assert out.shape == (12, 4, 128) and out.dtype == jnp.float32
        np.testing.assert_allclose(out[:used], want, rtol=1e-5, atol=1e-5)
        assert not np.asarray(out[used:]).any()


SERVING_CASES = [LLAMA, _serving("Llama-3-8B", 16, 2048, 8192, seqs=256),
                 _serving("Llama-3-70B TP8", 64, 32768, 2048, seqs=32),
                 _serving("Qwen2-7B", 128, 8192, 512, seqs=1)]


@pytest.mark.parametrize("problem", SERVING_CASES, ids=lambda p: p.label())
def test_the_batch_compositions_fill_the_budget_within_the_problems_limits(problem):
    """Decode at a short and at the full length, prefill chunks and a mixed batch, a pure
    function of the problem: every sequence's queries within its kv_len within max_model_len,
    at most max_num_seqs of them, the prefill and mixed batches filling the token budget."""
    compositions = batch_compositions(problem)
    assert compositions == batch_compositions(dataclasses.replace(problem))
    by_name = {c.name: c for c in compositions}
    assert list(by_name) == ["decode_short", "decode_long", "prefill", "mixed"]
    tokens, seqs, longest = (problem.max_num_batched_tokens, problem.max_num_seqs,
                             problem.max_model_len)
    for composition in compositions:
        assert 1 <= composition.seqs <= seqs and composition.tokens <= tokens
        assert all(1 <= q_len <= kv_len <= longest for q_len, kv_len in composition.lengths())
    decoding = min(seqs, tokens)
    assert by_name["decode_short"].groups == ((decoding, 1, longest // 16),)
    assert by_name["decode_long"].groups == ((decoding, 1, longest),)
    for name in ("prefill", "mixed"):
        assert by_name[name].tokens == min(tokens, seqs * longest)
    assert {q_len for q_len, _ in by_name["mixed"].lengths()} > {1} or seqs == 1
    assert RPA.compositions(problem) == [c.to_dict() for c in compositions]
    json.dumps(RPA.compositions(problem))  # stored as JSON


def test_the_measured_inputs_hold_each_batch_as_upstream_validates_it():
    problem = dataclasses.replace(LLAMA, pages_per_seq=8, max_num_batched_tokens=64,
                                  max_num_seqs=16)
    inputs = RPA.example_inputs(problem, seed=1)
    specs = RPA.input_specs(problem)
    assert [(x.shape, x.dtype) for x in inputs] == [(s.shape, s.dtype) for s in specs]
    call = [(s.shape, s.dtype) for s in RPA.call_specs(problem)]
    for index, composition in enumerate(batch_compositions(problem)):
        batch = batch_inputs(inputs, index)
        assert [(x.shape, x.dtype) for x in batch] == call
        upstream.dynamic_validate_inputs(*batch)  # raises on a malformed batch
        assert int(batch[4][batch[5][0]]) == composition.tokens


def test_the_measured_program_runs_the_kernel_once_per_batch_on_a_v5e():
    """``build`` traced abstractly on a deviceless v5e: one output per batch composition, in
    the kernel's layout and dtype; a config the chip refuses is refused before it traces."""
    device = topology_device("v5e")
    with jax.default_device(device):
        outputs = jax.eval_shape(RPA.build(LLAMA, RpaConfig(8, 32)),
                                 *RPA.input_specs(LLAMA, device))
    assert [(o.shape, o.dtype) for o in outputs] == [((512, 32, 128), jnp.bfloat16)] * 4
    with pytest.raises(ConfigError, match="kv_pages_range"):
        RPA.build(LLAMA, RpaConfig(256, 32))


# What JAX's TPU interpreter raises on the kernel's ``ref.reshape`` (0.10.2 and 0.12.0.1):
# docs/serving.md, "What a CPU can check".
INTERPRETER_GAP = "'ReshapeTransform' object has no attribute 'indices'"


@pytest.mark.smoke
def test_the_kernel_interpreted_matches_the_reference_where_jax_interprets_it():
    """Upstream's kernel in TPU interpret mode on a tiny paged cache against the float32
    reference. JAX's interpreter cannot run it yet: the test holds that reason (any other
    failure fails it), and checks the numerics the day a JAX runs it."""
    from jax.experimental.pallas import tpu as pltpu

    problem = ServingProblem(4, 2, 128, page_size=16, pages_per_seq=4, max_num_batched_tokens=32,
                             max_num_seqs=3, dtype="float32", kv_dtype="float32")
    inputs = RPA.example_inputs(problem, seed=1)
    expected = jax.jit(RPA.reference(problem))(*inputs)
    try:
        with pltpu.force_tpu_interpret_mode():
            outputs = RPA.build(problem, RpaConfig(2, 8))(*inputs)  # every batch composition
    except jax.errors.JaxRuntimeError as error:
        assert INTERPRETER_GAP in str(error)
        return
    for out, want in zip(outputs, expected, strict=True):
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_jaxs_choice_is_the_named_baseline_legal_or_not():
    """JAX's fallback at the Llama key overflows a v5e's VMEM: still the baseline a tune names
    (reported as refused there), while the default is legal."""
    baselines = RPA.baselines(LLAMA, "v5e")
    assert baselines["jax"] == RpaConfig(*FALLBACK)
    assert not RPA.is_legal(LLAMA, RpaConfig(*FALLBACK), "v5e")
    assert RPA.is_legal(LLAMA, RPA.default_config(LLAMA, "v5e"), "v5e")
    # ... and beside it JAX's blocks under the smallest raised VMEM limit that admits them
    assert baselines["jax_vmem"] == RpaConfig(*FALLBACK, vmem_limit_mib=64)
    assert not RPA.is_legal(LLAMA, RpaConfig(*FALLBACK, vmem_limit_mib=32), "v5e")
    assert RPA.is_legal(LLAMA, baselines["jax_vmem"], "v5e")


def test_the_table_s_own_entry_is_a_baseline_beside_jax_s_lookup():
    """JAX's lookup misses the Llama key (its simplify_key looks up page_size * pages_per_seq
    last, 2048 here), while its table holds an entry under the key as written (128 pages
    per sequence): a baseline and a seed of its own. A key the table lacks has none."""
    raw = jax_key(LLAMA)
    entry = tuned_block_sizes.TUNED_BLOCK_SIZES["TPU v5"][raw]
    assert tuned_block_sizes.simplify_key(raw) not in tuned_block_sizes.TUNED_BLOCK_SIZES["TPU v5"]
    baselines = RPA.baselines(LLAMA, "v5e")
    assert baselines["jax_entry"] == RpaConfig(*entry) != baselines["jax"]
    assert baselines["jax_entry"] in RPA.seed_configs(LLAMA, "v5e")
    assert RPA.table_entry(LLAMA, "v4") is None  # JAX gives the v4 no table
    absent = dataclasses.replace(LLAMA, max_num_batched_tokens=8192)
    assert RPA.table_entry(absent, "v5e") is None
    assert "jax_entry" not in RPA.baselines(absent, "v5e")


def test_a_jax_choice_that_fits_has_no_raised_vmem_baseline():
    """No VMEM to raise where JAX's own call compiles (the v4's fallback), or where more than
    the VMEM refuses it (a CPU has no scoped limit: nothing refuses there)."""
    assert RPA.baselines(LLAMA, "v4") == {"jax": RPA.jax_config(LLAMA, "v4")}
    assert RPA.baselines(LLAMA, "cpu") == {"jax": RPA.jax_config(LLAMA, "cpu")}
