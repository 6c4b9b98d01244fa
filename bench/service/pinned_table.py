"""Pinning a large lookup table in the kernel wrapper, and resolving new shapes against it.

Writes a table of N entries and N kernel choices (default 100k each: distinct problems over
batch, heads, sequence lengths, head_dim, causality and mode), then, in a fresh process each,
times and measures (peak RSS) ``Resolver.use_table``, and the first resolution of new shapes
(the kernel pick and the config, as ``flash_attention`` asks them at trace time): shapes that
are in the table (exact) and shapes that are not (nearest). Run it with another checkout's
``kernel`` on ``PYTHONPATH`` for the baseline of a comparison:

    python bench/service/pinned_table.py [--entries 100000] [--shapes 20]
    PYTHONPATH=/path/to/baseline python bench/service/pinned_table.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = """
import dataclasses, json, resource, sys, time
from kernel import Problem, get_target
from kernel.resolve import Resolver, ResolverSettings
path, shapes = sys.argv[1], json.loads(sys.argv[2])
cpu = get_target("cpu")
resolver = Resolver(ResolverSettings())
resolver.kernel("flash")
start = time.perf_counter()
resolver.use_table(path)
pin_s = time.perf_counter() - start
def trace(fields):
    problem = Problem.from_dict(fields)
    pick = resolver.pick(problem, "cpu", "cpu", cpu)
    resolver.resolve(problem, "cpu", pick.kernel.name, cpu, pick.by)
start = time.perf_counter()
trace(shapes.pop("first")[0])  # the first lookup after pinning (an index is built then)
times = {"first_s": time.perf_counter() - start}
for kind, problems in shapes.items():
    start = time.perf_counter()
    for fields in problems:
        trace(fields)
    times[kind] = (time.perf_counter() - start) / len(problems)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"pin_s": pin_s, "rss_mib": rss, **times}))
"""


def problems(count: int) -> list[dict]:
    """``count`` distinct problems of four families (dtype, head_dim fixed; causal x mode)."""
    grid = itertools.product(range(1, 65), (8, 16, 32, 64), (1, 2, 4, 8),
                             (128, 256, 512, 1024, 2048), (128, 256, 512, 1024, 2048),
                             (False, True), ("fwd", "fwd_bwd"))
    out = []
    for batch, q_heads, group, q_len, kv_len, causal, mode in grid:
        out.append(dict(batch=batch, q_heads=q_heads, kv_heads=q_heads // group, q_len=q_len,
                        kv_len=kv_len, head_dim=128, dtype="bfloat16", causal=causal,
                        mode=mode))
        if len(out) == count:
            return out
    raise SystemExit(f"the grid holds fewer than {count} problems")


def write_table(path: Path, count: int) -> None:
    config = {"block_q": 128, "block_kv": 128, "block_kv_compute": 128}
    rows = problems(count)
    table = {"schema_version": 2, "kernel": "flash", "kernel_version": "1", "device_kind": "cpu",
             "entries": [{"problem": p, "config": config, "time_ms": 1.0} for p in rows],
             "choices": [{"problem": p, "kernel": "flash", "config": config,
                          "candidates": {"flash": {"median_ms": 1.0, "iqr_ms": 0.1},
                                         "xla": {"median_ms": 2.0, "iqr_ms": 0.1}}}
                         for p in rows]}
    path.write_text(json.dumps(table))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--shapes", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "table.json"
        write_table(path, args.entries)
        stored = problems(args.entries)
        shapes = {"first": [dict(stored[-1], batch=999)],
                  "exact_s": stored[:: max(1, args.entries // args.shapes)][:args.shapes],
                  "nearest_s": [dict(p, batch=p["batch"] + 1000, q_len=p["q_len"] * 3)
                                for p in stored[:args.shapes]]}
        run = subprocess.run([sys.executable, "-c", MEASURE, str(path), json.dumps(shapes)],
                             capture_output=True, text=True, check=True)
        figures = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"table: {args.entries} entries + {args.entries} choices, "
              f"{path.stat().st_size / 2**20:.0f} MiB")
        print(f"pin: {figures['pin_s']:.2f} s, peak RSS {figures['rss_mib']:.0f} MiB")
        print(f"first resolution after pinning: {figures['first_s'] * 1e3:.0f} ms")
        print(f"then per new shape: exact {figures['exact_s'] * 1e3:.2f} ms, "
              f"nearest {figures['nearest_s'] * 1e3:.2f} ms (pick + config)")


if __name__ == "__main__":
    main()
