"""Deviceless precheck: the VMEM estimate against the Mosaic compiler, and the sweep time it saves.

For each realistic problem (batch 1, 8 heads, ``--seq-len`` tokens (4096), head_dim 128, bf16,
causal; ``fwd`` and ``fwd_bwd``) and TPU generation (v5e: 16 MiB scoped VMEM, v6e: 32 MiB), in
one run:

1. compile every candidate, including those the estimate rejects (``--include-rejected``):
   the compiler's verdict per config gives the estimate's precision (share of admitted configs
   that compile; must be 1.0) and recall (share of compiling configs it admits; target >= 0.9);
2. the sweep time with the estimate against compiling everything, as a ratio: the compile
   seconds of the admitted configs over those of all configs, both measured per config in
   sweep (1); with ``--separate-sweeps`` also the wall time of a second sweep that compiles
   only the admitted configs, over the wall time of sweep (1).

    python bench/kernels/precheck.py [--kernel flash] [--jobs 2] [--timeout 300] [--targets v5e v6e]
                             [--modes fwd fwd_bwd] [--seq-len 4096] [--sample-every 1]
                             [--separate-sweeps] [--out results.jsonl]

The whole 4096-token sweep is about 2,300 compiles (hours on two cores); ``--seq-len 2048``
has about 1,500, and ``--sample-every 7`` compiles every 7th candidate of each (target, mode)
(a deterministic sample, named in the table's title).

``--out`` gets one JSON line per compile result as it arrives (target, mode, result), then one
summary line per problem, so an interrupted run keeps what it measured.

Each config is also counted under its value of the kernel's landscape panel field (flash:
``pipeline_depth``, in ``fwd_bwd`` the depth of the part a candidate varies, such as
``pipeline_depth_dkv``; splash: ``use_fused_bwd_kernel``): a column per value in the table,
then per value the agreement and the mean compile seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TextIO

from autotune.failures import Status
from autotune.precheck import Agreement, PrecheckResult, precheck
from kernel import DEFAULT_KERNEL, Problem, get_kernel, get_target


HEADS = 8


def problem(mode: str, seq_len: int, batch: int = 1, heads: int = HEADS, head_dim: int = 128,
            dtype: str = "bfloat16") -> Problem:
    return Problem(batch=batch, q_heads=heads, kv_heads=heads, q_len=seq_len, kv_len=seq_len,
                   head_dim=head_dim, dtype=dtype, causal=True, mode=mode)


def timed_sweep(prob: Problem, target: str, kernel: str, *, include_rejected: bool, jobs: int,
                timeout: float, sample_every: int,
                out: TextIO | None) -> tuple[list[PrecheckResult], float]:
    done = 0

    def progress(result: PrecheckResult) -> None:
        nonlocal done
        done += 1
        if out:
            out.write(json.dumps({"target": target, "mode": prob.mode, "all": include_rejected,
                                  **result.to_dict()}) + "\n")
            out.flush()
        print(f"\r  {target} {prob.mode} {'all' if include_rejected else 'admitted'}: "
              f"{done} compiled", end="", file=sys.stderr, flush=True)

    start = time.perf_counter()
    results = precheck(prob, get_target(target), get_kernel(kernel).discover(), jobs=jobs,
                       timeout_s=timeout, include_rejected=include_rejected,
                       on_result=progress, sample_every=sample_every)
    seconds = time.perf_counter() - start
    print(f" in {seconds:.0f} s", file=sys.stderr)
    return results, seconds


def panel_of(result: PrecheckResult, default: object, panel: str) -> object:
    """The panel value a candidate tries: of the field named after the ``panel`` field (a
    depth: ``pipeline_depth_dkv``) where it differs from the default config, else the
    default's."""
    config, fields = result.config.to_dict(), default.to_dict()
    varied = [config[f] for f in fields if f.startswith(panel) and config[f] != fields[f]]
    return varied[0] if varied else fields[panel]


def by_panel(results: list[PrecheckResult], prob: Problem, target: str,
             kernel_name: str) -> dict[object, list[PrecheckResult]]:
    kernel = get_kernel(kernel_name)
    default, panel = kernel.default_config(prob, target), kernel.landscape_axes[2]
    groups: dict[object, list[PrecheckResult]] = {}
    for result in results:
        groups.setdefault(panel_of(result, default, panel), []).append(result)
    return dict(sorted(groups.items()))


