"""How often one run of ``bench/search/replay.py`` can meet issue 17's goal, for searchers whose
strength is known: the power of the goal, measured on the landscapes themselves.

The goal: at each budget (50, 100, 200 measured configs), on every landscape, the median, mean
and 10th percentile of a searcher's scores over one run of 20 seeds are each at least plain
TPE's on the same seeds. A searcher only as good as plain TPE meets it when its seeds are lucky.
How much better must one be to meet it in most runs? This script replays plain TPE and ours on
``--seeds`` seeds (0, 1, ...) up to the largest of ``--factors`` times the largest budget, draws
``--draws`` runs of ``--run`` seeds from them without replacement, and counts the runs that
meet the goal, for each factor k:

- **plain TPE with k times the configs** (its score after kB configs counted as its score@B),
  against plain TPE on other seeds (the two runs' seeds are disjoint): a searcher exactly k
  times as sample-efficient as plain TPE, and no different otherwise. k = 1 is plain TPE
  against itself;
- **ours with k times the configs** against plain TPE on the same seeds: k = 1 is the goal as
  ``bench/search/replay.py`` judges it.

``--tolerance T`` counts a statistic as met when it is short by at most T (the goal as written:
0). Kernel Tuner is left out: the goal also asks for each statistic at least the best of six
strategies', which only lowers these shares.

    python bench/search/goal_power.py [LANDSCAPE_DIR] [--seeds 60] [--run 20] [--draws 2000]
        [--factors 1,1.5,2] [--budgets 50,100,200] [--tolerance 0] [--json]

With the defaults on ``bench/search/landscapes``: about 50 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from collections import Counter
from multiprocessing import Pool
from pathlib import Path

from rich.console import Console
from rich.progress import track

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/search/replay.py's helpers
from replay import STATISTICS, _budgets, _landscape, _positive, _run, _score_at

# Scores[landscape][budget] = one score per seed, in seed order.
Scores = dict[str, dict[int, list[float]]]


def shortfalls(candidate: Scores, baseline: Scores, budgets: list[int], factor: float,
               candidate_seeds: list[int], baseline_seeds: list[int],
               tolerance: float) -> list[str]:
    """The statistics ("landscape@B statistic") in which ``candidate`` after ``factor`` times B
    configs on ``candidate_seeds`` falls short of ``baseline`` after B on ``baseline_seeds`` by
    more than ``tolerance``: the goal is met when there are none."""
    short = []
    for name, row in baseline.items():
        for b in budgets:
            ours = [candidate[name][scaled(b, factor)][s] for s in candidate_seeds]
            theirs = [row[b][s] for s in baseline_seeds]
            short += [f"{name}@{b} {stat}" for stat, f in STATISTICS.items()
                      if f(ours) < f(theirs) - tolerance]
    return short


def power(candidate: Scores, baseline: Scores, budgets: list[int], factor: float, *,
          seeds: int, run: int, draws: int, same_seeds: bool, tolerance: float,
          rng: random.Random) -> dict:
    """The share of ``draws`` runs of ``run`` seeds (of ``seeds``) in which ``candidate`` with
    ``factor`` times the configs meets the goal against ``baseline``: on the same seeds, or on
    disjoint ones; with the count of statistics short per run and the most often short ones."""
    counts, which = [], Counter()
    for _ in range(draws):
        picked = rng.sample(range(seeds), run if same_seeds else 2 * run)
        ours, theirs = (picked, picked) if same_seeds else (picked[:run], picked[run:])
        short = shortfalls(candidate, baseline, budgets, factor, ours, theirs, tolerance)
        counts.append(len(short))
        which.update(short)
    deciles = statistics.quantiles(counts, n=10, method="inclusive")
    return {"factor": factor, "met": sum(c == 0 for c in counts) / draws,
            "short_median": statistics.median(counts), "short_p10": deciles[0],
            "short_p90": deciles[-1],
            "most_often_short": {s: n / draws for s, n in which.most_common(5)}}


def scaled(budget: int, factor: float) -> int:
    return round(budget * factor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("landscapes", nargs="?",
                        default=str(Path(__file__).resolve().parent / "landscapes"))
    parser.add_argument("--seeds", type=_positive, default=60, help="seeds replayed")
    parser.add_argument("--run", type=_positive, default=20, help="seeds in one run")
    parser.add_argument("--draws", type=_positive, default=2000)
    parser.add_argument("--budgets", type=_budgets, default="50,100,200")
    parser.add_argument("--factors", type=_factors, default="1,1.5,2")
    parser.add_argument("--tolerance", type=float, default=0.0)
    parser.add_argument("--jobs", type=_positive, default=os.cpu_count())
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if 2 * args.run > args.seeds:
        parser.error(f"--seeds {args.seeds} cannot hold two disjoint runs of --run {args.run}; "
                     f"pass --seeds {2 * args.run} or more")
    paths = sorted(str(p) for p in Path(args.landscapes).glob("*.json.gz"))
    if not paths:
        sys.exit(f"no *.json.gz landscapes in {args.landscapes}; pass their directory "
                 "(see bench/search/landscapes/README.md)")
    needed = sorted({scaled(b, k) for b in args.budgets for k in args.factors})
    jobs = [(label, p, seed, needed[-1], None) for label in ("plain TPE", "ours")
            for p in paths for seed in range(args.seeds)]
    with Pool(args.jobs) as pool:  # imap keeps job order: seeds ascending per landscape
        runs = list(track(pool.imap(_run, jobs), total=len(jobs), description="replaying",
                          console=Console(stderr=True)))
    scores: dict[str, Scores] = {"plain TPE": {}, "ours": {}}
    for (label, path, *_), (curve,) in runs:
        land = _landscape(path)
        row = scores[label].setdefault(land.name, {})
        for b in needed:
            row.setdefault(b, []).append(_score_at(land, curve, b))
    rng = random.Random(0)
    tpe = scores["plain TPE"]
    table = {label: [power(scores[label], tpe, args.budgets, k, seeds=args.seeds, run=args.run,
                           draws=args.draws, same_seeds=label == "ours",
                           tolerance=args.tolerance, rng=rng) for k in args.factors]
             for label in ("plain TPE", "ours")}
    if args.json:
        print(json.dumps({"seeds": args.seeds, "run": args.run, "draws": args.draws,
                          "budgets": args.budgets, "tolerance": args.tolerance,
                          "power": table}))
        return
    print(f"runs of {args.run} seeds drawn {args.draws} times from {args.seeds}; the goal: each "
          f"median, mean and 10th percentile at {', '.join(map(str, args.budgets))} on "
          f"{len(paths)} landscapes at least plain TPE's (tolerance {args.tolerance})\n")
    print("| candidate | configs | runs meeting the goal | statistics short per run: median "
          "(10th-90th) | most often short (share of runs) |")
    print("|---|---|---|---|---|")
    for label, rows in table.items():
        other = "other seeds" if label == "plain TPE" else "same seeds"
        for row in rows:
            often = ", ".join(f"{s} {v:.0%}" for s, v in row["most_often_short"].items())
            print(f"| {label} ({other}) | {row['factor']:g}x | {row['met']:.1%} | "
                  f"{row['short_median']:g} ({row['short_p10']:g}-{row['short_p90']:g}) of "
                  f"{3 * len(args.budgets) * len(paths)} | {often} |")


def _factors(text: str) -> list[float]:
    """An argparse type: comma-separated budget factors of at least 1, sorted, each once."""
    try:
        factors = sorted({float(f) for f in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of numbers") from None
    if factors[0] < 1:
        raise argparse.ArgumentTypeError(f"{factors[0]:g} is below 1")
    return factors


if __name__ == "__main__":
    main()
