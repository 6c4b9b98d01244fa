"""Search quality and overhead on measured landscapes: our searcher vs plain Optuna TPE vs random.

For every ``*.json.gz`` landscape in the directory (default ``bench/landscapes``) it replays
each sampler with ``--seeds`` seeds for ``max(budgets)`` measured configs and prints score@B =
optimum / best found after B measured configs (median over seeds; mean in brackets), then the
tuner's own overhead per trial (everything but ``measure``) with in-memory and SQLite storage.

    python bench/search.py [LANDSCAPE_DIR] [--seeds 10] [--budgets 50,100,200] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import optuna

from autotune.landscape import load_landscape
from autotune.search import search

SAMPLERS = {"ours": "tpe", "plain TPE": "plain-tpe", "random": "random"}
_LANDSCAPES: dict[str, object] = {}


def _run(job: tuple[str, str, int, int]) -> tuple[str, str, int, list[float | None], float]:
    path, sampler, seed, budget = job
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    land = _LANDSCAPES.get(path) or _LANDSCAPES.setdefault(path, load_landscape(path))
    start = time.perf_counter()
    result = search(land.space, land.measure, sampler=sampler, trials=budget, seed=seed)
    return path, sampler, seed, result.curve, time.perf_counter() - start


def _score_at(land, curve: list[float | None], budget: int) -> float:
    return land.score(curve[min(budget, len(curve)) - 1] if curve else None)


def _overhead(path: str, trials: int) -> dict[str, float]:
    """Milliseconds per trial spent outside ``measure`` (our searcher), per storage."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    land = load_landscape(path)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, storage in (("in-memory", None), ("sqlite", f"sqlite:///{tmp}/bench.db")):
            result = search(land.space, land.measure, storage=storage, trials=trials, seed=0)
            out[name] = 1000 * result.overhead_per_trial_s
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("landscapes", nargs="?",
                        default=str(Path(__file__).resolve().parent / "landscapes"))
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--budgets", default="50,100,200")
    parser.add_argument("--overhead-trials", type=int, default=100)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    budgets = sorted(int(b) for b in args.budgets.split(","))
    paths = sorted(str(p) for p in Path(args.landscapes).glob("*.json.gz"))
    if not paths:
        sys.exit(f"no *.json.gz landscapes in {args.landscapes}; pass their directory "
                 "(see bench/landscapes/README.md)")
    jobs = [(p, s, seed, budgets[-1]) for p in paths for s in SAMPLERS.values()
            for seed in range(args.seeds)]
    start = time.perf_counter()
    with Pool(os.cpu_count()) as pool:
        runs = pool.map(_run, jobs, chunksize=1)
    wall = time.perf_counter() - start
    lands = {p: load_landscape(p) for p in paths}
    report: dict[str, dict] = {}
    for p in paths:
        report[lands[p].name] = row = {}
        for label, sampler in SAMPLERS.items():
            mine = [r for r in runs if r[0] == p and r[1] == sampler]
            scores = {b: [_score_at(lands[p], r[3], b) for r in mine] for b in budgets}
            row[label] = {
                **{f"median@{b}": statistics.median(s) for b, s in scores.items()},
                **{f"mean@{b}": statistics.mean(s) for b, s in scores.items()},
                "seconds_per_run": statistics.mean(r[4] for r in mine),
            }
    overhead = _overhead(paths[-1], args.overhead_trials)
    if args.json:
        print(json.dumps({"seeds": args.seeds, "budgets": budgets, "scores": report,
                          "overhead_ms_per_trial": overhead, "wall_s": wall}))
        return
    header = "| landscape | searcher | " + " | ".join(f"score@{b}" for b in budgets) + \
        " | s/run |"
    print(f"score@B = optimum / best after B measured configs: median over {args.seeds} seeds "
          "(mean)\n")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name, row in report.items():
        for label, cells in row.items():
            scores = " | ".join(f"{cells[f'median@{b}']:.3f} ({cells[f'mean@{b}']:.3f})"
                                for b in budgets)
            print(f"| {name} | {label} | {scores} | {cells['seconds_per_run']:.1f} |")
    print(f"\nour searcher's overhead per trial ({args.overhead_trials} trials on "
          f"{Path(paths[-1]).name}): " + ", ".join(f"{k} {v:.1f} ms" for k, v in
                                                   overhead.items()))
    print(f"benchmark wall time: {wall:.0f} s on {os.cpu_count()} processes")


if __name__ == "__main__":
    main()
