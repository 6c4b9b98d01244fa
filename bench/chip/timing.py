"""How stable each timing method is, for a tiny kernel whose dispatch dominates and a larger
one: per-call time under ``step_profile``, ``loop`` and ``wallclock`` in one run, each measured
``--repeats`` times (interleaved, so drift hits all alike), with the spread of the repeats.

Prints per kernel and method the median per-call time, its ratio to ``step_profile``'s and the
spread (IQR over median of the repeats, and max/min), then which method is the most stable and
by how much against ``wallclock``; ends with a JSON line. Runs on whatever JAX sees: on a CPU
the measured functions are XLA programs (``step_profile`` then reads the executable's host-side op
events), on a TPU or GPU the same programs on the device::

    python bench/chip/timing.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from storage import CURRENT_TIMINGS  # noqa: E402

# (batch, heads, kv_heads, q_len, kv_len, head_dim): the tiny one is microseconds of work,
# dispatch-dominated anywhere; the larger one milliseconds (on a CPU a smaller "larger").
KERNELS = {"tiny": (1, 1, 1, 128, 128, 64), "larger": (4, 16, 16, 4096, 4096, 128)}
CPU_KERNELS = {"tiny": (1, 1, 1, 128, 128, 64), "larger": (1, 4, 4, 512, 512, 64)}
METHODS = CURRENT_TIMINGS  # step_profile first: the others are shown over it


def spread(samples: list[float]) -> float:
    """IQR over median of the repeats (relative spread)."""
    q1, median, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / median


def back_to_back_ms(step: Callable[..., Any], inputs: list[Any], calls: int) -> float:
    """Host wall time per call of ``calls`` calls of ``step`` dispatched back to back (the
    last output waited for: the calls run in order): on a TPU v5e, the step's device time."""
    import jax

    start = time.perf_counter()
    for _ in range(calls):
        result = step(*inputs)
    jax.block_until_ready(result)
    return (time.perf_counter() - start) * 1e3 / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="measurements per method")
    parser.add_argument("--kernel", default="xla", help="the registered kernel to time")
    args = parser.parse_args()

    import jax

    from autotune.measure import Measurer
    from kernel import Problem, get_kernel

    kernel = get_kernel(args.kernel)
    dtype = "float32" if jax.devices()[0].platform == "cpu" else "bfloat16"
    results: dict[str, Any] = {"device": jax.devices()[0].device_kind, "kernel": kernel.name}
    shapes = CPU_KERNELS if jax.devices()[0].platform == "cpu" else KERNELS
    for name, (batch, heads, kv_heads, q_len, kv_len, head_dim) in shapes.items():
        problem = Problem(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype)
        config = kernel.default_config(problem)
        measurers = {m: Measurer(problem, config, kernel, timing=m, min_time_s=0.05)
                     for m in METHODS}
        try:
            programs = {m: measurers[m].compile(kernel.build(problem, config),
                                                kernel.profile_names) for m in METHODS}
            samples: dict[str, list[float]] = {m: [] for m in METHODS}
            for _ in range(args.repeats):
                for method in METHODS:
                    samples[method].append(measurers[method].time(programs[method]).median_ms)
        finally:
            for measurer in measurers.values():
                measurer.close()
        profile_ms = statistics.median(samples[METHODS[0]])
        rows = {m: {"median_ms": statistics.median(s), "over_profile":
                    statistics.median(s) / profile_ms, "spread": spread(s),
                    "max_over_min": max(s) / min(s)} for m, s in samples.items()}
        stablest = min(rows, key=lambda m: rows[m]["spread"])
        results[name] = {"problem": problem.label(), "methods": rows, "stablest": stablest,
                         "wallclock_spread_over_stablest":
                         rows["wallclock"]["spread"] / rows[stablest]["spread"]}
        print(f"{name} ({problem.label()}):")
        for method, row in rows.items():
            print(f"  {method:9s} {row['median_ms']:.4f} ms/call ({row['over_profile']:.2f}x "
                  f"{METHODS[0]}), spread {row['spread']:.1%} IQR/median, "
                  f"max/min {row['max_over_min']:.2f}")
        print(f"  most stable: {stablest}, wallclock's spread "
              f"{results[name]['wallclock_spread_over_stablest']:.1f}x its")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
