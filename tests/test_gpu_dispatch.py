"""``kernel.flash_attention`` on a GPU: upstream's Pallas Triton kernel (``pallas_gpu``) with a
config resolved for that kernel, kept apart from ``flash``'s.

No GPU is attached here, so the GPU branch is called directly; its kernel runs in interpret
mode on the CPU, with the same resolution (pinned table, service, default) as on a GPU.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel import flash
from kernel.config import FlashConfig
from kernel.pallas_gpu import PallasGpuConfig
from kernel.problem import Problem
from kernel.registry import get_kernel
from kernel.resolve import ResolverSettings, get_resolver, reset_resolver, resolution_sources

PROBLEM = Problem(batch=1, q_heads=2, kv_heads=1, q_len=128, kv_len=128, head_dim=64,
                  dtype="float32", causal=True)
GPU_CONFIG = PallasGpuConfig(block_q=32, block_k=64, block_q_dkv=32, block_kv_dkv=32,
                             block_q_dq=32, block_kv_dq=32, num_warps=4, num_stages=2)


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


def test_gpu_branch_uses_the_pinned_pallas_gpu_config_and_matches_the_reference(tmp_path):
    resolver = reset_resolver(ResolverSettings(table_paths=(
        table_file(tmp_path, "pallas_gpu", GPU_CONFIG.to_dict()),
        table_file(tmp_path, "flash", FlashConfig().to_dict()))))
    q, k, v = inputs()
    out = flash._attention_on_gpu(q, k, v, PROBLEM, 64 ** -0.5, None, "cpu")
    want = flash.reference_attention(q, k, v, causal=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert resolution_sources() == {("pallas_gpu", "cpu", PROBLEM): "table"}
    # The same problem resolves to flash's own entry, not the GPU kernel's.
    assert resolver.resolve(PROBLEM, "cpu").config == FlashConfig()
    assert resolver.resolve(PROBLEM, "cpu", "pallas_gpu").config == GPU_CONFIG


def test_gpu_branch_falls_back_to_the_pallas_gpu_default_without_a_table():
    reset_resolver(ResolverSettings())
    q, k, v = inputs()
    flash._attention_on_gpu(q, k, v, PROBLEM, 64 ** -0.5, None, "NVIDIA H200")
    resolution = get_resolver().resolve(PROBLEM, "NVIDIA H200", "pallas_gpu")
    assert resolution.source == "default"
    assert resolution.config == get_kernel("pallas_gpu").default_config(PROBLEM, "gpu")


def test_gpu_branch_refuses_a_flash_config_and_an_illegal_one():
    q, k, v = inputs()
    with pytest.raises(TypeError, match="PallasGpuConfig"):
        flash._attention_on_gpu(q, k, v, PROBLEM, 1.0, FlashConfig(), "cpu")
    with pytest.raises(Exception, match="block"):
        flash._attention_on_gpu(q, k, v, PROBLEM, 1.0, GPU_CONFIG.replace(block_q=48), "cpu")
