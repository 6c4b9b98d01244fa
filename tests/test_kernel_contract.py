"""The common suite every registered backend passes, parametrized by the registry (tokamax's
``AttentionTestBase``): the contract's metadata, legal defaults inside the space, rules that
name what they refuse, and numerics on CPU (interpret mode) against the XLA reference, forward
and all three gradients, over grouped-query and plain heads, causal or not, float32 and
bfloat16. The reference uses jax.nn.dot_product_attention's default scale, so a backend left at
its upstream default (1.0) fails. A new backend needs no change here."""

from __future__ import annotations

import dataclasses

import random
import subprocess
import sys

import jax
import numpy as np
import pytest

from kernel import ConfigError, Problem, TunableKernel, device_target, get_kernel, kernel_names
from kernel.aot import topology_device
from kernel.contract import example_inputs, input_specs, packed_segment_ids
from kernel.contract import AttentionFn, measured_fn
from kernel.registry import KERNELS
from kernel.targets import GPU_TARGET
from kernel.tolerance import MAX_RELATIVE_ERROR, relative_error
from conftest import installed, refusal

NAMES = kernel_names()
# The backends that run here: all but those whose optional package is missing (skipped naming
# the extra to install). Of those, the ones with a CPU target (interpret mode, or XLA itself);
# the others are checked on their device by bench/chip/gpu_check.py and say so.
RUNNABLE = [installed(name) for name in NAMES]
ON_CPU = [installed(name) if "cpu" in get_kernel(name).targets else pytest.param(
    name, marks=pytest.mark.skip(reason=f"{name} runs only on {', '.join(get_kernel(name).targets)}"
                                 "; bench/chip/gpu_check.py checks it there")) for name in NAMES]
TUNABLE = [name for name in NAMES if "cpu" in get_kernel(name).targets
           and get_kernel(name).space_params(Problem(1, 2, 1, 256, 256, 64, "float32"))]
TOLERANCE = MAX_RELATIVE_ERROR  # per dtype: the tuner's correctness gate


def _problem(mode: str = "fwd", **changes) -> Problem:
    fields = dict(batch=1, q_heads=2, kv_heads=1, q_len=256, kv_len=256, head_dim=64,
                  dtype="float32", causal=True, mode=mode)
    return Problem(**{**fields, **changes})


def _target(kernel: TunableKernel) -> str:
    return "gpu" if "gpu" in kernel.targets else "v5e"


def _inputs(problem: Problem) -> list[jax.Array]:
    return example_inputs(problem)  # what the tuner measures


