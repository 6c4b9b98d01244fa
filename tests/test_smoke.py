"""The smoke set (``pytest -m smoke``) that ``.ci/run`` also runs on Python 3.12 with the
newest jax, jaxlib and libtpu pip resolves: every registered kernel lowers for TPU, compiles
its default for v5e without a TPU, and matches the reference with one tuned config; and
``autotune demo`` runs the whole loop. Parametrized by the registry (with the contract suite's
helpers), so a new kernel is covered without a change here."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from kernel import get_kernel, kernel_names
from kernel.aot import compile_for_target
from kernel.contract import input_specs
from tests.conftest import installed, run_cli
from tests.test_kernel_contract import (
    ON_CPU,
    TOLERANCE,
    _config,
    _inputs,
    _max_error,
    _problem,
    _run,
)

pytestmark = pytest.mark.smoke

TPU_KERNELS = [installed(name) for name in kernel_names() if "v5e" in get_kernel(name).targets]
TPU_PROBLEM = _problem("fwd_bwd", q_heads=4, kv_heads=2, q_len=512, kv_len=512, head_dim=128,
                       dtype="bfloat16")


def test_a_kernel_runs_on_tpu() -> None:
    assert TPU_KERNELS, "no registered kernel targets v5e"


@pytest.mark.parametrize("name", TPU_KERNELS)
def test_default_lowers_for_tpu(name: str) -> None:
    kernel = get_kernel(name)
    build = kernel.build(TPU_PROBLEM, kernel.default_config(TPU_PROBLEM, "v5e"))
    exported = jax.export.export(jax.jit(build), platforms=["tpu"])(*input_specs(TPU_PROBLEM))
    assert exported.platforms == ("tpu",)


@pytest.mark.parametrize("name", TPU_KERNELS)
def test_default_compiles_for_v5e_without_a_tpu(name: str) -> None:
    kernel = get_kernel(name)
    config = kernel.default_config(TPU_PROBLEM, "v5e")
    assert compile_for_target(kernel, TPU_PROBLEM, config, "v5e") > 0


@pytest.mark.parametrize("name", ON_CPU)
def test_a_tuned_config_matches_the_reference_on_cpu(name: str) -> None:
    """Forward and all three gradients of one config from the space (the default where
    nothing is tunable), grouped-query, causal, float32."""
    kernel = get_kernel(name)
    problem = _problem("fwd_bwd")
    config = _config(kernel, problem, 0)
    args = _inputs(problem)
    got = _run(kernel.build(problem, config), args)
    want = jax.jit(kernel.reference(problem))(*args)
    assert len(got) == 3 and _max_error(got, want) <= TOLERANCE["float32"], config.label()


def test_demo_tunes_serves_and_resolves_the_winner(tmp_path: Path) -> None:
    result = run_cli("demo", "--trials", "2", "--db", f"sqlite:///{tmp_path / 'demo.db'}",
                     env={"COLUMNS": "250"}, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "the wrapper used the tuned config served over HTTP" in result.stdout
