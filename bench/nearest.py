"""Nearest-match lookup cost in a large family, as a ratio to an exact lookup in the same run.

Fills a SQLite file with ``--entries`` tuned problems of one family (same kernel, device,
dtype, head_dim, causal, mode; varied batch, heads and lengths), then times, on one
``storage.Store``, uncached exact lookups (the indexed baseline) and nearest-match lookups of
shapes no entry has, one key per call and in batches of ``--batch`` keys.

    python bench/nearest.py [--entries 5000] [--rounds 30] [--batch 100]

Targets at 5,000 entries: a nearest-match lookup under 10 exact lookups (SQLite, candidates
cached until the next commit); a batch of 100 nearest under 1,000.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

from kernel.config import FlashConfig
from kernel.problem import Problem
from kernel.table import LookupTable, TableEntry
from storage import LookupRequest, Store, upgrade

DEVICE = "TPU v5 lite"


def family(entries: int) -> LookupTable:
    shapes = itertools.product((1, 2, 4, 8, 16, 32), (8, 16, 32, 64), (1, 2, 4, 8),
                               [128 * k for k in range(1, 65)])
    rows = []
    for batch, q_heads, group, q_len in shapes:
        if len(rows) == entries:
            break
        problem = Problem(batch=batch, q_heads=q_heads, kv_heads=q_heads // group, q_len=q_len,
                          kv_len=q_len, head_dim=128)
        rows.append(TableEntry(problem, FlashConfig(block_q=128, block_kv=128), time_ms=1.0))
    return LookupTable("flash", "1", DEVICE, tuple(rows))


def per_call_ms(store: Store, requests: list[LookupRequest], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        store.lookup_many(requests)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        url = f"sqlite:///{Path(directory) / 'bench.db'}"
        upgrade(url)
        with Store(url) as store:
            table = family(args.entries)
            store.import_table(table)
            exact = LookupRequest(DEVICE, table.entries[len(table.entries) // 2].problem)
            # q_len 128 * 65 + 64 is tuned nowhere; the nearest legal entries are near it.
            missing = [LookupRequest(DEVICE, Problem(batch=3, q_heads=24, kv_heads=24,
                                                     q_len=q_len, kv_len=q_len, head_dim=128))
                       for q_len in (384, 1152, 2944, 5248)]
            assert all(found and found[1] == "nearest" for found in store.lookup_many(missing))
            exact_ms = per_call_ms(store, [exact], args.rounds)
            nearest_ms = per_call_ms(store, missing[:1], args.rounds)
            batch = list(itertools.islice(itertools.cycle(missing), args.batch))
            batch_ms = per_call_ms(store, batch, max(3, args.rounds // 10))
    print(f"{len(table.entries)} entries in one family")
    print(f"exact lookup:   {exact_ms:.3f} ms (baseline)")
    print(f"nearest lookup: {nearest_ms:.3f} ms = {nearest_ms / exact_ms:.1f}x exact")
    print(f"batch of {args.batch} nearest: {batch_ms:.1f} ms = {batch_ms / exact_ms:.1f}x exact")


if __name__ == "__main__":
    main()
