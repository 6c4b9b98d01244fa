"""The correctness gate's reference on the attached device (issue 60 item 2): for grid problem 6
(one Llama-3-8B layer at 8k tokens, fwd_bwd, bf16) and the same with a window and a soft cap,
the compiled reference's memory analysis, ``check_fits``'s verdict and the reference's run
time; and, at a size the full reference fits, how far the blockwise reference is from it.

    python bench/chip/reference_memory.py [--out FILE]

On a TPU v5e (15.75 GB) each problem should fit, its temporaries a little over 1 GiB (the
full reference's: 24.4 GB), and the agreement be about 1e-6 (both float32 at ``highest``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import jax  # noqa: E402
import numpy as np  # noqa: E402

from autotune.failures import ProblemTooLarge  # noqa: E402
from autotune.measure import (GIB, check_fits, compiled_reference,  # noqa: E402
                              device_memory_bytes, reference_footprint, relative_error)
from bench.chip import write_report  # noqa: E402
from kernel import Problem, reference_attention  # noqa: E402
from kernel.contract import example_inputs  # noqa: E402
from kernel.contract import measured_fn  # noqa: E402

LLAMA_8K = Problem(batch=2, q_heads=32, kv_heads=8, q_len=8192, kv_len=8192, head_dim=128,
                   dtype="bfloat16", causal=True, mode="fwd_bwd")
PROBLEMS = (LLAMA_8K, dataclasses.replace(LLAMA_8K, window=(1024, 0), softcap=30.0))
AGREEMENT = dataclasses.replace(LLAMA_8K, batch=1, q_len=2048, kv_len=2048, dtype="float32")


def gate_figures(problem: Problem, device: jax.Device) -> dict[str, object]:
    """The reference's footprint, whether it fits, and one run's seconds."""
    footprint = reference_footprint(problem, device)
    figures: dict[str, object] = {
        "problem": problem.label(), "temps_gib": footprint.reference_temps / GIB,
        "inputs_gib": footprint.inputs / GIB, "total_gib": footprint.total / GIB}
    try:
        check_fits(problem, device)
    except ProblemTooLarge as error:
        return {**figures, "fits": str(error)}
    inputs = [jax.device_put(x, device) for x in example_inputs(problem)]
    run = compiled_reference(problem, device)
    jax.block_until_ready(run(*inputs))
    start = time.perf_counter()
    jax.block_until_ready(run(*inputs))
    return {**figures, "fits": True, "run_s": time.perf_counter() - start}


def agreement(device: jax.Device) -> float:
    """The blockwise reference's largest error (dq, dk, dv) against the full one."""
    inputs = [jax.device_put(x, device) for x in example_inputs(AGREEMENT)]
    full = measured_fn(AGREEMENT, functools.partial(reference_attention, causal=True))
    with jax.default_matmul_precision("highest"):
        want = jax.jit(full)(*inputs)
    return relative_error(compiled_reference(AGREEMENT, device)(*inputs), want)


def main() -> None:
    parser = argparse.ArgumentParser(description="The gate reference's memory, fit, run time "
                                     "and agreement on the attached device.")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = jax.devices()[0]
    write_report({"memory_gib": (device_memory_bytes(device) or np.nan) / GIB,
                  "problems": [gate_figures(p, device) for p in PROBLEMS],
                  "agreement": agreement(device)}, args.out)


if __name__ == "__main__":
    main()
