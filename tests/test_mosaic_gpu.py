"""The ``mosaic_gpu`` backend on a CPU: upstream's rules, the shared-memory estimate, the
registry, and its refusal off Hopper and off a GPU. Its numerics and the estimate's agreement
with the compiler need a Hopper GPU: ``bench/chip/gpu_check.py`` checks them there."""

from __future__ import annotations

import dataclasses

import pytest

from kernel import ConfigError, Problem, get_kernel
from kernel.backends import mosaic_gpu
from kernel.backends.mosaic_gpu import SMEM_PER_BLOCK, MosaicGpuConfig, smem_bytes
from kernel.registry import KERNELS
from kernel.resolve import Resolver, ResolverSettings
from kernel.targets import GPU_TARGET, TARGETS

MOSAIC = get_kernel("mosaic_gpu")


def _problem(mode: str = "fwd", **changes) -> Problem:
    fields = dict(batch=1, q_heads=32, kv_heads=8, q_len=4096, kv_len=4096, head_dim=128,
                  dtype="bfloat16", causal=mode == "fwd", mode=mode)
    return Problem(**{**fields, **changes})


def _rules(problem: Problem, **changes) -> set[str]:
    config = MOSAIC.default_config(problem, "gpu").replace(**changes)
    return {v.rule for v in MOSAIC.violations(problem, config, "gpu")}


def test_registered_after_pallas_gpu_which_stays_the_gpu_platform_kernel():
    assert KERNELS["mosaic_gpu"] is mosaic_gpu.KERNEL
    assert MOSAIC.targets == ("gpu",) and MOSAIC.platforms == ("gpu",)
    assert Resolver(ResolverSettings()).platform_kernel("gpu").name == "pallas_gpu"


@pytest.mark.parametrize("seq", [2048, 4096, 8192])
@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_defaults_are_legal_and_in_the_space_of_gpu_checks_shapes(seq, mode):
    problem = _problem(mode, q_len=seq, kv_len=seq)
    default = MOSAIC.default_config(problem, "gpu")
    space = MOSAIC.search_space(problem, "gpu")
    assert MOSAIC.is_legal(problem, default, "gpu") and default in space
    assert {c.max_concurrent_steps for c in space} >= {2, 3, 4, 5}  # depths beyond 2 fit


# (problem changes, config changes, the rule that must be named, a word of its fix)
ILLEGAL = [
    ({}, dict(block_q=96), "block_multiple", "multiple of 64"),
    ({"q_len": 2048 + 128}, dict(block_q=128), "block_divides", "smaller block_q"),
    ({}, dict(block_kv=192), "block_divides", "smaller block_kv"),
    ({}, dict(max_concurrent_steps=1), "depth", "at least 2"),
    ({"head_dim": 96}, {}, "head_dim", "pad it"),
    ({"head_dim": 320}, {}, "head_dim", "at most 256"),
    ({"dtype": "float32"}, {}, "dtype", "cast the inputs"),
    ({"q_len": 4096 + 64}, {}, "seq_len", "multiple of 128"),
    ({"q_len": 8192}, {}, "causal", "xla"),
    ({"mode": "fwd_bwd", "causal": True}, {}, "causal_backward", "tune mode fwd"),
    ({"mode": "fwd_bwd"}, dict(compute_wgs_bwd=3), "compute_wgs_bwd", "one of"),
    ({"mode": "fwd_bwd", "kv_len": 4096 + 64},
     dict(block_kv=64, block_kv_dkv=64, compute_wgs_bwd=2),
     "block_divides", "compute_wgs_bwd"),
    ({}, dict(block_kv=128, max_concurrent_steps=4), "smem", "lower max_concurrent_steps"),
]


@pytest.mark.parametrize(("problem_changes", "changes", "rule", "fix"), ILLEGAL)
def test_each_rule_names_itself_and_its_fix(problem_changes, changes, rule, fix):
    problem = _problem(**{"mode": "fwd", **problem_changes})
    config = MosaicGpuConfig().replace(**changes)
    broken = MOSAIC.violations(problem, config, "gpu")
    assert rule in {v.rule for v in broken}, broken
    assert any(fix in v.message for v in broken if v.rule == rule), broken


