"""``kernel.flash_attention`` beyond our TPU kernel: upstream's Pallas Triton kernel
(``pallas_gpu``) on a GPU, and the kernel named by ``AUTOTUNE_TPU_KERNEL`` on a TPU, each with a
config resolved for that kernel, kept apart from ``flash``'s.

No GPU or TPU is attached here, so the wrapper is given a stand-in for the default device (its
platform and device kind, all the dispatch reads); the kernels themselves run for real, in
interpret mode on the CPU, with the same resolution (pinned table, service, default).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel
from conftest import plain_sources
from kernel import ConfigError, FlashConfig, Problem, get_kernel, reference_attention, \
    resolution_sources
from kernel.backends.pallas_gpu import PallasGpuConfig
from kernel.resolve import ResolverSettings, get_resolver, reset_resolver
from kernel.targets import GPU_TARGET, get_target


PROBLEM = Problem(batch=1, q_heads=2, kv_heads=1, q_len=128, kv_len=128, head_dim=64,
                  dtype="float32", causal=True)
GPU_CONFIG = PallasGpuConfig(block_q=32, block_k=64, block_q_dkv=32, block_kv_dkv=32,
                             block_q_dq=32, block_kv_dq=32, num_warps=4, num_stages=2)


GPU = ("gpu", "NVIDIA H200")  # (platform, device kind): what the wrapper reads of a device
CPU_AS_GPU = ("gpu", "cpu")  # a GPU whose tuned entries are stored under device kind cpu


@pytest.fixture
def on_device(monkeypatch):
    """Makes ``kernel.flash_attention`` see a default device of this (platform, kind)."""
    import kernel.attention

    return lambda device: monkeypatch.setattr(kernel.attention, "_default_device",
                                              lambda: device)


def table_file(tmp_path, kernel: str, config: dict) -> str:
    path = tmp_path / f"{kernel}.json"
    path.write_text(json.dumps({
        "schema_version": 1, "kernel": kernel, "kernel_version": get_kernel(kernel).version,
        "device_kind": "cpu",
        "entries": [{"problem": PROBLEM.to_dict(), "config": config}]}))
    return str(path)


def inputs():
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, 2, 128, 64), jnp.float32)
    k, v = (jax.random.normal(key, (1, 1, 128, 64), jnp.float32) for key in keys[1:])
    return q, k, v


@pytest.fixture(autouse=True)
def fresh_resolver():
    yield
    reset_resolver(ResolverSettings())


def test_gpu_branch_uses_the_pinned_pallas_gpu_config_and_matches_the_reference(tmp_path,
                                                                                   on_device):
    resolver = reset_resolver(ResolverSettings(table_paths=(
        table_file(tmp_path, "pallas_gpu", GPU_CONFIG.to_dict()),
        table_file(tmp_path, "flash", FlashConfig().to_dict()))))
    on_device(CPU_AS_GPU)
    q, k, v = inputs()
    out = kernel.flash_attention(q, k, v, causal=True)
    want = reference_attention(q, k, v, causal=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert plain_sources(resolution_sources()) == {("pallas_gpu", "cpu", PROBLEM): "table"}
    # The same problem resolves to flash's own entry, not the GPU kernel's.
    cpu = get_target("cpu")
    assert resolver.resolve(PROBLEM, "cpu", "flash", cpu).config == FlashConfig()
    assert resolver.resolve(PROBLEM, "cpu", "pallas_gpu", cpu).config == GPU_CONFIG


def test_a_differentiated_call_on_the_gpu_branch_runs_the_fwd_bwd_entry(tmp_path, on_device):
    """Upstream's custom VJP differentiates with the config it is called with: a training step
    runs the fwd_bwd-tuned one, whose backward blocks the fwd entry's need not match."""
    fwd_bwd = dataclasses.replace(PROBLEM, mode="fwd_bwd")
    tuned = GPU_CONFIG.replace(block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    path = tmp_path / "pallas_gpu.json"
    path.write_text(json.dumps({
        "schema_version": 1, "kernel": "pallas_gpu", "kernel_version": "1", "device_kind": "cpu",
        "entries": [{"problem": PROBLEM.to_dict(), "config": GPU_CONFIG.to_dict()},
                    {"problem": fwd_bwd.to_dict(), "config": tuned.to_dict()}]}))
    resolver = reset_resolver(ResolverSettings(table_paths=(str(path),)))
    on_device(CPU_AS_GPU)
    q, k, v = inputs()
    loss = lambda f: lambda q, k, v: f(q, k, v, causal=True).sum()  # noqa: E731
    got = jax.grad(loss(kernel.flash_attention), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(reference_attention), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=1e-4)
    assert plain_sources(resolution_sources()) == {("pallas_gpu", "cpu", fwd_bwd): "table"}
    assert resolver.resolve(fwd_bwd, "cpu", "pallas_gpu", get_target("cpu")).config == tuned


def test_gpu_branch_falls_back_to_the_pallas_gpu_default_without_a_table(on_device):
    reset_resolver(ResolverSettings())
    on_device(GPU)
    kernel.flash_attention(*inputs(), causal=True)
    assert plain_sources(resolution_sources()) == {("pallas_gpu", "NVIDIA H200", PROBLEM): "default"}
    resolution = get_resolver().resolve(PROBLEM, "NVIDIA H200", "pallas_gpu", GPU_TARGET)
    assert resolution.config == get_kernel("pallas_gpu").default_config(PROBLEM, "gpu")


def test_gpu_branch_refuses_a_flash_config_and_an_illegal_one(on_device):
    on_device(GPU)
    q, k, v = inputs()
    with pytest.raises(TypeError, match="PallasGpuConfig"):
        kernel.flash_attention(q, k, v, causal=True, config=FlashConfig())
    with pytest.raises(ConfigError, match="block"):
        kernel.flash_attention(q, k, v, causal=True, config=GPU_CONFIG.replace(block_q=48))


def test_the_wrapper_runs_pallas_gpu_on_a_gpu_and_the_named_kernel_on_a_tpu():
    resolver = reset_resolver(ResolverSettings())
    assert [resolver.platform_kernel(p).name for p in ("gpu", "cuda", "tpu", "cpu")] == [
        "pallas_gpu", "pallas_gpu", "flash", "flash"]
    resolver = reset_resolver(ResolverSettings(tpu_kernel="jax_tpu_flash"))
    assert resolver.platform_kernel("tpu").name == "jax_tpu_flash"
    assert resolver.platform_kernel("cpu").name == "flash"  # the CPU always interprets ours


def test_tpu_branch_runs_the_kernel_named_in_settings(on_device):
    reset_resolver(ResolverSettings(tpu_kernel="jax_tpu_flash"))
    on_device(("tpu", "TPU v5 lite"))
    problem = Problem(batch=1, q_heads=2, kv_heads=1, q_len=256, kv_len=256, head_dim=128,
                      dtype="float32", causal=True)
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (1, 2, 256, 128), jnp.float32)
    k, v = (jax.random.normal(key, (1, 1, 256, 128), jnp.float32) for key in keys[1:])
    out = kernel.flash_attention(q, k, v, causal=True)
    want = reference_attention(q, k, v, causal=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert plain_sources(resolution_sources()) == {("jax_tpu_flash", "TPU v5 lite", problem): "default"}
    resolution = get_resolver().resolve(problem, "TPU v5 lite", "jax_tpu_flash",
                                        get_target("v5e"))
    assert resolution.config == get_kernel("jax_tpu_flash").default_config(problem, "v5e")


def test_a_call_pallas_gpu_cannot_run_runs_xla_with_one_warning(on_device, caplog):
    """Under jax_enable_x64, or a head_dim under 16: upstream's kernel refuses it; without a
    choice the trace raised, naming a fix (use the flash kernel) a GPU cannot follow."""
    import logging

    caplog.set_level(logging.WARNING, logger="kernel.resolve")
    reset_resolver(ResolverSettings())
    on_device(GPU)
    keys = jax.random.split(jax.random.key(2), 3)
    small_head = [jax.random.normal(key, (1, 2, 128, 8), jnp.float32) for key in keys]
    with jax.enable_x64(True):
        q, k, v = inputs()
        np.testing.assert_allclose(np.asarray(kernel.flash_attention(q, k, v, causal=True)),
                                   np.asarray(reference_attention(q, k, v, causal=True)),
                                   atol=2e-5, rtol=2e-5)
    kernel.flash_attention(*small_head)
    sources = {key[2].head_dim: (key[0], source) for key, source in
               plain_sources(resolution_sources()).items()}
    assert sources[64][0] == sources[8][0] == "xla"
    assert "fallback" in sources[64][1] and "[x64]" in sources[64][1]
    assert "[head_dim]" in sources[8][1]
    fallbacks = [r for r in caplog.records if "instead of pallas_gpu" in r.getMessage()]
    assert len(fallbacks) == 2


def test_a_tpu_kernel_setting_naming_a_kernel_without_tpu_is_refused(monkeypatch, caplog):
    import logging

    caplog.set_level(logging.ERROR, logger="kernel.resolve")
    for name in ("pallas_gpu", "cudnn"):
        monkeypatch.setenv("AUTOTUNE_TPU_KERNEL", name)
        assert ResolverSettings.from_env().tpu_kernel is None
    assert sum("not a registered TPU kernel" in r.getMessage() for r in caplog.records) == 2
    monkeypatch.setenv("AUTOTUNE_TPU_KERNEL", "jax_tpu_flash")
    assert ResolverSettings.from_env().tpu_kernel == "jax_tpu_flash"