def _max_error(got, want) -> float:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape
    return max(relative_error(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def _run(fn, args):
    # The interpret-mode kernels are large XLA programs; LLVM's -O0 halves their compile time.
    compiled = jax.jit(fn).trace(*args).lower().compile({"xla_backend_optimization_level": 0})
    return compiled(*args)


# --- the registry ------------------------------------------------------------------------------

def test_registry_lists_the_registered_kernels():
    assert {"flash", "jax_tpu_flash", "pallas_gpu"} <= set(NAMES)
    assert list(KERNELS) == NAMES
    assert get_kernel("pallas_gpu").platforms == ("gpu",)
    with pytest.raises(ConfigError, match="unknown kernel 'nosuch'.*" + ", ".join(NAMES)):
        get_kernel("nosuch")


@pytest.mark.parametrize("name", NAMES)
def test_contract_metadata(name):
    kernel = get_kernel(name)
    assert kernel.name == name and kernel.version and kernel.description
    assert kernel.targets and kernel.platforms
    assert kernel.config_type.from_dict({}) == kernel.config_type()
    fields = set(kernel.config_type().to_dict())
    assert set(kernel.landscape_axes) <= fields, kernel.landscape_axes
    assert all(set(part) <= fields for part in kernel.compile_parts)


def test_targets_resolve_per_kernel():
    assert device_target("gpu", "NVIDIA H200") == GPU_TARGET
    assert device_target("tpu", "TPU v5 lite").name == "v5e"
    assert device_target("cpu", "cpu").name == "cpu"
    assert get_kernel("jax_tpu_flash").target("TPU v6 lite").name == "v6e"
    with pytest.raises(ConfigError, match="kernel 'pallas_gpu' has no target 'v5e'"):
        get_kernel("pallas_gpu").default_config(_problem(), "v5e")
    with pytest.raises(ConfigError, match="kernel 'flash' has no target 'gpu'"):
        get_kernel("flash").violations(_problem(), get_kernel("flash").default_config(_problem()),
                                       "gpu")


def test_importing_the_registry_does_not_import_jax():
    code = (
        "import sys\n"
        "import kernel.registry as r\n"
        "from kernel.problem import Problem\n"
        "p = Problem(2, 4, 2, 512, 1024, 128, 'bfloat16', True, 'fwd_bwd')\n"
        "for k in r.KERNELS.values():\n"
        "    t = 'gpu' if 'gpu' in k.targets else 'v5e'\n"
        "    if k.problem_violations(p): continue  # e.g. mosaic_gpu: no causal backward\n"
        "    c = k.config_from_dict(k.default_config(p, t).to_dict())\n"
        "    assert not k.violations(p, c, t), (k.name, k.violations(p, c, t))\n"
        "    assert isinstance(k.space_params(p), dict)\n"
        "assert 'jax' not in sys.modules, 'jax was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


# --- rules -------------------------------------------------------------------------------------

SHAPES = [dict(), dict(q_len=512, kv_len=1024), dict(q_len=1024, kv_len=512),
          dict(batch=3, q_heads=4, kv_heads=4, q_len=128, kv_len=128, head_dim=128),
          dict(batch=4, q_len=4096, kv_len=4096, head_dim=128, dtype="bfloat16")]


@pytest.mark.parametrize("name", ON_CPU)
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_default_is_legal_and_in_the_space(name, mode):
    kernel = get_kernel(name)
    for shape in SHAPES:
        problem = _problem(mode, **shape)
        if kernel.problem_violations(problem):  # legal whenever the problem is
            continue
        params = kernel.space_params(problem)
        for target in kernel.targets:
            if refusal(kernel, problem, target):  # on that device (tokamax's float32)
                continue
            default = kernel.default_config(problem, target)
            assert kernel.violations(problem, default, target) == [], (problem.label(), target)
            assert all(getattr(default, f) in values for f, values in params.items()), \
                (problem.label(), target, default.label(), params)
    small = _problem(mode)
    if refusal(kernel, small, _target(kernel)):
        small = _problem(mode, dtype="bfloat16")
    space = kernel.search_space(small, _target(kernel))
    assert kernel.default_config(small, _target(kernel)) in space
    if name in TUNABLE:
        assert len(space) >= (4 if mode == "fwd" else 10)
    else:  # nothing to tune: the default is the whole space
        assert space == [kernel.default_config(small)]


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_every_backend_builds_its_default_on_any_machine(name, mode):
    """The measured function is built before a device runs it, checked against the rules
    that hold wherever the backend runs. cuDNN, which has no CPU target, once refused its own
    default there: every cuDNN trial failed on a GPU."""
    kernel = get_kernel(name)
    problem = _problem(mode, dtype="bfloat16")
    if kernel.problem_violations(problem):  # mosaic_gpu has no causal backward
        problem = _problem(mode, dtype="bfloat16", causal=False)
    assert callable(kernel.build(problem, kernel.default_config(problem, _target(kernel))))


@pytest.mark.parametrize("name", TUNABLE)
def test_fwd_mode_searches_no_backward_field(name):
    kernel = get_kernel(name)
    fwd, fwd_bwd = kernel.space_params(_problem("fwd")), kernel.space_params(_problem("fwd_bwd"))
    assert set(fwd) < set(fwd_bwd)
    assert all(not f.endswith(("_dkv", "_dq")) for f in fwd)


# (kernel, mode, field changes, the rule that must be named)
ILLEGAL = [
    ("flash", "fwd", dict(block_q=96), "block_divides"),
    ("flash", "fwd", dict(pipeline_depth=7), "pipeline_depth"),
    ("jax_tpu_flash", "fwd", dict(block_k_major=128, block_k=256), "minor_divides_major"),
    ("jax_tpu_flash", "fwd", dict(block_q=512), "block_max"),
    ("jax_tpu_flash", "fwd", dict(block_k=64), "block_tiling"),
    ("jax_tpu_flash", "fwd", dict(block_b=2), "block_b"),
    ("jax_tpu_flash", "fwd_bwd", dict(block_q_major_dkv=128, block_q_dkv=256),
     "minor_divides_major"),
    ("pallas_gpu", "fwd", dict(block_q=48), "block_pow2"),
    ("pallas_gpu", "fwd", dict(block_k=512), "block_max"),
    ("pallas_gpu", "fwd", dict(num_warps=3), "num_warps"),
    ("pallas_gpu", "fwd", dict(num_stages=9), "num_stages"),
    ("pallas_gpu", "fwd_bwd", dict(block_q_dq=32, block_kv_dkv=64), "fused_backward"),
]


@pytest.mark.parametrize("name,mode,changes,rule", ILLEGAL,
                         ids=[f"{n}-{r}-{m}" for n, m, _, r in ILLEGAL])
def test_illegal_configs_are_refused_naming_the_rule(name, mode, changes, rule):
    kernel = get_kernel(name)
    problem = _problem(mode)
    config = kernel.default_config(problem).replace(**changes)
    assert rule in [v.rule for v in kernel.violations(problem, config)]
    assert config not in kernel.search_space(problem)
    with pytest.raises(ConfigError, match=rf"\[{rule}\]"):
        kernel.build(problem, config)


def test_problem_rules_name_what_no_config_can_run():
    tpu, gpu = get_kernel("jax_tpu_flash"), get_kernel("pallas_gpu")
    odd = _problem(q_len=200, kv_len=200, head_dim=192)
    assert {v.rule for v in tpu.violations(odd, tpu.default_config(odd))} >= {"kv_len",
                                                                             "head_dim"}
    assert tpu.search_space(odd) == []
    tiny = _problem(q_len=24, kv_len=24, head_dim=8)
    assert {v.rule for v in gpu.violations(tiny, gpu.default_config(tiny))} >= {"seq_len",
                                                                              "head_dim"}


@pytest.mark.parametrize("name", TUNABLE)
def test_config_from_dict_names_the_bad_field(name):
    kernel = get_kernel(name)
    field = next(iter(kernel.space_params(_problem())))
    with pytest.raises(ConfigError, match="unknown config field.*'block_zz'"):
        kernel.config_from_dict({"block_zz": 128})
    with pytest.raises(ConfigError, match=f"{field} must be an integer"):
        kernel.config_from_dict({field: "128"})
    with pytest.raises(ConfigError, match=f"{field} must be from 1 to 1048576, got 0"):
        kernel.config_from_dict({field: 0})
    with pytest.raises(ConfigError, match=f"{field} must be .*, got a larger number"):
        kernel.config_from_dict({field: 10 ** 310})  # beyond a float, as a VMEM estimate needs
    with pytest.raises(ConfigError, match="must be a JSON object"):
        kernel.config_from_dict([128])
    with pytest.raises(ConfigError, match=f"takes a {kernel.config_type.__name__}"):
        other = get_kernel(next(n for n in TUNABLE if n != name))
        kernel.check(_problem(), other.default_config(_problem(), _target(other)))


# --- numerics: build runs on CPU (interpret mode) and matches the reference ------------------

# (mode, problem changes, config: -1 the default, else a seeded pick from the space)
NUMERICS = [("fwd", dict(), -1), ("fwd", dict(), 0), ("fwd_bwd", dict(), 0),
            ("fwd_bwd", dict(causal=False, kv_heads=2), -1),
            ("fwd", dict(dtype="bfloat16", causal=False), 0),
            ("fwd_bwd", dict(dtype="bfloat16"), -1)]


def _config(kernel: TunableKernel, problem: Problem, index: int):
    default = kernel.default_config(problem)
    if index < 0:
        return default
    others = [c for c in kernel.search_space(problem) if c != default]
    return random.Random(f"{kernel.name}{problem.label()}").choice(others or [default])


def _f32(fn: AttentionFn) -> AttentionFn:
    return lambda *args: jax.tree.map(lambda x: x.astype(np.float32), fn(*args))


@pytest.mark.parametrize("name", ON_CPU)
@pytest.mark.parametrize("mode,changes,index", NUMERICS,
                         ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in c.items()) or 'gqa-causal-f32'}"
                              f"-{'default' if i < 0 else 'sample'}" for m, c, i in NUMERICS])
