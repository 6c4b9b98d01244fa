"""Where a tuning trial's time goes, and trials per minute, before and now, in one run on the
attached device: the same configs (a seeded random sample of the kernel's space) measured by

- ``before``, as ``--before`` says:

  - ``trace`` (the default): the tuner as until issue 63 item 3: its ``step_profile``
    traces with the profiler's defaults, the Python tracer recording every call of every
    thread (the compiles running ahead included) and the host tracer at level 2; two configs
    claimed and compiled ahead, on three threads;
  - ``issue56``: as the tuner was until issue 56: one config compiled ahead, in a pool of
    two; the gate's error and the canary's comparison reduced on the host (every output moved
    there first); the traces as in ``trace``;

- ``now``: as many configs claimed and compiled ahead as the tuner claims for its random
  sampler here (:func:`autotune.measure.claims_ahead`: 5 on a 13-core TPU v5e VM; before,
  ``autotune.measure.AHEAD``, 2, for every sampler); both reduced on the device; the traces
  of :func:`autotune.timing.trace_options`.

    python bench/chip/trial_cost.py [--kernel flash] [--trials 15] [--before trace|issue56]
        [--timing auto|step_profile|...] [--ahead N] [problem flags] [--out F.json]

``--timing step_profile`` times with traces on a CPU too (``auto`` is wallclock there).

Per variant: trials per minute over the whole search (the first compile and the canary
included) and the median seconds of each phase of a trial: ``wait_s`` (its compile not yet
done), ``gate_s`` (one run checked against the reference), ``time_s`` (timing), ``canary_s``,
and ``compile_s`` (run ahead, overlapping the others); with ``step_profile`` timing, of
``time_s``, the median seconds of a trace's stop and of its reading, and its events. Both
variants must find the same best config (the winner's quality is the same); the ratio is
``now`` over ``before``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import jax  # noqa: E402
import numpy as np  # noqa: E402

import autotune.measure as measure  # noqa: E402
from autotune import timing  # noqa: E402
from autotune.search import search  # noqa: E402
from autotune.timing import TIMING_CHOICES  # noqa: E402
from autotune.tune import kernel_space  # noqa: E402
from bench.chip import write_report  # noqa: E402
from kernel import Problem, device_target, get_kernel  # noqa: E402

PHASES = ("compile_s", "wait_s", "gate_s", "time_s", "canary_s")


@contextmanager
def host_comparisons() -> Iterator[None]:
    """The gate and the canary as before, in the same calls: each output converted to a
    numpy float64 array on the host (``np.asarray(x, np.float64)`` of a bf16 JAX array took
    2.3 s for 4 x 16 x 4096 x 128 on a 2-core CPU) and compared there."""
    device_error, device_bits = measure.relative_error, measure.same_bits

    def on_host(tree: Any) -> Any:
        return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)

    measure.relative_error = lambda got, want: device_error(on_host(got), on_host(want))
    measure.same_bits = lambda got, want: all(
        np.array_equal(a, b, equal_nan=True)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    try:
        yield
    finally:
        measure.relative_error, measure.same_bits = device_error, device_bits


@contextmanager
def full_traces() -> Iterator[None]:
    """``step_profile`` traces as before issue 63 item 3: the profiler's default options."""
    lean, timing.trace_options = timing.trace_options, jax.profiler.ProfileOptions
    try:
        yield
    finally:
        timing.trace_options = lean


@contextmanager
def trace_parts(seconds: dict[str, list[float]], events: list[int]) -> Iterator[None]:
    """Records, per ``step_profile`` trace, the seconds its stop took (the profiler collecting
    and writing it) and its reading (xprof's conversion and the parse: ``trace_events``), and
    how many events it held."""
    stop, read = jax.profiler.stop_trace, timing.trace_events

    def timed_stop() -> None:
        start = time.perf_counter()
        stop()
        seconds["stop_s"].append(time.perf_counter() - start)

    def timed_read(logdir: Any) -> list[dict[str, Any]]:
        start = time.perf_counter()
        found = read(logdir)
        seconds["read_s"].append(time.perf_counter() - start)
        events.append(len(found))
        return found

    jax.profiler.stop_trace, timing.trace_events = timed_stop, timed_read
    try:
        yield
    finally:
        jax.profiler.stop_trace, timing.trace_events = stop, read


