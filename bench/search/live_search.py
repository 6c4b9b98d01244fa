"""Our searcher against plain TPE and random search, live on the attached device.

A replay (``bench/search/replay.py``) needs a landscape that holds every config a searcher may
propose. On a TPU the legal spaces are far too large to measure whole (flash at b4 h16 s4096
d128 fwd_bwd: 12M combinations), and a random sample of a few hundred configs cannot stand in
for them: TPE's proposals almost never land on a sampled config, so plain TPE replays to
nothing (score 0 on the 76-config flash sample of 2026-12-06) and ours to random search.
This runs each searcher for real instead: ``autotune tune --sampler S --seed K`` once per
sampler and seed, each in its own study of one database, then scores them as
``bench/search/replay.py`` does, against the best config any run measured (the optimum is not known).

    python bench/search/live_search.py run --db sqlite:///live.db --kernel flash --seeds 4 \\
        --trials 30 --time-limit 540 -- --batch 4 --q-heads 16 --q-len 4096 --head-dim 128 \\
        --dtype bfloat16 --causal --mode fwd_bwd
    python bench/search/live_search.py score --db sqlite:///live.db --kernel flash --budgets 10,30

``run`` goes seed by seed (every sampler at seed 0, then seed 1, ...) and resumes unfinished
studies, so a device call's time limit cuts it anywhere and the next call goes on. ``score``
uses the seeds every sampler finished, and prints per budget each searcher's median, mean and
10th percentile, and the pooled difference of ours against each other searcher with its 95%
bootstrap lower bound (above zero: ours ahead beyond the seeds' noise).

Every study starts with the same warm-start configs (``autotune tune``'s default and seeds), so
when one of them is the best any run finds, every searcher scores the same and the scores
cannot separate them. So ``score`` also gives, per budget and searcher, what its own proposals
added: per seed the warm-start configs' best time, its own proposals' best time within the
budget, their ratio (above 1: the search beat the warm start) and in how many seeds it did;
then one verdict line per budget after the JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from autotune.landscape import Landscape, study_document
from autotune.trials import SEED_ATTR, is_measurement
from bench.search.replay import SAMPLERS, _budgets, _pooled, _positive, _scores, _stats

MIN_RUN_S = 60  # a run given less would spend it starting up


def study_name(kernel: str, sampler: str, seed: int) -> str:
    return f"live-{kernel}-{sampler}-{seed}"


def measured(db: str, name: str) -> int:
    """How many configs study ``name`` measured (0 when it does not exist yet)."""
    try:
        study = optuna.load_study(study_name=name, storage=db)
    except KeyError:
        return 0
    return sum(is_measurement(t) for t in study.get_trials(deepcopy=False))


def run(args: argparse.Namespace) -> None:
    deadline = time.monotonic() + args.time_limit
    for seed in range(args.seeds):
        for sampler in SAMPLERS.values():
            name = study_name(args.kernel, sampler, seed)
            if measured(args.db, name) >= args.trials:
                continue
            left = deadline - time.monotonic()
            if left < MIN_RUN_S:
                print(f"time limit: stopped before {name} (rerun to go on)")
                return
            command = [sys.executable, "-m", "autotune", "tune", *args.problem,
                       "--kernel", args.kernel, "--sampler", sampler, "--seed", str(seed),
                       "--trials", str(args.trials), "--study", name, "--db", args.db,
                       "--force", "--timeout", str(int(left - MIN_RUN_S / 2))]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            print(f"{name}: exit {done.returncode}, {measured(args.db, name)} measured"
                  + (f" ({done.stderr.strip().splitlines()[-1]})" if done.returncode else ""))


def curve(document: dict) -> list[float | None]:
    """Best time so far after each measured config of a study, in the order measured."""
    best, out = None, []
    for record in document["records"]:
        if record["time_ms"] is not None:
            best = record["time_ms"] if best is None else min(best, record["time_ms"])
        out.append(best)
    return out


def _faster(record: dict, other: dict | None) -> bool:
    if other is None or other["time_ms"] is None:
        return True
    return record["time_ms"] is not None and record["time_ms"] < other["time_ms"]


def seeded(study: optuna.Study, document: dict) -> list[bool]:
    """Per record of ``document`` (``study``'s landscape document), whether it measured a
    warm-start config (the default or a seed) rather than one the searcher proposed."""
    warm = {tuple(t.params.get(p) for p in document["params"])
            for t in study.get_trials(deepcopy=False) if t.user_attrs.get(SEED_ATTR)}
    return [tuple(r["config"][p] for p in document["params"]) in warm
            for r in document["records"]]


def bests(document: dict, warm: list[bool], budget: int) -> tuple[float | None, float | None]:
    """The best time of the warm-start configs and of the searcher's own proposals among the
    first ``budget`` measured configs (None: none measured, or none ran)."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for record, is_warm in zip(document["records"][:budget], warm, strict=False):
        if record["time_ms"] is not None:
            times[is_warm].append(record["time_ms"])
    return min(times[True], default=None), min(times[False], default=None)


def beyond_seeds(pairs: list[tuple[float | None, float | None]]) -> dict:
    """Per seed of one searcher's runs, the warm start's best, its own proposals' best and
    their ratio (above 1: the search beat the warm start), and in how many seeds it did."""
    return {"seeds_best_ms": [warm for warm, _ in pairs],
            "own_best_ms": [own for _, own in pairs],
            "ratio": [warm / own if warm is not None and own is not None else None
                      for warm, own in pairs],
            "own_beat_seeds": sum(own is not None and (warm is None or own < warm)
                                  for warm, own in pairs)}


def verdict(budget: int, beyond: dict[str, dict], seeds: int) -> str:
    """One line: whether any searcher's own proposals beat the warm start within ``budget``."""
    if not any(b["own_beat_seeds"] for b in beyond.values()):
        return (f"{budget} trials: the seeds held the best in {seeds} of {seeds} seeds for "
                f"every searcher: the searcher choice is moot at {budget} trials here")
    parts = []
    for label, b in beyond.items():
        ratios = [r for r in b["ratio"] if r is not None]
        parts.append(f"{label} {b['own_beat_seeds']} of {seeds}"
                     + (f" (seeds/own at most {max(ratios):.4f})" if ratios else ""))
    return f"{budget} trials: own proposals beat the seeds' best in " + ", ".join(parts)


def score(args: argparse.Namespace) -> dict:
    """The runs' curves and their scores against the best config any run measured, and what
    each searcher's own proposals added to the warm start."""
    documents, warm = {}, {}
    for sampler in SAMPLERS.values():
        for seed in range(args.seeds):
            name = study_name(args.kernel, sampler, seed)
            if measured(args.db, name) >= max(args.budgets):
                study = optuna.load_study(study_name=name, storage=args.db)
                documents[sampler, seed] = study_document(study, partial=True)
                warm[sampler, seed] = seeded(study, documents[sampler, seed])
    seeds = [s for s in range(args.seeds) if all((p, s) in documents for p in SAMPLERS.values())]
    if not seeds:
        raise SystemExit(f"no seed has a study of every sampler with {max(args.budgets)} "
                         f"measured configs in {args.db}; run `run` first")
    first = next(iter(documents.values()))
    records: dict[tuple, dict] = {}  # a config measured by several runs: its fastest time
    for record in (r for d in documents.values() for r in d["records"]):
        key = tuple(record["config"][p] for p in first["params"])
        if _faster(record, records.get(key)):
            records[key] = record
    land = Landscape(f"live {args.kernel}", first["params"], records)
    curves = {(label, "live", None): [curve(documents[sampler, s]) for s in seeds]
              for label, sampler in SAMPLERS.items()}
    report = {"kernel": args.kernel, "problem": first.get("problem"), "seeds": seeds,
              "configs_measured": len(records), "best_ms": land.optimum_ms, "budgets": {}}
    for budget in args.budgets:
        report["budgets"][budget] = {
            "scores": {label: _stats(_scores(land, curves[label, "live", None], budget))
                       for label in SAMPLERS},
            "ours_minus": {label: _pooled({"live": land}, curves, "ours", label, budget,
                                          slice(None)) for label in SAMPLERS if label != "ours"},
            "beyond_seeds": {label: beyond_seeds(
                [bests(documents[sampler, s], warm[sampler, s], budget) for s in seeds])
                for label, sampler in SAMPLERS.items()}}
        report["budgets"][budget]["verdict"] = verdict(
            budget, report["budgets"][budget]["beyond_seeds"], len(seeds))
    return report


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("run", "score"))
    parser.add_argument("--db", required=True, help="the database of the runs' studies")
    parser.add_argument("--kernel", required=True)
    parser.add_argument("--seeds", type=_positive, default=4)
    parser.add_argument("--trials", type=_positive, default=30, help="measured configs a run")
    parser.add_argument("--time-limit", type=_positive, default=540, help="seconds, `run`")
    parser.add_argument("--budgets", type=_budgets, default="10,30", help="`score`")
    parser.add_argument("--out", type=Path, help="`score`: also write the report here")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.problem = argv[split + 1:]  # after --: autotune tune's problem flags
    if args.action == "run":
        run(args)
        return None
    report = score(args)
    text = json.dumps(report, indent=1)
    print(text)
    for budget in report["budgets"].values():
        print(budget["verdict"])
    if args.out:
        args.out.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
