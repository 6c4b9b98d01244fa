"""What stopping a search early (``autotune tune --patience P``) costs, replayed on measured
landscapes: our searcher runs ``--budget`` configs per seed, and each run is scored where a
patience of P would have stopped it (after P measured configs without a faster one) against
where it ends. Prints, per patience, the configs measured (mean), the score lost (optimum /
best found; mean), the runs losing over 1% and the worst run. CPU only, no device.

    python bench/patience_replay.py [--landscapes bench/landscapes,bench/landscapes/heldout]
        [--seeds 10] [--budget 30] [--patience 10,15,20] [--out FILE.json]

Why patience is off by default: docs/tuning.md ("Stopping early").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

from bench.search import Curve, _budgets, _landscape, _positive, _run


def stopped_at(curve: Curve, patience: int) -> int:
    """How many configs a search with ``patience`` measures of ``curve`` (best so far after
    each measured config): it stops at the ``patience``-th after its last new best."""
    best, last = None, 0
    for index, value in enumerate(curve):
        if value is not None and (best is None or value < best):
            best, last = value, index
        if index - last >= patience:
            return index + 1
    return len(curve)


def loss_table(runs: list[tuple[str, Curve]], patiences: list[int]) -> dict[int, dict]:
    table = {}
    for patience in patiences:
        measured, lost = [], []
        for path, curve in runs:
            land, stop = _landscape(path), stopped_at(curve, patience)
            measured.append(stop)
            lost.append(land.score(curve[-1]) - land.score(curve[stop - 1]))
        table[patience] = {"measured_mean": statistics.mean(measured),
                           "score_lost_mean": statistics.mean(lost),
                           "runs_losing_over_1pct": sum(x > 0.01 for x in lost),
                           "worst_lost": max(lost), "runs": len(runs)}
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--landscapes", default="bench/landscapes,bench/landscapes/heldout",
                        help="comma-separated directories of *.json.gz landscapes")
    parser.add_argument("--seeds", type=_positive, default=10)
    parser.add_argument("--budget", type=_positive, default=30, help="the tune's --trials")
    parser.add_argument("--patience", type=_budgets, default=[10, 15, 20])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    paths = [str(p) for folder in args.landscapes.split(",")
             for p in sorted(Path(folder).glob("*.json.gz"))]
    jobs = [("ours", path, seed, args.budget, None) for path in paths
            for seed in range(args.seeds)]
    with ProcessPoolExecutor(2) as pool:
        runs = [(job[1], curve) for job, (curve,) in pool.map(_run, jobs)]
    report = {"landscapes": len(paths), "seeds": args.seeds, "budget": args.budget,
              "patience": loss_table(runs, args.patience)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
