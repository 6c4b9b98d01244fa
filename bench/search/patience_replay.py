"""What stopping a search early (``autotune tune --patience P``) costs, replayed on measured
landscapes: our searcher runs ``--budget`` configs per seed with each patience P (the tune's
own stop, ``autotune.search.search(patience=P)``: after P measured configs without a faster
one) and without one, and each stopped run is scored against the run that went on. Prints,
per patience, the configs measured (mean), the score lost (optimum / best found; mean), the
runs losing over 1% and the worst run. CPU only, no device.

    python bench/search/patience_replay.py
        [--landscapes bench/search/landscapes,bench/search/landscapes/heldout] [--seeds 10] [--budget 30] [--patience 10,15,20] [--out FILE.json]

Why patience is off by default: docs/tuning.md ("Stopping early").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from autotune.search import search
from bench.search.replay import SAMPLERS, _budgets, _landscape, _positive

Run = tuple[str, int, int | None]  # landscape path, seed, patience (None: off)


def replay(job: tuple[str, int, int, int | None]) -> tuple[Run, float, int]:
    """One run of our searcher: its score (optimum / best found) and configs measured."""
    path, seed, budget, patience = job
    land = _landscape(path)
    result = search(land.space, land.measure, sampler=SAMPLERS["ours"], trials=budget,
                    seed=seed, patience=patience)
    return (path, seed, patience), land.score(result.curve[-1]), len(result.curve)


def loss_table(runs: dict[Run, tuple[float, int]], patiences: list[int]) -> dict[int, dict]:
    table = {}
    for patience in patiences:
        measured, lost = [], []
        for (path, seed, run_patience), (score, count) in runs.items():
            if run_patience == patience:
                measured.append(count)
                lost.append(runs[path, seed, None][0] - score)
        table[patience] = {"measured_mean": statistics.mean(measured),
                           "score_lost_mean": statistics.mean(lost),
                           "runs_losing_over_1pct": sum(x > 0.01 for x in lost),
                           "worst_lost": max(lost), "runs": len(lost)}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--landscapes",
                        default="bench/search/landscapes,bench/search/landscapes/heldout",
                        help="comma-separated directories of *.json.gz landscapes")
    parser.add_argument("--seeds", type=_positive, default=10)
    parser.add_argument("--budget", type=_positive, default=30, help="the tune's --trials")
    parser.add_argument("--patience", type=_budgets, default=[10, 15, 20])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    paths = [str(p) for folder in args.landscapes.split(",")
             for p in sorted(Path(folder).glob("*.json.gz"))]
    jobs = [(path, seed, args.budget, patience) for path in paths for seed in range(args.seeds)
            for patience in (None, *args.patience)]
    with ProcessPoolExecutor(2) as pool:
        runs = {run: (score, count) for run, score, count in pool.map(replay, jobs)}
    report = {"landscapes": len(paths), "seeds": args.seeds, "budget": args.budget,
              "patience": loss_table(runs, args.patience)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
