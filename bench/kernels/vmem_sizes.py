"""Each kernel's scoped VMEM allocation per config, measured deviceless, against the estimate.

``bench/kernels/precheck.py`` gives the compiler's verdict at a target's limit; this gives the
bytes behind it, so the estimate can be compared with the allocation itself. Each sampled
candidate (estimate-rejected ones included; bench/kernels/precheck.py's problem) is compiled with
a scoped VMEM limit of 1 KiB, which the first kernel overflows with a ``CompileTimeScopedVmemOom`` naming its
allocation; the limit is raised past it and the compile repeated until it succeeds, or until
the compiler says the whole program outgrew the chip's VMEM (v4), recorded as ``program``. A
kernel that fits a limit raised for another is not reported (it needs less). A config fits the
target when its largest allocation is within the target's limit.

    python bench/kernels/vmem_sizes.py --kernel splash --targets v5e v6e --seq-len 8192 \\
        --sample-every 40 [--batch 1 --heads 8] [--head-dim 128 --dtype bfloat16] \\
        [--modes fwd fwd_bwd] [--out sizes.jsonl]
    python bench/kernels/vmem_sizes.py --kernel splash \\
        --rescore bench/kernels/data/splash_vmem/*.jsonl

Prints one line per config (MiB measured per kernel, the estimate's verdict, the compiler's)
and per (target, mode; batch and heads where not 1 and 8, head_dim and dtype where not 128 and
bf16): sampled, fit, overflow, admitted, precision and recall. ``--rescore`` compiles nothing: it
judges the current estimate against measurements saved with ``--out`` (``bench/kernels/data/``
keeps splash's, and flash's float32 sweeps), so a change to the estimate is checked in a
second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from autotune.failures import Status, physical_vmem_use, scoped_vmem_allocation
from autotune.precheck import Agreement, Candidate, PrecheckResult, candidates
from kernel import Problem, Target, TunableKernel, get_kernel, get_target
from kernel.aot import compile_for_target
from kernel.rules import vmem_limit_violations
from kernel.targets import MiB

sys.path.insert(0, str(Path(__file__).parent))
from precheck import HEADS, problem  # noqa: E402  (bench/kernels/precheck.py's problem)

LIMIT_STEP_KIB = 16  # raise the limit this far past a reported allocation


def allocations(kernel: TunableKernel, prob: Problem, candidate: Candidate,
                target: str) -> dict[str, int]:
    """Scoped VMEM bytes per kernel that overflowed a rising limit (module docstring)."""
    limit_kib, sizes = 1, {}
    while True:
        try:
            compile_for_target(kernel, prob, candidate.config, target,
                               {"xla_tpu_scoped_vmem_limit_kib": limit_kib},
                               forward_only=candidate.forward_only)
            return sizes
        except Exception as error:  # noqa: BLE001 (any compiler failure is reported)
            found = scoped_vmem_allocation(str(error))
            if found is None:
                program = physical_vmem_use(str(error))
                if program is None:
                    raise
                return {**sizes, "program": program}  # over the chip's VMEM at any limit
            name, size = found
            sizes[name] = size
            limit_kib = size // 1024 + LIMIT_STEP_KIB


def status(sizes: dict[str, int], target: Target) -> Status:
    """The compiler's verdict at the target's limit: its largest allocation fits, or not."""
    return Status.VMEM_OOM if vmem_limit_violations(sizes, target) else Status.OK


def rescored(kernel: TunableKernel,
             paths: list[Path]) -> dict[tuple[str, Problem], list[PrecheckResult]]:
    """Saved measurements (``--out`` lines) judged by the current estimate, per (target,
    problem): fits when the largest allocation is within the target's limit. Lines without a
    batch, heads, head_dim or dtype field were measured at batch 1, ``HEADS`` heads, d128 bf16."""
    out: dict[tuple[str, Problem], list[PrecheckResult]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            target = get_target(row["target"])
            config = kernel.config_from_dict(row["config"])
            prob = problem(row["mode"], row["seq_len"], row.get("batch", 1),
                           row.get("heads", HEADS), row.get("head_dim", 128),
                           row.get("dtype", "bfloat16"))
            admitted = not kernel.violations(prob, config, target)
            out.setdefault((target.name, prob), []).append(PrecheckResult(
                config, status(row["allocations"], target), 0.0, admitted))
    return out


def report(target_name: str, prob: Problem, results: list[PrecheckResult]) -> None:
    """One summary line: sampled, fit, overflow, admitted, precision and recall."""
    agreement = Agreement.of(results)
    shape = "" if (prob.batch, prob.q_heads) == (1, HEADS) else (
        f" batch {prob.batch} heads {prob.q_heads}")
    if (prob.head_dim, prob.dtype) != (128, "bfloat16"):
        shape += f" d{prob.head_dim} {prob.dtype}"
    print(f"{target_name} {prob.mode} seq {prob.q_len}{shape}: {len(results)} sampled, "
          f"{agreement.compiled_ok} fit, {len(results) - agreement.compiled_ok} "
          f"overflow, {agreement.admitted} admitted, precision {agreement.precision}, "
          f"recall {agreement.recall}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", required=True, help="the kernel to measure")
    parser.add_argument("--targets", nargs="+", default=["v5e"])
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"])
    parser.add_argument("--seq-len", type=int, default=4096, help="query and key/value length")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=HEADS, help="query and key/value heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sample-every", type=int, default=1,
                        help="measure every n-th candidate only (a deterministic sample)")
    parser.add_argument("--out", type=Path, help="append every measurement here (JSON lines)")
    parser.add_argument("--rescore", type=Path, nargs="+",
                        help="judge the estimate against these saved measurements; no compiles")
    args = parser.parse_args()

    kernel = get_kernel(args.kernel).discover()
    if args.rescore:
        for (target_name, prob), results in rescored(kernel, args.rescore).items():
            report(target_name, prob, results)
        return
    for target_name in args.targets:
        target = get_target(target_name)
        for mode in args.modes:
            prob = problem(mode, args.seq_len, args.batch, args.heads, args.head_dim, args.dtype)
            todo = candidates(prob, target, kernel, include_rejected=True)[::args.sample_every]
            results = []
            for candidate in todo:
                start = time.perf_counter()
                sizes = allocations(kernel, prob, candidate, target_name)
                results.append(PrecheckResult(candidate.config, status(sizes, target),
                                              time.perf_counter() - start,
                                              candidate.predicted_fit))
                mib = " ".join(f"{name} {size / MiB:.2f}" for name, size in sizes.items())
                print(f"{target_name} {mode} {candidate.config.label()}: {mib} MiB; estimate "
                      f"{'fits' if candidate.predicted_fit else 'rejects'}, compiler "
                      f"{'fits' if results[-1].status == Status.OK else 'overflows'}", flush=True)
                if args.out:
                    with args.out.open("a") as out:
                        out.write(json.dumps({"target": target_name, "mode": mode,
                                              "seq_len": args.seq_len, "batch": args.batch,
                                              "heads": args.heads,
                                              "head_dim": args.head_dim, "dtype": args.dtype,
                                              "forward_only": candidate.forward_only,
                                              "allocations": sizes,
                                              **results[-1].to_dict()}) + "\n")
            report(target_name, prob, results)


if __name__ == "__main__":
    main()
