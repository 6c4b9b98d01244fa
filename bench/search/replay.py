"""Search quality and overhead on measured landscapes: our searcher against plain Optuna TPE,
random search and Kernel Tuner's strategies, on the same seeds in one run; warm start measured.

For every ``*.json.gz`` landscape in the directory (default ``bench/search/landscapes``) it replays
each searcher with ``--seeds`` seeds (0, 1, ...) for ``max(budgets)`` measured configs and
prints, per landscape and budget, score@B = optimum / best found after B measured configs as
the median, mean and 10th percentile over the seeds, and whether ours holds the goals (each of
the three at least plain TPE's, and at least the best Kernel Tuner strategy's). A statistic
short of a goal comes with how sure the shortfall is: the share of bootstrap resamples (each
side's seeds drawn again with replacement) in which ours is ahead after all. Near half, the
shortfall is within the noise of the seeds; near zero, it is not.

Kernel Tuner (not a project dependency) runs in its simulation mode through
``bench/search/kernel_tuner_replay.py``, started with ``--kernel-tuner-python`` (an interpreter
that has ``kernel_tuner`` installed, e.g. a separate venv:
``python -m venv /tmp/kt && /tmp/kt/bin/pip install kernel_tuner``); without it those rows are
left out. Its row per landscape and budget is the best of its strategies for each statistic.
That best-of-six is chosen and scored on the same seeds, so it is biased up: a strategy that was
lucky on these seeds wins the cell. ``--fresh-seeds M`` also scores every searcher on M more
seeds (``--seeds``, ``--seeds`` + 1, ...), Kernel Tuner as the strategy chosen per statistic on
the first ``--seeds``: a choice made on some seeds and judged on others, as ours was designed on
seeds 0-19 of ``bench/search/landscapes``.

Warm start: for each ordered pair of landscapes of one kernel (same parameters), our searcher
seeded with the other's best configs, none one step from another (``autotune replay
--warm-from``), against cold, at score@10, @20 and @50, with each seed's own score on the
target (why a pair gains or loses); the cold runs then go on to at least 50 measured configs,
so both sides have the same budget. Then the tuner's own overhead per trial (everything but
``measure``) with in-memory and SQLite storage, against plain TPE's in the same run.

``--plot FILE.png`` also draws score@B against B for every budget up to the largest, one panel
per landscape: the median of each searcher over the seeds, ours and plain TPE with their
10th-90th percentile band, Kernel Tuner as its best strategy's median at each B.

    python bench/search/replay.py [LANDSCAPE_DIR] [--seeds 20] [--budgets 50,100,200]
        [--kernel-tuner-python VENV/bin/python] [--fresh-seeds 40] [--json]
        [--plot convergence.png] [--no-warm] [--ahead 6]

``--ahead K`` also replays ours as the tuner runs it on a TPU VM: each config claimed K ahead
of its measurement (their compiles overlap it, ``autotune.search.search(ahead=K)``), so the
sampler proposes K configs before it sees the result of the first (Optuna's constant liar). Its
rows say whether it holds ours's statistics, with the bootstrap share of each shortfall.

Pooled over every landscape (issue 56's measure of a searcher): per budget, the mean over
landscapes and seeds of ours's score minus plain TPE's (and the K-ahead replay's minus ours's),
with a 95% bootstrap lower bound (the seeds of each landscape drawn again with replacement,
2000 times): a lower bound above zero says ours is ahead beyond the seeds' noise.

``bench/search/landscapes/heldout`` holds nineteen landscapes the searcher was not developed on (see
its README); ``--no-warm`` leaves out the warm-start table, whose pairs grow as the square of a
kernel's landscapes.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import optuna

from autotune.landscape import Landscape, LandscapeError, load_landscape
from autotune.search import search
from autotune.tune import MAX_WARM_SEEDS

SAMPLERS = {"ours": "tpe", "plain TPE": "plain-tpe", "random": "random"}
AHEAD = "ahead"  # ours with configs claimed ahead (--ahead)
KERNEL_TUNER = ("genetic_algorithm", "dual_annealing", "pso", "diff_evo", "firefly_algorithm",
                "bayes_opt")
WARM_BUDGETS = (10, 20, 50)
KT_TIMEOUT_S = 1800  # one strategy, all seeds, one landscape
KT_SCRIPT = Path(__file__).resolve().parent / "kernel_tuner_replay.py"
RESAMPLES = 2000  # bootstrap resamples behind each shortfall's share
_LANDSCAPES: dict[str, Landscape] = {}

Curve = list[float | None]


def _landscape(path: str) -> Landscape:
    return _LANDSCAPES.get(path) or _LANDSCAPES.setdefault(path, load_landscape(path))


def _run(job: tuple, ahead: int = 1) -> tuple[tuple, list[Curve]]:
    """One job: ("ours" | "plain TPE" | "random", path, seed, budget, warm_from | None) replays
    our search; "ahead" for ours with ``ahead`` configs claimed ahead of each measurement;
    ("kernel tuner", path, strategy, seeds, budget, python) runs one Kernel Tuner strategy over
    all seeds in a subprocess."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if job[0] == "kernel tuner":
        _, path, strategy, seeds, budget, python = job
        try:
            out = subprocess.run(
                [python, str(KT_SCRIPT), path, "--strategies", strategy, "--budget", str(budget),
                 "--seeds", ",".join(map(str, range(seeds)))],
                capture_output=True, text=True, check=True, timeout=KT_TIMEOUT_S)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            stderr = exc.stderr if isinstance(exc.stderr, str) else ""
            tail = stderr.strip().splitlines()[-1:]
            print(f"kernel tuner {strategy} on {Path(path).name} failed: {exc} {tail}",
                  file=sys.stderr)
            return job, []
        return job, [_held(json.loads(line)["curve"], budget) for line in out.stdout.splitlines()]
    label, path, seed, budget, warm_from = job
    land = _landscape(path)
    seeds = land.warm_seeds(_landscape(warm_from), MAX_WARM_SEEDS) if warm_from else []
    if label == AHEAD:
        result = search(land.space, land.measure, sampler="tpe", trials=budget, seed=seed,
                        seeds=seeds, prepare=lambda config: None, ahead=ahead)
    else:
        result = search(land.space, land.measure, sampler=SAMPLERS[label], trials=budget,
                        seed=seed, seeds=seeds)
    return job, [_held(result.curve, budget)]


