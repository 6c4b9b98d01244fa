"""What a measurement holds, against the device's memory (issue 60 item 2), on this CPU.

``check_fits`` counts the inputs, the outputs and the compiled reference's temporaries and
refuses, in one line, a problem the device cannot hold; the device running out of memory is
the same one-line refusal; ``autotune tune --shapes`` tunes the other problems of a file when
one is refused, and exits 1.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import yaml

from autotune.failures import ProblemTooLarge
from autotune.measure import (
    GIB,
    check_fits,
    least_footprint,
    reference_footprint,
    refused_out_of_memory,
)
from conftest import run_cli
from kernel import Problem
from storage import Store
from test_reference_memory import LLAMA_8K

# Terabytes of q, k and v: no device holds them.
IMPOSSIBLE = Problem(batch=4096, q_heads=128, kv_heads=128, q_len=65536, kv_len=65536,
                     head_dim=128, dtype="float32", causal=True, mode="fwd")
TINY = Problem(batch=1, q_heads=1, kv_heads=1, q_len=128, kv_len=128, head_dim=64,
               dtype="float32", mode="fwd")


def test_the_shapes_formula_counts_what_the_compiled_reference_holds() -> None:
    """``least_footprint`` (the shapes alone) counts the inputs and outputs the compiled
    reference's memory analysis counts, and the analysis counts the temporaries too."""
    device = jax.devices("cpu")[0]
    for problem in (TINY, dataclasses.replace(TINY, q_heads=2, mode="fwd_bwd", segmented=True)):
        formula, analysed = least_footprint(problem), reference_footprint(problem, device)
        assert formula.inputs == analysed.inputs
        # the compiler counts a tuple of outputs' table of pointers too (8 bytes each)
        assert 0 <= analysed.outputs - formula.outputs <= 64
        assert analysed.reference_temps > 0


def test_a_problem_too_large_is_refused_in_one_line() -> None:
    """Against 1 GiB, the Llama layer fits by its shapes (0.56 GB) but not with its
    reference's temporaries; a problem of terabytes is refused by its shapes alone, without
    compiling anything."""
    device = jax.devices("cpu")[0]
    with pytest.raises(ProblemTooLarge) as refused:
        check_fits(LLAMA_8K, device, memory=GIB)
    message = str(refused.value)
    assert "\n" not in message
    assert "the reference's temporaries" in message and "has 1.00 GiB" in message
    assert least_footprint(LLAMA_8K).total < GIB < reference_footprint(LLAMA_8K, device).total
    check_fits(LLAMA_8K, device, memory=4 * GIB)  # fits
    with pytest.raises(ProblemTooLarge, match=r"needs [\d,.]+ GiB on the device \(inputs"):
        check_fits(IMPOSSIBLE, device)


def test_the_device_running_out_of_memory_is_a_one_line_refusal() -> None:
    """The runtime's own ``RESOURCE_EXHAUSTED`` (64 TiB asked of the CPU) becomes
    ``ProblemTooLarge`` naming the problem; any other error passes through."""
    device = jax.devices("cpu")[0]
    with pytest.raises(ProblemTooLarge) as refused, refused_out_of_memory(
            TINY, device, "computing the correctness gate's reference"):
        jax.block_until_ready(jax.jit(lambda: jnp.ones((2**46,), jnp.uint8))())
    assert "\n" not in str(refused.value)
    assert str(refused.value).startswith(f"{TINY.label()} ran out of memory on the cpu device")
    with pytest.raises(ZeroDivisionError), refused_out_of_memory(TINY, device, "dividing"):
        _ = 1 / 0


@pytest.mark.parametrize("kernel_flags", [["--kernel", "flash"], ["--kernels", "xla"],
                                          ["--kernel", "flash", "--devices", "2"]])
def test_a_shapes_run_with_one_impossible_problem_tunes_the_others(
        tmp_path: Path, kernel_flags: list[str]) -> None:
    """One kernel, a kernel choice, one kernel on two worker processes: the impossible problem
    is refused in one line, the problems around it are tuned and published, and the run exits
    1."""
    other = dataclasses.replace(TINY, q_heads=2)
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text(yaml.safe_dump([TINY.to_dict(), IMPOSSIBLE.to_dict(), other.to_dict()]))
    db = f"sqlite:///{tmp_path / 'tune.db'}"
    done = run_cli("tune", *kernel_flags, "--shapes", str(shapes), "--trials", "1", "--db",
                   db, "--json", env={"COLUMNS": "400"}, timeout=300)  # Rich wraps at 80
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    refusals = [line for line in done.stderr.splitlines() if IMPOSSIBLE.label() in line]
    assert len(refusals) == 1 and "GiB on the device" in refusals[0], done.stderr
    summaries = [json.loads(line) for line in done.stdout.splitlines()
                 if line.startswith("{") and json.loads(line).get("summary")]
    assert sorted(s["problem"]["q_heads"] for s in summaries) == [1, 2]
    with Store(db) as store:
        assert store.lookup("xla" if "xla" in kernel_flags else "flash", "cpu",
                            other)[1] == "exact"
