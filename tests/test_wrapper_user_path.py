"""Issue 46 item 1, the user's path on a CPU: a default tune (every candidate kernel), an
export, then in a fresh process the pinned table and ``jax.grad`` of ``flash_attention``.
Whatever kernel the table chose, and any registered kernel a table names, the training step
runs (the chosen kernel where it can run here, else a fallback with one warning)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kernel import Problem, get_kernel, kernel_names
from kernel.table import KernelChoice, KernelTiming, LookupTable
from conftest import installed, problem_flags, run_cli

PROBLEM = Problem(batch=1, q_heads=2, kv_heads=1, q_len=128, kv_len=128, head_dim=64,
                  dtype="float32", causal=True, mode="fwd_bwd")
CPU_KERNELS = [installed(name) for name in kernel_names() if "cpu" in get_kernel(name).targets]
# A fresh process pins the table and differentiates, as a user's training step does; it
# prints which kernel ran, the key's mode and how it was picked (the one key it resolved).
TRAIN = """
import sys, jax, jax.numpy as jnp, kernel
kernel.use_table(sys.argv[1])
q = jax.random.normal(jax.random.key(0), (1, 2, 128, 64), jnp.float32)
kv = jax.random.normal(jax.random.key(1), (1, 1, 128, 64), jnp.float32)
loss = lambda q, k, v: kernel.flash_attention(q, k, v, causal=True).sum()
got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv)
ref = lambda q, k, v: kernel.reference_attention(q, k, v, causal=True).sum()
want = jax.grad(ref, argnums=(0, 1, 2))(q, kv, kv)
error = max(float(jnp.max(jnp.abs(g - w))) for g, w in zip(got, want))
[(name, mode, how)] = [(k[0], k[2].mode, v) for k, v in kernel.resolution_sources().items()]
print(name, error, mode, how, sep="|")
"""


def _train(table: Path) -> tuple[str, float, str]:
    run = subprocess.run([sys.executable, "-c", TRAIN, str(table)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    name, error, mode, how = run.stdout.strip().splitlines()[-1].split("|")
    assert mode == "fwd_bwd", (name, mode)  # the key a training step resolved, as it ran
    return name, float(error), how


def test_a_default_tune_exported_and_pinned_trains_in_a_fresh_process(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'tune.db'}"
    tuned = run_cli("tune", *problem_flags(PROBLEM), "--trials", "1", "--db", db, "--json",
                    timeout=900)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    summary = json.loads(tuned.stdout.strip().splitlines()[-1])
    table = tmp_path / "table.json"
    exported = run_cli("export", "--device-kind", "cpu", "-o", str(table), "--db", db)
    assert exported.returncode == 0, exported.stderr
    name, error, how = _train(table)
    assert name == summary["chosen_kernel"] and how.endswith("(exact choice in pinned table)")
    assert error < 1e-3


@pytest.mark.parametrize("chosen", CPU_KERNELS)
def test_a_table_choosing_any_cpu_kernel_trains_with_it(chosen: str, tmp_path: Path) -> None:
    backend = get_kernel(chosen)
    choices = tuple(
        KernelChoice(problem, chosen, backend.default_config(problem),
                     {chosen: KernelTiming(1.0, 0.1)}, {"kernel_version": backend.version})
        for problem in (PROBLEM, Problem.from_dict({**PROBLEM.to_dict(), "mode": "fwd"})))
    table = tmp_path / "table.json"
    table.write_text(json.dumps(LookupTable("flash", "1", "cpu", (), choices=choices).to_dict()))
    name, error, how = _train(table)
    assert (name, how.split("; kernel: ")[-1]) == (chosen,
                                                    "chosen (exact choice in pinned table)")
    assert error < 1e-3