def _held(curve: Curve, budget: int) -> Curve:
    """The curve of a searcher that stopped before ``budget`` (its space exhausted, its
    strategy done) held at its final best up to ``budget``: what it would report there."""
    return curve + [curve[-1] if curve else None] * (budget - len(curve))


def _score_at(land: Landscape, curve: Curve, budget: int) -> float:
    """score@``budget``; a curve that ends before it is an error (a run given a smaller budget
    than it is scored at), never clipped to its end."""
    if not 1 <= budget <= len(curve):
        raise ValueError(f"score@{budget} asked of a curve of {len(curve)} measured configs")
    return land.score(curve[budget - 1])


def _p10(scores: list[float]) -> float:
    """The 10th percentile (linear interpolation between the closest ranks)."""
    ordered = sorted(scores)
    rank = 0.1 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


STATISTICS = {"median": statistics.median, "mean": statistics.mean, "p10": _p10}


def _scores(land: Landscape, curves: list[Curve], budget: int) -> list[float]:
    return [_score_at(land, c, budget) for c in curves]


def _stats(scores: list[float]) -> dict[str, float]:
    return {stat: f(scores) for stat, f in STATISTICS.items()}


def _goal(ours: list[float], other: list[float],
          stats: tuple[str, ...] = tuple(STATISTICS)) -> dict[str, float]:
    """Those of ``stats`` in which ``ours`` falls short of ``other``, each with the share of
    bootstrap resamples in which ours is ahead after all (see module doc)."""
    rng = random.Random(0)
    shares = {}
    for stat in stats:
        f = STATISTICS[stat]
        if f(ours) >= f(other) - 1e-9:
            continue
        ahead = sum(f(rng.choices(ours, k=len(ours))) >= f(rng.choices(other, k=len(other))) - 1e-9
                    for _ in range(RESAMPLES))
        shares[stat] = ahead / RESAMPLES
    return shares