def run_variant(problem: Problem, kernel_name: str, trials: int, seed: int, *,
                threads: int, ahead: int, method: str = "auto") -> dict[str, Any]:
    kernel = get_kernel(kernel_name)
    device = jax.devices()[0]
    space, base = kernel_space(kernel, problem, device_target(device.platform,
                                                              device.device_kind))
    start = time.perf_counter()
    measurer = measure.Measurer(problem, base, kernel, pool_size=threads, timing=method)
    trace_s: dict[str, list[float]] = {"stop_s": [], "read_s": []}
    trace_events: list[int] = []
    try:
        default = {name: getattr(base, name) for name in space.names}
        with trace_parts(trace_s, trace_events):
            result = search(space, measurer, sampler="random", trials=trials, seed=seed,
                            seeds=[default], prepare=measurer.prepare, ahead=ahead)
    finally:
        measurer.close()
    wall_s = time.perf_counter() - start
    attrs = [t.measurement.attrs for t in result.trials]
    return {
        "compile_threads": threads, "ahead": ahead, "measured": result.measured, "wall_s": round(wall_s, 2),
        "trials_per_min": round(60 * result.measured / wall_s, 2),
        "timing": measurer.timing,
        "median_s": {phase: round(statistics.median(a[phase] for a in attrs if phase in a), 4)
                     for phase in PHASES if any(phase in a for a in attrs)},
        # Of time_s, per trace: the profiler's stop, then xprof's conversion and the parse.
        "trace_median_s": {part: round(statistics.median(values), 4)
                           for part, values in trace_s.items() if values},
        "trace_median_events": statistics.median(trace_events) if trace_events else None,
        "failures": sum(not t.measurement.ok for t in result.trials),
        "best": None if result.best is None else {
            "config": base.replace(**result.best.config).label(problem.mode),
            "time_ms": result.best.value},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="flash")
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mode", default="fwd_bwd", choices=["fwd", "fwd_bwd"])
    parser.add_argument("--before", default="trace", choices=["trace", "issue56"])
    parser.add_argument("--timing", default="auto", choices=TIMING_CHOICES)
    parser.add_argument("--ahead", type=int, help="configs claimed ahead now (default: as the "
                        "tuner's random sampler claims here); 2 keeps the pool of before")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    problem = Problem(batch=args.batch, q_heads=args.heads, kv_heads=args.heads,
                      q_len=args.seq, kv_len=args.seq, head_dim=args.head_dim,
                      dtype="bfloat16", causal=True, mode=args.mode)
    ahead = args.ahead or measure.claims_ahead(sampler_learns=False)  # the sampler is random
    with full_traces():
        if args.before == "issue56":
            with host_comparisons():
                before = run_variant(problem, args.kernel, args.trials, args.seed,
                                     threads=2, ahead=1, method=args.timing)
        else:
            before = run_variant(problem, args.kernel, args.trials, args.seed,
                                 threads=measure.AHEAD + 1, ahead=measure.AHEAD,
                                 method=args.timing)
    now = run_variant(problem, args.kernel, args.trials, args.seed, method=args.timing,
                      threads=ahead + 1, ahead=ahead)
    write_report({
        "problem": problem.label(), "kernel": args.kernel, "trials": args.trials,
        "before_is": args.before,
        "before": before, "now": now,
        "trials_per_min_ratio": round(now["trials_per_min"] / before["trials_per_min"], 2),
        # Both measured the same configs: the same best, or two within each other's noise.
        "same_best": (before["best"] or {}).get("config") == (now["best"] or {}).get("config"),
    }, args.out)


if __name__ == "__main__":
    main()
