"""Context parallelism's degenerate ring on one device (issue 71 item 8): the training step of
``kernel.context_parallel_attention`` inside a ``jax.shard_map`` over a one-device sequence
axis against the plain ``kernel.flash_attention`` call, which it must cost at most 2% over.

Both steps are the tuner's fwd_bwd step (the gradients of the attention's sum, jitted) of the
same problem, each resolving its config as a model build does; the time of a step is the host
wall time of ``--calls`` back-to-back calls over ``--calls`` (on a TPU v5e the device's busy
time), median over ``--rounds`` interleaved rounds, with its spread (IQR over median). The
report has the ratio (context-parallel over plain; the goal: at most 1.02) and the largest
difference between the two steps' gradients (the same program: 0, ``identical``). On a CPU,
``--interpret`` runs a tiny problem with the kernels in interpret mode: the check only, the
times mean nothing::

    python bench/chip/context_parallel.py [--out F.json]   # b4 h16 s4096 d128 bf16 causal
    python bench/chip/context_parallel.py --interpret
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, PartitionSpec  # noqa: E402

import kernel  # noqa: E402
from autotune.measure import Timing, interleaved  # noqa: E402
from bench.chip import write_report  # noqa: E402
from bench.chip.timing import back_to_back_ms, spread  # noqa: E402
from kernel.contract import example_inputs  # noqa: E402
from kernel.contract import AttentionFn, measured_fn  # noqa: E402

GOAL = 1.02  # the context-parallel step over the plain one, at most


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--interpret", action="store_true",
                        help="a CPU check: a tiny problem, the kernels in interpret mode")
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


def problem_of(args: argparse.Namespace) -> kernel.Problem:
    if args.interpret:
        return kernel.Problem(1, 2, 2, 256, 256, 64, "float32", causal=True, mode="fwd_bwd")
    return kernel.Problem(args.batch, args.heads, args.heads, args.seq, args.seq,
                          args.head_dim, args.dtype, causal=True, mode="fwd_bwd")


def context_parallel_on_one_device() -> AttentionFn:
    """The causal attention of a sequence sharded over a one-device mesh axis ``seq``, as a
    model's attention op runs it (MaxText's style: Auto axes, its own ``shard_map``)."""
    mesh = jax.make_mesh((1,), ("seq",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:1])
    spec = PartitionSpec(None, None, "seq")
    return jax.shard_map(
        lambda q, k, v: kernel.context_parallel_attention(q, k, v, axis_name="seq",
                                                          causal=True),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)


def largest_difference(got: tuple[Any, ...], want: tuple[Any, ...]) -> float:
    return max(float(np.max(np.abs(np.asarray(g, np.float32) - np.asarray(w, np.float32))))
               for g, w in zip(got, want, strict=True))


def main() -> None:
    args = parse_args()
    problem = problem_of(args)
    inputs = example_inputs(problem)
    plain = lambda q, k, v: kernel.flash_attention(q, k, v, causal=True)  # noqa: E731
    steps = {name: jax.jit(measured_fn(problem, attend))
             for name, attend in (("plain", plain),
                                  ("context_parallel", context_parallel_on_one_device()))}
    grads = {name: jax.block_until_ready(step(*inputs)) for name, step in steps.items()}
    timers = {name: lambda step=step: Timing((back_to_back_ms(step, inputs, args.calls),))
              for name, step in steps.items()}
    rows = {name: {"median_ms": round(timing.median_ms, 3),
                   "spread": round(spread(list(timing.samples_ms)), 3)
                   if len(timing.samples_ms) > 1 else 0.0}
            for name, timing in interleaved(timers, args.rounds).items()}
    ratio = rows["context_parallel"]["median_ms"] / rows["plain"]["median_ms"]
    difference = largest_difference(grads["context_parallel"], grads["plain"])
    write_report({"problem": problem.label(), "interpret": args.interpret,
                  "rounds": args.rounds, "calls": args.calls, "rows": rows,
                  "ratio": round(ratio, 4), "goal": GOAL, "within_goal": ratio <= GOAL,
                  "largest_grad_difference": difference, "identical": difference == 0.0,
                  "resolved": {f"{name} {problem.label()}": source.split(",")[0] for
                               (name, _, problem), source
                               in kernel.resolution_sources().items()}}, args.out)


if __name__ == "__main__":
    main()