def test_build_matches_the_reference_on_cpu(name, mode, changes, index):
    kernel = get_kernel(name)
    problem = _problem(mode, **changes)  # by default grouped-query: 2 query heads, 1 K/V head
    config = _config(kernel, problem, index)
    args = _inputs(problem)
    got = _run(_f32(kernel.build(problem, config)), args)
    want = jax.jit(_f32(kernel.reference(problem)))(*args)
    if mode == "fwd_bwd":
        assert len(got) == 3  # dq, dk, dv
    assert _max_error(got, want) <= TOLERANCE[problem.dtype], config.label()


@pytest.mark.parametrize("name", ON_CPU)
def test_the_wrapper_path_differentiates_on_cpu(name):
    """What ``flash_attention`` runs (``attention`` with a per-mode config, differentiated by
    the caller's ``jax.grad``), not only what the tuner measures (``build``): a kernel the tuner
    can measure here, the wrapper can run here, backward included."""
    kernel = get_kernel(name)
    problem = _problem("fwd_bwd")
    config = kernel.default_config(problem)
    attend = kernel.attention(problem, lambda mode: config, problem.head_dim ** -0.5)
    args = _inputs(problem)
    got = _run(_f32(measured_fn(problem, attend)), args)
    want = jax.jit(_f32(kernel.reference(problem)))(*args)
    assert _max_error(got, want) <= TOLERANCE[problem.dtype]


