"""Memory of a long tuning run: 200 measured configs in one process.

Tunes several small forward problems one after the other (the default ``tpe`` searcher, or
``--sampler grid``; one Optuna study per problem in one SQLite file, a Measurer per problem, as
``autotune tune --shapes`` does), each until its legal space is exhausted, until ``--trials``
distinct configs have been compiled, checked and timed, and prints the
process's resident set size every ``--every`` trials. The figure of merit is the growth from
trial ``--every`` (caches and the compiler warmed up) to the last trial, per 100 trials.

    python bench/service/soak.py [--trials 200] [--every 50] [--sampler tpe|grid] [--json]

Target: growth under 10% of the RSS at trial ``--every`` (a leak grows linearly with trials).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from kernel import Problem

PAGE = os.sysconf("SC_PAGE_SIZE")
# Six forward problems with 36 legal configs each (q_len = kv_len = 512 on the CPU target).
PROBLEMS = [Problem(batch=1, q_heads=qh, kv_heads=kvh, q_len=512, kv_len=512, head_dim=128,
                    dtype="float32", causal=causal, mode="fwd")
            for qh, kvh in ((1, 1), (2, 1), (2, 2)) for causal in (False, True)]
TARGET_GROWTH = 0.10


def rss_mib() -> float:
    """Current resident set size (``/proc/self/statm``), after a full garbage collection."""
    gc.collect()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE / (1 << 20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--sampler", choices=("tpe", "grid"), default="tpe")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = parser.parse_args()

    import jax

    from autotune.measure import Measurer
    from autotune.search import search
    from storage.studies import get_storage
    from autotune.tune import kernel_space
    from kernel import DEFAULT_KERNEL, device_target, get_kernel

    device = jax.devices()[0]
    target = device_target(device.platform, device.device_kind)
    kernel = get_kernel(DEFAULT_KERNEL).discover()
    marks: list[dict[str, float]] = []
    start = time.perf_counter()
    measured = 0
    failures = 0

    def on_trial(result, best) -> None:  # noqa: ANN001
        nonlocal measured, failures
        measured += 1
        failures += not result.measurement.ok
        if measured % args.every == 0 or measured == args.trials:
            mark = {"trials": measured, "rss_mib": round(rss_mib(), 1),
                    "elapsed_s": round(time.perf_counter() - start, 1)}
            marks.append(mark)
            print(f"trial {measured:4d}  rss {mark['rss_mib']:8.1f} MiB  "
                  f"{mark['elapsed_s']:7.1f} s", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        storage = get_storage(f"sqlite:///{Path(tmp) / 'soak.db'}")
        print(f"start: rss {rss_mib():.1f} MiB (max {_max_rss_mib():.1f})", flush=True)
        for problem in PROBLEMS:  # each problem's space is measured whole, then the next
            if measured >= args.trials:
                break
            space, base = kernel_space(kernel, problem, target)
            measurer = Measurer(problem, base, kernel)
            try:
                search(space, measurer, storage=storage, study_name=f"soak/{problem.label()}",
                       sampler=args.sampler, trials=args.trials - measured,
                       on_trial=on_trial)
            finally:
                measurer.close()
    if measured < args.trials:
        print(f"only {measured} legal configs in {len(PROBLEMS)} problems; lower --trials",
              file=sys.stderr)
        return 2

    first, last = marks[0], marks[-1]
    growth = last["rss_mib"] - first["rss_mib"]
    per_100 = growth / max(1, last["trials"] - first["trials"]) * 100
    verdict = growth <= TARGET_GROWTH * first["rss_mib"]
    print(f"growth from trial {first['trials']} to {last['trials']}: {growth:+.1f} MiB "
          f"({growth / first['rss_mib']:+.1%}, {per_100:+.1f} MiB per 100 trials); "
          f"peak RSS {_max_rss_mib():.1f} MiB; {failures} failed trials; "
          f"{'OK' if verdict else 'OVER TARGET'} (target <= {TARGET_GROWTH:.0%})")
    if args.json:
        print(json.dumps({"marks": marks, "growth_mib": round(growth, 1),
                          "growth_per_100_trials_mib": round(per_100, 2),
                          "peak_rss_mib": round(_max_rss_mib(), 1), "failures": failures,
                          "ok": verdict}))
    return 0 if verdict else 1


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    sys.exit(main())
