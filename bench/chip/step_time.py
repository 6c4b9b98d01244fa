"""Whether the tuner's time is the time of the step a training step runs (issue 60, item 1).

For every kernel at two problems, the default config's figure as the tuner publishes it (a
``Measurer`` with ``--timing``, ``auto`` by default: ``step_profile`` on a TPU, confirmed in
interleaved rounds as ``autotune tune`` confirms), against the host wall time of 10
back-to-back calls of the same compiled step (dispatch paid once per 10 calls, so the device's
time dominates), and their ratio: the goal is within 3%. Beside it the named kernels' part of
the step (what the retired ``profile`` timing counted) and their share.

On a TPU, from the repository root (one chip command: ``bash bench/tpu_session.sh steptime``)::

    python bench/chip/step_time.py [--problems 1,2] [--rounds 5] [--out step-time.json]

``--interpret`` runs tiny problems on a CPU (the Pallas kernels interpreted, the TPU-only
kernels listed as skipped): the pipeline, not a device figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from autotune.measure import Measurer, Program  # noqa: E402
from bench.chip import write_report  # noqa: E402
from bench.chip.timing import back_to_back_ms, spread  # noqa: E402
from bench.chip.tpu_check import runs_here, target_here  # noqa: E402
from kernel import Problem, get_kernel  # noqa: E402

KERNELS = ("flash", "splash", "jax_tpu_flash", "xla")
PROBLEMS = {  # the two: MHA at d128, and GQA (8 q heads over 4 kv heads) at d256
    1: Problem(4, 16, 16, 4096, 4096, 128, "bfloat16", True, "fwd_bwd"),
    2: Problem(4, 8, 4, 4096, 4096, 256, "bfloat16", True, "fwd_bwd"),
}
TINY = {1: Problem(1, 2, 2, 256, 256, 128, "float32", True, "fwd_bwd"),
        2: Problem(1, 2, 1, 256, 256, 128, "float32", True, "fwd_bwd")}
CALLS = 10  # back-to-back calls per wall-time sample
GOAL = 0.03  # the tuner's figure within 3% of the wall time per call


def wall_ms(measurer: Measurer, program: Program, repeats: int) -> list[float]:
    """Per repeat, the host wall time of ``CALLS`` back-to-back calls of ``program``'s
    executable over ``CALLS``."""
    return [back_to_back_ms(program.compiled, measurer.inputs, CALLS) for _ in range(repeats)]


def measure(name: str, problem: Problem, args: argparse.Namespace) -> dict[str, Any]:
    """One kernel's row: its default config's tuner figure, wall time and their ratio, or
    why it was not measured."""
    kernel = get_kernel(name).discover()
    reason = runs_here(kernel, args.interpret)
    if reason:
        return {"skipped": reason}
    try:
        config = kernel.default_config(problem, target_here(kernel))
        with closing(Measurer(problem, config, kernel, timing=args.timing)) as measurer:
            timing = measurer.confirm([config], rounds=args.rounds).get(config)
            program, failure = measurer.checked(config)  # the confirmed program, held
            if timing is None or program is None:
                return {"failure": failure.status if failure else "not confirmed",
                        "error": failure.attrs.get("error", "") if failure else ""}
            walls = wall_ms(measurer, program, args.rounds)
    except Exception as error:  # noqa: BLE001 - a kernel that cannot run it is a row too
        return {"failure": type(error).__name__, "error": str(error).splitlines()[0]}
    wall = statistics.median(walls)
    ratio = timing.median_ms / wall
    kernels = timing.kernel_median_ms
    return {"config": config.label(problem.mode), "timing": measurer.timing,
            "tuner_ms": round(timing.median_ms, 4), "tuner_iqr_ms": round(timing.iqr_ms, 4),
            "wall_ms": round(wall, 4), "wall_spread": round(spread(walls), 4),
            "tuner_over_wall": round(ratio, 4), "within_goal": abs(ratio - 1) <= GOAL,
            "kernels_ms": None if kernels is None else round(kernels, 4),
            "kernels_share": None if kernels is None else round(kernels / timing.median_ms, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="1,2", help="which of the two problems: 1, 2 "
                        "or 1,2")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--rounds", type=int, default=5, help="confirmation rounds, and "
                        "wall-time samples")
    parser.add_argument("--timing", default="auto", help="the tuner's --timing")
    parser.add_argument("--interpret", action="store_true", help="tiny problems on a CPU")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.rounds < 4:
        parser.error("--rounds must be at least 4 (the wall time's spread takes quartiles)")
    shapes = TINY if args.interpret else PROBLEMS
    rows = []
    for index in (int(p) for p in args.problems.split(",")):
        problem = shapes[index]
        for name in args.kernels.split(","):
            row = {"problem": problem.label(), "kernel": name,
                   **measure(name, problem, args)}
            print(row, file=sys.stderr, flush=True)
            rows.append(row)
    measured = [r for r in rows if "tuner_over_wall" in r]
    write_report({"goal": f"tuner's figure within {GOAL:.0%} of the wall time of {CALLS} "
                          "back-to-back calls, per call", "rows": rows,
                  "all_within_goal": bool(measured) and all(r["within_goal"] for r in measured)},
                 args.out)


if __name__ == "__main__":
    main()