def mean_s(results: list[PrecheckResult], status: Status) -> str:
    times = [r.compile_s for r in results if r.status == status]
    return f"{statistics.mean(times):.1f}" if times else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default=DEFAULT_KERNEL, help="the kernel to precheck")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compiler processes")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per compile")
    parser.add_argument("--targets", nargs="+", default=["v5e", "v6e"])
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd_bwd"])
    parser.add_argument("--seq-len", type=int, default=4096, help="query and key/value length")
    parser.add_argument("--sample-every", type=int, default=1,
                        help="compile every n-th candidate only (a deterministic sample)")
    parser.add_argument("--separate-sweeps", action="store_true",
                        help="also time a sweep of the admitted configs alone (wall time)")
    parser.add_argument("--out", type=Path, help="append every compile result here (JSON lines)")
    args = parser.parse_args()

    out = args.out.open("a") if args.out else None
    rows = []
    for target in args.targets:
        for mode in args.modes:
            prob = problem(mode, args.seq_len)
            everything, all_s = timed_sweep(prob, target, args.kernel, include_rejected=True,
                                            jobs=args.jobs, timeout=args.timeout,
                                            sample_every=args.sample_every, out=out)
            agreement = Agreement.of(everything)
            admitted_s = None
            if args.separate_sweeps:
                admitted, admitted_s = timed_sweep(prob, target, args.kernel,
                                                   include_rejected=False,
                                                   jobs=args.jobs, timeout=args.timeout,
                                                   sample_every=1, out=out)
                assert args.sample_every > 1 or len(admitted) == agreement.admitted
            rows.append((target, mode, agreement, everything, all_s, admitted_s))
            if out:
                out.write(json.dumps({"target": target, "problem": prob.to_dict(),
                                      "all_s": all_s, "admitted_s": admitted_s,
                                      **agreement.to_dict()}) + "\n")
                out.flush()

    groups_of = lambda target, mode, everything: by_panel(  # noqa: E731
        everything, problem(mode, args.seq_len), target, args.kernel)
    panel = get_kernel(args.kernel).landscape_axes[2]
    values = sorted({v for target, mode, _, everything, *_ in rows
                     for v in groups_of(target, mode, everything)})
    header = (f"{'target':6} {'mode':7} {'configs':>7} {'ok':>4} {'oom':>4} {'other':>5} "
              f"{'admit':>5} {'prec':>5} {'recall':>6} {'ok s':>5} {'oom s':>5} "
              f"{'cpu all':>7} {'cpu est':>7} {'ratio':>5} {'wall all':>8} {'wall est':>8} "
              f"{'ratio':>5} " + " ".join(f"{f'ok {v}':>7}" for v in values))
    sample = (f", every {args.sample_every}th candidate (a deterministic sample)"
              if args.sample_every > 1 else "")
    print(f"\n{args.kernel} 1x{HEADS}x{args.seq_len}x128 bf16 causal{sample}, jobs={args.jobs}, "
          f"timeout={args.timeout:g} s")
    print(header)
    print("-" * len(header))
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    for target, mode, agreement, everything, all_s, admitted_s in rows:
        ok = agreement.counts.get(Status.OK, 0)
        oom = agreement.counts.get(Status.VMEM_OOM, 0)
        cpu_all = sum(r.compile_s for r in everything)
        cpu_est = sum(r.compile_s for r in everything if r.predicted_fit)
        wall = (f"{all_s:8.0f} {admitted_s:8.0f} {admitted_s / all_s:5.2f}"
                if admitted_s is not None else f"{all_s:8.0f} {'-':>8} {'-':>5}")
        groups = groups_of(target, mode, everything)
        per_value = " ".join(
            f"{sum(r.status == Status.OK for r in groups.get(v, [])):>3}/"
            f"{len(groups.get(v, [])):<3}" for v in values)
        print(f"{target:6} {mode:7} {len(everything):7d} {ok:4d} {oom:4d} "
              f"{len(everything) - ok - oom:5d} {agreement.admitted:5d} "
              f"{fmt(agreement.precision):>5} {fmt(agreement.recall):>6} "
              f"{mean_s(everything, Status.OK):>5} {mean_s(everything, Status.VMEM_OOM):>5} "
              f"{cpu_all:7.0f} {cpu_est:7.0f} {cpu_est / cpu_all:5.2f} {wall} {per_value}")
    print("ok s / oom s: mean compile seconds of a config that compiles / overflows VMEM. "
          "cpu all / est: compile seconds summed over all / admitted configs; wall all / est: "
          "wall time of the sweep of all configs / of a separate sweep of the admitted ones "
          f"(--separate-sweeps); ratio = est / all. ok V: configs of {panel} V that compile / "
          "compiled.")
    panel_header = (f"{'target':6} {'mode':7} {'value':>5} {'configs':>7} {'ok':>4} {'oom':>4} "
                    f"{'admit':>5} {'prec':>5} {'recall':>6} {'ok s':>5} {'oom s':>5}")
    print(f"\nper {panel}\n{panel_header}\n" + "-" * len(panel_header))
    for target, mode, _agreement, everything, _all_s, _admitted_s in rows:
        for value, results in groups_of(target, mode, everything).items():
            agreement = Agreement.of(results)
            print(f"{target:6} {mode:7} {value!s:>5} {len(results):7d} "
                  f"{agreement.counts.get(Status.OK, 0):4d} "
                  f"{agreement.counts.get(Status.VMEM_OOM, 0):4d} {agreement.admitted:5d} "
                  f"{fmt(agreement.precision):>5} {fmt(agreement.recall):>6} "
                  f"{mean_s(results, Status.OK):>5} {mean_s(results, Status.VMEM_OOM):>5}")


if __name__ == "__main__":
    main()
