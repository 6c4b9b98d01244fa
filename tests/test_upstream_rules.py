"""Backend-specific rules checked against what upstream's own code accepts when lowered for
its real platform on this CPU host (``jax_tpu_flash`` for TPU, ``pallas_gpu`` for CUDA), and a
deviceless v5e compile of upstream's TPU kernel."""

from __future__ import annotations

import contextlib
import dataclasses
import random

import jax
import pytest

from kernel import Problem, TunableKernel, get_kernel
from kernel.aot import compile_for_target
from kernel.contract import input_specs
from kernel.backends.jax_tpu_flash import JaxTpuFlashKernel
from kernel.backends.pallas_gpu import PallasGpuKernel

# In the smoke set too: upstream's rules are what a newer JAX changes under our copies of them.
pytestmark = pytest.mark.smoke


def _problem(mode: str = "fwd", **changes) -> Problem:
    fields = dict(batch=1, q_heads=2, kv_heads=1, q_len=256, kv_len=256, head_dim=64,
                  dtype="float32", causal=True, mode=mode)
    return Problem(**{**fields, **changes})


# --- rules agree with upstream: lowering for the real platform on this CPU host --------------

@dataclasses.dataclass(frozen=True)
class _UncheckedTpu(JaxTpuFlashKernel):
    """The upstream call with our rules switched off: what upstream alone accepts."""

    def check(self, problem, config, target="cpu") -> None:
        return None


@dataclasses.dataclass(frozen=True)
class _UncheckedGpu(PallasGpuKernel):
    def check(self, problem, config, target="cpu") -> None:
        return None


# JAX 0.11+ lowers Pallas Triton only for a GPU it knows, attached or abstract (0.10 assumed
# sm_90 without one, and ignores this).
_ABSTRACT_GPU = jax.sharding.AbstractMesh((), (), (), abstract_device=jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu"))


def _lowers(kernel: TunableKernel, problem: Problem, config, platform: str) -> bool:
    cuda = platform == "cuda"
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")] if cuda else []
    try:
        with jax.sharding.use_abstract_mesh(_ABSTRACT_GPU) if cuda else contextlib.nullcontext():
            jax.export.export(jax.jit(kernel.build(problem, config)), platforms=[platform],
                              disabled_checks=checks)(*input_specs(problem))
    except (ValueError, NotImplementedError, TypeError):  # upstream's checks, or bad shapes
        return False
    return True


def test_every_admitted_jax_tpu_flash_config_lowers_for_tpu():
    kernel = get_kernel("jax_tpu_flash")
    fwd = _problem(batch=2, q_len=256, kv_len=512, head_dim=128, dtype="bfloat16")
    space = kernel.search_space(fwd, "v5e")
    assert len(space) >= 20
    assert all(_lowers(kernel, fwd, c, "tpu") for c in space)
    fwd_bwd = dataclasses.replace(fwd, mode="fwd_bwd")
    sample = random.Random(0).sample(kernel.search_space(fwd_bwd, "v5e"), 5)
    assert all(_lowers(kernel, fwd_bwd, c, "tpu") for c in sample)


# Rejected configs that upstream itself refuses when lowering (our block_q and block_b rules
# are stricter than upstream's: it pads a last partial block).
TPU_REJECTED = [("fwd", dict(block_k=64)), ("fwd", dict(block_k_major=384, block_k=128)),
                ("fwd", dict(block_q=1024)), ("fwd_bwd", dict(block_k_dkv=64)),
                ("fwd_bwd", dict(block_q_major_dkv=128, block_q_dkv=256))]


@pytest.mark.parametrize("mode,changes", TPU_REJECTED, ids=[str(c) for _, c in TPU_REJECTED])
def test_jax_tpu_flash_rejections_fail_upstream(mode, changes):
    problem = _problem(mode, q_len=512, kv_len=512, head_dim=128, dtype="bfloat16")
    kernel = get_kernel("jax_tpu_flash")
    config = kernel.default_config(problem).replace(**changes)
    assert kernel.violations(problem, config)
    assert not _lowers(_UncheckedTpu(), problem, config, "tpu")


def test_pallas_gpu_configs_lower_for_cuda_and_rejections_fail_upstream():
    kernel = get_kernel("pallas_gpu")
    problem = _problem("fwd_bwd", q_len=512, kv_len=512, head_dim=128, dtype="bfloat16")
    space = kernel.search_space(problem, "gpu")
    sample = [kernel.default_config(problem, "gpu"), *random.Random(0).sample(space, 4)]
    assert all(_lowers(kernel, problem, c, "cuda") for c in sample)
    for changes in (dict(block_q_dq=32, block_kv_dkv=64), dict(block_k=192)):
        config = kernel.default_config(problem).replace(**changes)
        assert kernel.violations(problem, config)
        assert not _lowers(_UncheckedGpu(), problem, config, "cuda"), changes



def test_pallas_gpu_refuses_lengths_its_fused_backward_cannot_split_alike():
    """q_len 112 against kv_len 512: no power-of-two blocks give both equally many blocks, so
    upstream's fused backward refuses every config; the forward alone runs."""
    kernel = get_kernel("pallas_gpu")
    problem = _problem("fwd_bwd", q_len=112, kv_len=512)
    assert [v.rule for v in kernel.problem_violations(problem)] == ["fused_backward"]
    assert not _lowers(_UncheckedGpu(), problem, kernel.default_config(problem), "cuda")
    forward = dataclasses.replace(problem, mode="fwd")
    assert not kernel.problem_violations(forward)
    assert _lowers(kernel, forward, kernel.default_config(forward), "cuda")


def test_pallas_gpu_refuses_causal_with_more_queries_than_keys():
    """Upstream's causal loop bound ignores kv_len: with q_len > kv_len it reads past the last
    key block (NaN in interpret mode), so such problems are refused; q_len <= kv_len runs."""
    kernel = get_kernel("pallas_gpu")
    for mode in ("fwd", "fwd_bwd"):
        assert [v.rule for v in kernel.problem_violations(
            _problem(mode, q_len=512, kv_len=256))] == ["causal"]
        assert not kernel.problem_violations(_problem(mode, q_len=256, kv_len=512))
        assert not kernel.problem_violations(_problem(mode, q_len=512, kv_len=256, causal=False))

def test_jax_tpu_flash_default_compiles_for_v5e_without_a_tpu():
    kernel = get_kernel("jax_tpu_flash")
    problem = _problem("fwd_bwd", q_len=512, kv_len=512, head_dim=128, dtype="bfloat16")
    seconds = compile_for_target(kernel, problem, kernel.default_config(problem, "v5e"), "v5e")
    assert seconds > 0
