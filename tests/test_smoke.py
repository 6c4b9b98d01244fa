"""The smoke set (``pytest -m smoke``) that ``.ci/run`` also runs on Python 3.12 with the
newest jax, jaxlib and libtpu pip resolves: every registered kernel lowers for TPU, compiles
its default for v5e without a TPU, and matches the reference with one tuned config; and
``autotune demo`` runs the whole loop. Written against the backend contract only, so a new
kernel is covered without a change here."""

from __future__ import annotations

import random
from pathlib import Path

import jax
import numpy as np
import pytest

from kernel import Problem, get_kernel, kernel_names
from kernel.aot import compile_for_target, input_specs
from tests.conftest import run_cli

pytestmark = pytest.mark.smoke

TPU_KERNELS = [name for name in kernel_names() if "v5e" in get_kernel(name).targets]
TOLERANCE = 2e-3  # relative to the reference's largest magnitude, as the tuner's gate
TPU_PROBLEM = Problem(batch=1, q_heads=4, kv_heads=2, q_len=512, kv_len=512, head_dim=128,
                      dtype="bfloat16", causal=True, mode="fwd_bwd")
CPU_PROBLEM = Problem(batch=1, q_heads=2, kv_heads=1, q_len=256, kv_len=256, head_dim=64,
                      dtype="float32", causal=True, mode="fwd_bwd")


def test_a_kernel_runs_on_tpu() -> None:
    assert TPU_KERNELS, "no registered kernel targets v5e"


@pytest.mark.parametrize("name", TPU_KERNELS)
def test_default_lowers_for_tpu(name: str) -> None:
    kernel = get_kernel(name)
    build = kernel.build(TPU_PROBLEM, kernel.default_config(TPU_PROBLEM, "v5e"))
    exported = jax.export.export(jax.jit(build), platforms=["tpu"])(*input_specs(TPU_PROBLEM))
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("name", TPU_KERNELS)
def test_default_compiles_for_v5e_without_a_tpu(name: str) -> None:
    kernel = get_kernel(name)
    config = kernel.default_config(TPU_PROBLEM, "v5e")
    assert compile_for_target(kernel, TPU_PROBLEM, config, "v5e") > 0


@pytest.mark.parametrize("name", kernel_names())
def test_a_tuned_config_matches_the_reference_on_cpu(name: str) -> None:
    kernel = get_kernel(name)
    default = kernel.default_config(CPU_PROBLEM)
    config = random.Random(name).choice(
        [c for c in kernel.search_space(CPU_PROBLEM) if c != default])
    keys = jax.random.split(jax.random.key(0), 3)
    args = [jax.random.normal(key, spec.shape, spec.dtype)
            for key, spec in zip(keys, input_specs(CPU_PROBLEM), strict=True)]
    got = jax.jit(kernel.build(CPU_PROBLEM, config))(*args)
    want = jax.jit(kernel.reference(CPU_PROBLEM))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):  # dq, dk, dv
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape
        assert np.max(np.abs(g - w)) <= TOLERANCE * np.max(np.abs(w)), config.label()


def test_demo_tunes_serves_and_resolves_the_winner(tmp_path: Path) -> None:
    result = run_cli("demo", "--trials", "2", "--db", f"sqlite:///{tmp_path / 'demo.db'}",
                     env={"COLUMNS": "250"}, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the wrapper used the tuned config served over HTTP" in result.stdout
