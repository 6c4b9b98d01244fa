"""Issue 46 item 4: on a machine without a TPU, with libtpu installed, neither our commands nor
a model importing ``kernel`` start libtpu's TPU backend, whose failure prints noise."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import AUTOTUNE, problem_flags
from kernel import Problem
from kernel.platforms import accelerator_attached

NOISE = ("E0000", "INVALID_ARGUMENT", "Failed to find host bounds")
pytestmark = pytest.mark.skipif(
    accelerator_attached() or importlib.util.find_spec("libtpu") is None,
    reason="the noise comes from libtpu on a machine without an accelerator")
# The environment of a user who set nothing (not even what importing jax here set: its
# TPU_SKIP_MDS_QUERY quiets libtpu too).
PLAIN_ENV = {name: value for name, value in os.environ.items()
             if name != "JAX_PLATFORMS" and not name.startswith(("TPU_", "AUTOTUNE_"))}
MODEL = """
import jax, jax.numpy as jnp
import kernel
q = jnp.ones((1, 2, 128, 64), jnp.float32)
print(kernel.flash_attention(q, q, q, causal=True).shape, jax.devices())
"""


def test_a_model_importing_kernel_prints_no_libtpu_noise() -> None:
    run = subprocess.run([sys.executable, "-c", MODEL], capture_output=True, text=True,
                         timeout=300, env=PLAIN_ENV)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "(1, 2, 128, 64)" in run.stdout
    assert not [line for line in run.stderr.splitlines() if any(n in line for n in NOISE)]


def test_a_tune_prints_no_libtpu_noise(tmp_path: Path) -> None:
    problem = Problem(1, 2, 2, 128, 128, 64, "float32")
    run = subprocess.run([*AUTOTUNE, "tune", "--kernel", "xla", *problem_flags(problem),
                          "--trials", "1", "--db", f"sqlite:///{tmp_path / 'quiet.db'}"],
                         capture_output=True, text=True, timeout=600, env=PLAIN_ENV)
    assert run.returncode == 0, run.stderr[-2000:]
    output = run.stdout + run.stderr
    assert not [line for line in output.splitlines() if any(n in line for n in NOISE)]