@pytest.mark.parametrize("name", [installed(n) for n in TUNABLE
                                  if "tpu" in get_kernel(n).platforms])
def test_the_wrapper_gradient_keeps_the_mosaic_kernels_on_a_tpu(name):
    """With a TPU as the default device (a deviceless v5e here), the wrapper's gradient runs
    every kernel compiled (a Mosaic custom call), none interpreted: that is for other
    platforms only."""
    kernel = get_kernel(name)
    problem = _problem("fwd_bwd", q_len=512, kv_len=512)
    config = kernel.default_config(problem, "v5e")
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in input_specs(problem)]
    with jax.default_device(topology_device("v5e")):
        attend = kernel.attention(problem, lambda mode: config, problem.head_dim ** -0.5)
        text = jax.export.export(jax.jit(measured_fn(problem, attend)),
                                 platforms=["tpu"])(*specs).mlir_module()
    # One kernel per part that compiles on its own: the forward, dK/dV and dQ (three where no
    # parts are declared), or the forward and one fused backward (tokamax's).
    assert text.count("@tpu_custom_call") >= (len(kernel.compile_parts) or 3)


# --- windows, soft caps and segment ids: what the tuner measures them with --------------------

def test_the_tuners_packing_is_deterministic_documents_and_a_padding_tail():
    problem = _problem(batch=3, q_len=256, kv_len=512, segmented=True)
    q_ids, kv_ids = packed_segment_ids(problem)
    assert q_ids.shape == (3, 256) and kv_ids.shape == (3, 512) and q_ids.dtype == np.int32
    assert (kv_ids[:, :256] == q_ids).all()  # positions shared, top-left aligned
    for row in kv_ids:
        runs = [int(i) for i in row[np.r_[True, row[1:] != row[:-1]]]]
        assert runs == [1, 2, 3, 4, 0] and (row[-32:] == 0).all()  # 4 documents, 1/16 padding
    assert len({tuple(row) for row in kv_ids}) == 3  # each row drawn on its own
    assert all((a == b).all() for a, b in zip(packed_segment_ids(problem), (q_ids, kv_ids)))
    specs = input_specs(problem)
    assert [(s.shape, s.dtype) for s in specs[3:]] == [((3, 256), np.int32), ((3, 512), np.int32)]