def _overhead(path: str, trials: int) -> dict[str, dict[str, float]]:
    """Milliseconds per trial spent outside ``measure``, ours and plain TPE, per storage."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    land = load_landscape(path)
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label in ("ours", "plain TPE"):
            out[label] = {}
            for name, storage in (("in-memory", None), ("sqlite", f"sqlite:///{tmp}/{label}.db")):
                result = search(land.space, land.measure, storage=storage, trials=trials, seed=0,
                                sampler=SAMPLERS[label])
                out[label][name] = 1000 * result.overhead_per_trial_s
    return out


def _warm_pairs(lands: dict[str, Landscape]) -> list[tuple[str, str]]:
    """(target, source) for every ordered pair of landscapes with the same parameters."""
    return [(p, q) for p in lands for q in lands
            if p != q and list(lands[p].params) == list(lands[q].params)]


def _positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def _budgets(text: str) -> list[int]:
    """An argparse type: comma-separated budgets of at least 1, sorted, each once."""
    return sorted({_positive(b.strip()) for b in text.split(",")})


def _interpreter(text: str) -> str | None:
    """An argparse type: a Python interpreter on PATH or at a path; empty: none."""
    if not text:
        return None
    if shutil.which(text) is None:
        raise argparse.ArgumentTypeError(
            f"no interpreter {text!r}: give a Python with kernel_tuner installed, or leave "
            "--kernel-tuner-python and $KERNEL_TUNER_PYTHON unset to leave Kernel Tuner out")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("landscapes", nargs="?",
                        default=str(Path(__file__).resolve().parent / "landscapes"))
    parser.add_argument("--seeds", type=_positive, default=20)
    parser.add_argument("--budgets", type=_budgets, default="50,100,200",
                        help="comma-separated numbers of measured configs to score at")
    parser.add_argument("--kernel-tuner-python", type=_interpreter,
                        default=os.environ.get("KERNEL_TUNER_PYTHON", ""),
                        help="interpreter with kernel_tuner installed (default: "
                             "$KERNEL_TUNER_PYTHON; unset or empty: Kernel Tuner is left out)")
    parser.add_argument("--overhead-landscape",
                        help="landscape whose overhead per trial is measured (default: the "
                             "one with the most records, gemm-RTX_3090 in bench/search/landscapes)")
    parser.add_argument("--overhead-trials", type=_positive, default=200)
    parser.add_argument("--jobs", type=_positive, default=os.cpu_count())
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", type=Path, help="also draw the scores against B to this PNG")
    parser.add_argument("--fresh-seeds", type=_positive, default=0,
                        help="also score every searcher on this many more seeds, Kernel Tuner "
                             "as the strategies chosen on the first --seeds (see module doc)")
    parser.add_argument("--no-warm", action="store_true",
                        help="leave out the warm-start table (held-out sets: many pairs)")
    parser.add_argument("--ahead", type=_positive, default=None,
                        help="also replay ours with this many configs claimed ahead (see "
                             "module doc)")
    args = parser.parse_args()
    budgets = args.budgets
    paths = sorted(str(p) for p in Path(args.landscapes).glob("*.json.gz"))
    if not paths:
        sys.exit(f"no *.json.gz landscapes in {args.landscapes}; pass their directory "
                 "(see bench/search/landscapes/README.md)")
    try:
        lands = {p: load_landscape(p) for p in paths}
    except LandscapeError as error:
        sys.exit(f"error: {error}")
    names = {land.name: p for p, land in lands.items()}
    if args.overhead_landscape is None:
        overhead_path = max(paths, key=lambda p: len(lands[p].records))
    elif args.overhead_landscape in names:
        overhead_path = names[args.overhead_landscape]
    else:
        parser.error(f"--overhead-landscape {args.overhead_landscape!r} is none of "
                     f"{', '.join(sorted(names))}")
    pairs = [] if args.no_warm else _warm_pairs(lands)
    # The cold runs are also the warm start's baseline: they go as far as the warm runs.
    cold = max(budgets[-1], WARM_BUDGETS[-1]) if pairs else budgets[-1]
    seeds = args.seeds + args.fresh_seeds
    jobs: list[tuple] = [(label, p, seed, cold, None) for p in paths for label in SAMPLERS
                         for seed in range(seeds)]
    jobs += [("ours", p, seed, WARM_BUDGETS[-1], q) for p, q in pairs for seed in range(args.seeds)]
    if args.ahead:
        jobs += [(AHEAD, p, seed, budgets[-1], None) for p in paths for seed in range(seeds)]
    if args.kernel_tuner_python:
        jobs += [("kernel tuner", p, s, seeds, budgets[-1], args.kernel_tuner_python)
                 for p in paths for s in KERNEL_TUNER]
    start = time.perf_counter()
    with Pool(args.jobs) as pool:
        runs = pool.map(functools.partial(_run, ahead=args.ahead or 1),
                        sorted(jobs, key=lambda j: j[0] != "kernel tuner"), chunksize=1)
    wall = time.perf_counter() - start
    curves: dict[tuple, list[Curve]] = {}
    for job, got in runs:
        key = (job[0], job[1], job[2]) if job[0] == "kernel tuner" else (job[0], job[1], job[4])
        curves.setdefault(key, []).extend(got)

    first = slice(0, args.seeds)
    scores = _table(lands, curves, budgets, first, first)
    pooled = {f"{a} - {b}": {n: _pooled(lands, curves, a, b, n, first) for n in budgets}
              for a, b in (("ours", "plain TPE"), (AHEAD, "ours")) if (a, paths[0], None) in curves}
    fresh = (_table(lands, curves, budgets, first, slice(args.seeds, None))
             if args.fresh_seeds else None)
    warm = {f"{lands[q].name} -> {lands[p].name}": {
        "seed scores": [lands[p].score(lands[p].measure(seed).value)
                        for seed in lands[p].warm_seeds(lands[q], MAX_WARM_SEEDS)],
        "budgets": {b: {"warm": _stats(_scores(lands[p], curves[("ours", p, q)], b)),
                        "cold": _stats(_scores(lands[p], curves[("ours", p, None)][first],
                                               b))}
                    for b in WARM_BUDGETS}}
        for p, q in pairs}
    if args.plot:
        _plot(args.plot, lands, {key: c[first] for key, c in curves.items()}, budgets[-1],
              args.seeds)
    overhead = _overhead(overhead_path, args.overhead_trials)
    if args.json:
        print(json.dumps({"seeds": args.seeds, "budgets": budgets, "scores": scores,
                          "pooled": pooled,
                          "fresh_seeds": args.fresh_seeds, "fresh_scores": fresh,
                          "warm_start": warm, "overhead_ms_per_trial": overhead, "wall_s": wall}))
        return
    _print(args, budgets, scores, fresh, warm, overhead, lands[overhead_path].name, wall)
    for pair, by_budget in pooled.items():
        print(f"pooled over {len(lands)} landscapes and {args.seeds} seeds, {pair}: " + "; ".join(
            f"@{b} mean {d['mean']:+.4f}, 95% lower bound {d['lower_95']:+.4f}"
            for b, d in by_budget.items()))


def _pooled(lands: dict[str, Landscape], curves: dict[tuple, list[Curve]], a: str, b: str,
            budget: int, seeds: slice) -> dict[str, float]:
    """The mean over landscapes and seeds of searcher ``a``'s score@``budget`` minus ``b``'s
    on the same seed, and its 95% bootstrap lower bound (seeds resampled per landscape)."""
    diffs = [[x - y for x, y in zip(_scores(land, curves[(a, p, None)][seeds], budget),
                                    _scores(land, curves[(b, p, None)][seeds], budget))]
             for p, land in lands.items()]
    rng = random.Random(0)
    means = sorted(statistics.mean(d for per in diffs for d in rng.choices(per, k=len(per)))
                   for _ in range(RESAMPLES))
    return {"mean": statistics.mean(d for per in diffs for d in per),
            "lower_95": means[int(0.05 * RESAMPLES)]}


def _table(lands: dict[str, Landscape], curves: dict[tuple, list[Curve]], budgets: list[int],
           chosen_on: slice, scored_on: slice) -> dict[str, dict]:
    """Per landscape and budget, each searcher's statistics over the seeds ``scored_on``, and
    the goals; Kernel Tuner's best strategy per statistic is the one best on the seeds
    ``chosen_on`` (the same seeds, or the first ones when ``scored_on`` are fresh)."""
    scores: dict[str, dict] = {}
    for p, land in lands.items():
        scores[land.name] = table = {}
        for b in budgets:
            got = {label: _scores(land, curves[(label, p, None)][scored_on], b)
                   for label in SAMPLERS}
            row = {label: _stats(got[label]) for label in SAMPLERS}
            row["ours short of"] = {"plain TPE": _goal(got["ours"], got["plain TPE"])}
            if (AHEAD, p, None) in curves:
                ahead = _scores(land, curves[(AHEAD, p, None)][scored_on], b)
                row[AHEAD] = _stats(ahead)
                row["ahead short of ours"] = _goal(ahead, got["ours"])
            tuner = {key[2]: c for key, c in curves.items()
                     if key[0] == "kernel tuner" and key[1] == p and c}
            if tuner:
                chosen = {s: _stats(_scores(land, c[chosen_on], b)) for s, c in tuner.items()}
                kt = {s: _scores(land, c[scored_on], b) for s, c in tuner.items()}
                per = {s: _stats(v) for s, v in kt.items()}
                best_of = {stat: max(chosen, key=lambda s, stat=stat: chosen[s][stat])
                           for stat in STATISTICS}
                row["kernel tuner best"] = {stat: per[s][stat] for stat, s in best_of.items()}
                row["kernel tuner best of"] = best_of
                row["kernel tuner"] = per
                short: dict[str, float] = {}  # per statistic, against the strategy best at it
                for stat, s in best_of.items():
                    short.update(_goal(got["ours"], kt[s], (stat,)))
                row["ours short of"]["kernel tuner best"] = short
            table[b] = row
    return scores


def _plot(path: Path, lands: dict[str, Landscape], curves: dict[tuple, list[Curve]],
          budget: int, seeds: int) -> None:
    """score@B against B = 1 .. ``budget`` per landscape (see module doc), written to ``path``."""
    import numpy as np
    from matplotlib.figure import Figure

    columns = min(3, len(lands))
    rows = -(-len(lands) // columns)
    figure = Figure(figsize=(4.6 * columns, 3.4 * rows), dpi=100, layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    x = np.arange(1, budget + 1)
    styles = {"ours": "#1f77b4", "plain TPE": "#ff7f0e", "random": "#7f7f7f"}
    for ax, (p, land) in zip(axes, lands.items()):
        def scores(got: list[Curve], land: Landscape = land) -> np.ndarray:  # seeds x budgets
            return np.array([[_score_at(land, c, b) for b in x] for c in got])

        for label, colour in styles.items():
            got = scores(curves[(label, p, None)])
            ax.plot(x, np.median(got, axis=0), color=colour, label=label,
                    linewidth=2 if label == "ours" else 1.2)
            if label != "random":
                ax.fill_between(x, *np.percentile(got, [10, 90], axis=0), color=colour,
                                alpha=0.15, linewidth=0)
        tuner = [scores(c) for key, c in curves.items()
                 if key[0] == "kernel tuner" and key[1] == p and c]
        if tuner:
            ax.plot(x, np.max([np.median(t, axis=0) for t in tuner], axis=0), color="#2ca02c",
                    linestyle=":", linewidth=1.5, label="kernel tuner (best median)")
        ax.set_title(land.name, fontsize=10)
        ax.set_xlabel("measured configs")
        ax.set_ylabel("score (optimum / best)")
        ax.grid(alpha=0.3)
    for ax in axes[len(lands):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=8, loc="lower right")
    figure.suptitle(f"median over {seeds} seeds; bands: 10th-90th percentile", fontsize=10)
    figure.savefig(path)


def _cells(stats: dict[str, float]) -> str:
    return f"{stats['median']:.3f} | {stats['mean']:.3f} | {stats['p10']:.3f}"


def _verdict(short: dict[str, float]) -> str:
    return "yes" if not short else "no: " + ", ".join(
        f"{stat} ({share:.0%})" for stat, share in short.items())


def _print_table(scores: dict[str, dict], budgets: list[int], kt: bool,
                 ahead: int | None = None) -> None:
    """The goal column: ours at least each other searcher; on the row of ours with configs
    claimed ``ahead``, that one at least ours."""
    print("\n| landscape | B | searcher | median | mean | p10 | ours >= it (all three) |")
    print("|---|---|---|---|---|---|---|")
    for name, table in scores.items():
        for b in budgets:
            row = table[b]
            rows = [(label, row[label], row["ours short of"].get(label)) for label in SAMPLERS]
            if kt:
                best_of = "/".join(row["kernel tuner best of"][s] for s in STATISTICS)
                rows.append((f"kernel tuner ({best_of})", row["kernel tuner best"],
                             row["ours short of"]["kernel tuner best"]))
            if AHEAD in row:
                rows.append((f"ours, {ahead} ahead", row[AHEAD], row["ahead short of ours"]))
            for label, stats, short in rows:
                goal = "" if short is None else _verdict(short)
                print(f"| {name} | {b} | {label} | {_cells(stats)} | {goal} |")


def _print(args, budgets, scores, fresh, warm, overhead, overhead_name, wall) -> None:  # noqa: ANN001
    kt = bool(args.kernel_tuner_python)
    print(f"score@B = optimum / best after B measured configs, over {args.seeds} seeds "
          "(0, 1, ...): median | mean | 10th percentile")
    if kt:
        print("kernel tuner: per statistic, the best of its strategies " + ", ".join(KERNEL_TUNER)
              + " (which one: median/mean/p10)")
    print("ours >= it: 'no' names each statistic short of it, with the share of "
          f"{RESAMPLES} bootstrap resamples of the seeds in which ours is ahead after all")
    if args.ahead:
        print(f"ours, {args.ahead} ahead: its last column says whether it holds ours's "
              "statistics (a 'no' with the share of resamples in which it does after all)")
    _print_table(scores, budgets, kt, args.ahead)
    if fresh:
        print(f"\nfresh seeds: every searcher on the next {args.fresh_seeds} seeds ({args.seeds}, "
              f"{args.seeds + 1}, ...); kernel tuner: per statistic, the strategy best at it on "
              f"seeds 0-{args.seeds - 1} above (a best-of-{len(KERNEL_TUNER)} chosen and scored "
              "on the same seeds is biased up)")
        _print_table(fresh, budgets, kt, args.ahead)
    if warm:
        print(f"\nwarm start: ours seeded with the other landscape's {MAX_WARM_SEEDS} best "
              "configs, none one step from another (autotune replay --warm-from), against cold, "
              "same seeds; each seed's own score on the target (a seed that scores low there is a "
              "bet that did not pay: it delays the cold search by one trial)\n")
        print("| from -> to | seeds score | B | warm median | mean | p10 | cold median | mean "
              "| p10 |")
        print("|---|---|---|---|---|---|---|---|---|")
        for pair, row in warm.items():
            seeds = ", ".join(f"{score:.3f}" for score in row["seed scores"])
            for b, stats in row["budgets"].items():
                print(f"| {pair} | {seeds if b == WARM_BUDGETS[0] else ''} | {b} | "
                      f"{_cells(stats['warm'])} | {_cells(stats['cold'])} |")
    print(f"\ntuner overhead per trial ({args.overhead_trials} trials on {overhead_name}), ms, "
          "ours (plain TPE in the same run): " + ", ".join(
              f"{k} {overhead['ours'][k]:.1f} ({overhead['plain TPE'][k]:.1f})"
              for k in overhead["ours"]))
    print(f"benchmark wall time: {wall:.0f} s on {args.jobs} processes")


if __name__ == "__main__":
    main()