def test_smem_estimate_follows_upstreams_allocations():
    # Forward, q64 kv128 depth 2, head_dim 128: Q/O 2x64x128 bf16, K and V 2x128x128 each,
    # the reduction scratch and 4 x 2 + 3 mbarriers; training adds the 2x64 f32 lse rows.
    problem = _problem("fwd")
    config = MosaicGpuConfig(block_q=64, block_kv=128, max_concurrent_steps=2)
    assert smem_bytes(problem, config) == {"fwd": 32768 + 2 * 65536 + 2048 + 8 * 11}
    assert smem_bytes(problem, config, training=True)["fwd"] == 32768 + 2 * 65536 + 1024 + 2048 + 88
    # The depth is capped at the loop's steps: one key block holds one step whatever is asked.
    short = _problem("fwd", q_len=128, kv_len=128, causal=False)
    assert smem_bytes(short, config.replace(max_concurrent_steps=6)) == smem_bytes(
        short, config.replace(max_concurrent_steps=1))
    # Backward, two compute warpgroups of 64-row blocks, depth 2.
    both = smem_bytes(_problem("fwd_bwd"), config.replace(compute_wgs_bwd=2))
    assert both["dq"] == 2 * 32768 + 2 * 1024 + 2 * 32768 + 8 * (8 + 6)
    assert both["dkv"] == 2 * 32768 + 2 * 32768 + 2 * 1024 + 8 * (4 + 10)


def test_smem_rule_admits_exactly_what_fits_a_hopper_block():
    problem = _problem("fwd")
    for config in (MosaicGpuConfig(block_kv=block_kv, max_concurrent_steps=depth)
                   for block_kv in (64, 128, 256) for depth in range(2, 9)):
        fits = smem_bytes(problem, config)["fwd"] <= SMEM_PER_BLOCK
        assert fits == ("smem" not in _rules(problem, **config.to_dict())), config.label()
    assert SMEM_PER_BLOCK == 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200
    # head_dim 128: K/V blocks of 256 never fit two steps, which is why the default is 128.
    assert "smem" in _rules(problem, block_kv=256, max_concurrent_steps=2)
    assert "smem" not in _rules(problem, block_kv=64, max_concurrent_steps=6)


def test_refused_off_a_gpu_by_target():
    problem = _problem("fwd")
    for target in ("cpu", "v5e"):
        with pytest.raises(ConfigError, match="has no target .*choose one of gpu"):
            MOSAIC.violations(problem, MosaicGpuConfig(), target)
    resolver = Resolver(ResolverSettings())
    assert "no target 'cpu'" in resolver._cannot_run("mosaic_gpu", problem, TARGETS["cpu"])
    assert resolver._cannot_run("mosaic_gpu", problem, GPU_TARGET) == ""


def test_discover_on_a_cpu_knows_no_gpu_and_refuses_nothing_more():
    assert MOSAIC.discover() == MOSAIC  # the target rule refuses a CPU


@pytest.mark.parametrize(("arch", "refused"), [("sm80", True), ("sm89", True), ("", True),
                                               ("sm90", False), ("sm100", False)])
def test_refused_off_hopper_with_the_reason(arch, refused):
    on_device = dataclasses.replace(MOSAIC, gpu_arch=arch)
    broken = on_device.problem_violations(_problem("fwd"))
    assert ("gpu_arch" in {v.rule for v in broken}) is refused
    if refused:
        assert "use " in broken[0].message and ("sm90" in broken[0].message or arch == "")
        with pytest.raises(ConfigError, match="gpu_arch"):
            on_device.check_problem(_problem("fwd"))


def test_causal_refused_on_cuda_runtimes_upstream_refuses():
    bad = dataclasses.replace(MOSAIC, gpu_arch="sm90", cuda_runtime=12080)
    assert {v.rule for v in bad.problem_violations(_problem("fwd"))} == {"cuda_version"}
    assert not bad.problem_violations(_problem("fwd", causal=False))
    good = dataclasses.replace(MOSAIC, gpu_arch="sm90", cuda_runtime=12091)
    assert not good.problem_violations(_problem("fwd"))


@pytest.mark.smoke
def test_jax_still_ships_the_deprecated_triton_attention_pallas_gpu_wraps():
    """Fails the day JAX removes ``pallas/ops/gpu/attention.py`` (deprecated in 0.12 in favour
    of tokamax): then move ``pallas_gpu`` to tokamax's Triton kernel (kernel/backends/
    pallas_gpu.py says why it has not yet). Its deprecation warning is silenced at our import."""
    import warnings

    from kernel.backends.pallas_gpu import upstream_module

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        upstream = upstream_module()
    assert callable(upstream.mha) and upstream.BlockSizes(block_q=64, block_k=64).block_q == 64


@pytest.mark.smoke
def test_jax_ships_the_mosaic_gpu_attention_with_the_fields_mosaic_gpu_sets():
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    fields = {f.name for f in dataclasses.fields(attention_mgpu.TuningConfig)}
    assert set(MosaicGpuConfig().to_dict()) <= fields
    with pytest.raises(ValueError, match="multiple of 64"):
        attention_mgpu.TuningConfig(block_q=96, block_kv=64, max_concurrent_steps=2)