def test_the_tuners_packing_gives_every_query_keys_of_its_segment_when_queries_outnumber_keys():
    """Queries past the last key continue its segment (the padding tail): a query with no key
    would get splash's average where the reference gives zeros, failing the gate."""
    q_ids, kv_ids = packed_segment_ids(_problem(batch=2, q_len=512, kv_len=256, segmented=True))
    assert q_ids.shape == (2, 512) and (q_ids[:, :256] == kv_ids).all()
    assert (q_ids[:, 256:] == 0).all() and (kv_ids[:, -16:] == 0).all()


# Each feature alone is in test_kernel_peers' FEATURE_CASES: here segment ids (which
# upstream's TPU kernel runs too) and all three at once.
FEATURES = {"segment_ids": dict(segmented=True),
            "all": dict(causal=False, window=(40, 16), softcap=2.0, segmented=True)}


@pytest.mark.smoke  # splash's and upstream's feature arguments, on jax 0.10.2 to 0.12
@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("features", FEATURES)
def test_a_featured_build_passes_the_tuners_gate_which_catches_an_ignored_feature(
        name, features):
    """Each kernel claiming a feature measures (``build``) within the gate's bound of the
    reference, on the tuner's inputs (the packing for segment ids); a kernel that ignored the
    feature would fail the gate on those inputs. One that does not claim it names the rule."""
    kernel = get_kernel(name)
    problem = _problem("fwd_bwd", **FEATURES[features])
    refused = {v.rule for v in kernel.problem_violations(problem)} & {
        "window", "softcap", "segment_ids"}
    if refused or "cpu" not in kernel.targets:
        assert refused or name == "cudnn", name
        return
    args = _inputs(problem)
    want = jax.jit(_f32(kernel.reference(problem)))(*args)
    got = _run(_f32(kernel.build(problem, kernel.default_config(problem))), args)
    assert _max_error(got, want) <= TOLERANCE[problem.dtype]
    plain = _problem("fwd_bwd", causal=problem.causal)
    ignored = jax.jit(_f32(kernel.reference(plain)))(*args[:3])
    assert _max_error(ignored, want) > 10 * TOLERANCE[problem.dtype]


# --- bottom-right alignment: the queries are the last q_len positions (issue 73 item 6) ---------

ALIGNED = {"decode": dict(q_len=1), "chunked-prefill": dict(q_len=256),
           "speculative": dict(q_len=4), "window": dict(q_len=256, window=(100, 0))}


def test_the_bottom_right_reference_is_the_tail_of_full_causal_attention():
    """The reference the backends are checked against, against jax.nn's own causal mask on
    the whole sequence: a bottom-right query i computes row ``i + kv_len - q_len`` of it."""
    full = _problem(q_len=512, kv_len=512)
    q, k, v = _inputs(full)
    want = jax.nn.dot_product_attention(*(x.swapaxes(1, 2) for x in (q, k, v)), is_causal=True)
    for q_len in (1, 4, 256):
        tail = q[:, :, -q_len:]
        aligned = dataclasses.replace(full, q_len=q_len, bottom_right=True)
        got = get_kernel("xla").reference(aligned)(tail, k, v)
        np.testing.assert_allclose(got, want.swapaxes(1, 2)[:, :, -q_len:], atol=2e-6)


@pytest.mark.parametrize("name", ON_CPU)
@pytest.mark.parametrize("case", ALIGNED)
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_bottom_right_alignment_matches_the_reference_or_is_refused_by_rule(name, case, mode):
    """Decode (1 query), speculative decode (4), chunked prefill (256) and a sliding window
    against a 512-key cache, each query at position i + kv_len - q_len: every backend runs it
    within the gate's bound of the reference (and far from the top-left answer), or refuses
    it by its ``bottom_right`` rule."""
    kernel = get_kernel(name)
    problem = _problem(mode, kv_len=512, bottom_right=True, **ALIGNED[case])
    assert problem.bottom_right
    refused = {v.rule for v in kernel.problem_violations(problem)}
    if refused:
        assert "bottom_right" in refused, refused
        return
    args = _inputs(problem)
    want = jax.jit(_f32(kernel.reference(problem)))(*args)
    got = _run(_f32(kernel.build(problem, kernel.default_config(problem))), args)
    assert _max_error(got, want) <= TOLERANCE[problem.dtype]
    top_left = dataclasses.replace(problem, bottom_right=False)
    ignored = jax.jit(_f32(kernel.reference(top_left)))(*args)
    assert _max_error(ignored, want) > 10 * TOLERANCE[problem.dtype]


@pytest.mark.parametrize("name", NAMES)
def test_a_forward_label_names_no_field_only_the_backward_searches(name):
    """Issue 46 item 11: a ``fwd`` result's label shows only what the forward uses: changing a
    field that only a ``fwd_bwd`` search varies leaves ``label("fwd")`` as it was, and changes
    the ``fwd_bwd`` label."""
    kernel = get_kernel(name)
    problem = _problem("fwd_bwd", q_len=512, kv_len=512, head_dim=128)
    forward = kernel.space_params(dataclasses.replace(problem, mode="fwd"))
    backward_only = {field: values for field, values in kernel.space_params(problem).items()
                     if field not in forward or len(forward[field]) == 1 < len(values)}
    default = kernel.default_config(problem, _target(kernel))
    for field, values in backward_only.items():
        other = default.replace(**{field: next(v for v in values if v != getattr(default,
                                                                                 field))})
        assert other.label("fwd") == default.label("fwd"), field
        assert other.label("fwd_bwd") != default.label("fwd_bwd"), field


def test_seed_configs_are_legal_uniform_blocks_and_splash_adds_maxtext_s_recipes() -> None:
    """The families a search measures after the default: legal, not the default, every block
    field at one size; splash adds MaxText's hand-set recipes where they are legal."""
    from kernel.backends.splash import RECIPES, recipe

    problem = Problem(batch=4, q_heads=16, kv_heads=16, q_len=4096, kv_len=4096, head_dim=128,
                      dtype="bfloat16", causal=True, mode="fwd_bwd")
    for name in ("flash", "splash"):
        kernel = get_kernel(name)
        seeds = kernel.seed_configs(problem, "v5e")
        assert seeds and kernel.default_config(problem, "v5e") not in seeds
        assert all(not kernel.violations(problem, seed, "v5e") for seed in seeds)
        blocks = [f for f in kernel.space_params(problem) if f.startswith("block_")]
        assert any(len({getattr(seed, f) for f in blocks}) == 1 for seed in seeds)
    splash = get_kernel("splash")
    recipes = [recipe(problem, **changes) for changes in RECIPES.values()]
    legal = [r for r in recipes if not splash.violations(problem, r, "v5e")]
    assert legal and all(r in splash.seed_configs(problem, "v5e") for r in legal)
