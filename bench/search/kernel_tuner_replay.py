"""Kernel Tuner's strategies replayed on a measured landscape, in its simulation mode.

Run by ``bench/search/replay.py`` with an interpreter that has ``kernel_tuner`` installed (it is
not a project dependency; see that script's ``--kernel-tuner-python``). Needs only the standard
library and kernel_tuner (with its numpy and scipy), so it imports nothing from the project.

The landscape (format in bench/search/landscapes/README.md) becomes a Kernel Tuner cache file:
``tune_params`` (the declared values), ``tune_params_keys``, ``kernel_name``, ``problem_size``,
and ``cache`` keyed by the comma-joined values, a failed config recorded as
``CompilationFailedConfig`` / ``RuntimeFailedConfig`` (legal, counts as an evaluation). The
restriction admits exactly the recorded configs, so no strategy can evaluate an illegal one.

    python bench/search/kernel_tuner_replay.py LANDSCAPE --strategies genetic_algorithm,pso \\
        --seeds 0-19 --budget 200

prints one JSON object per line: ``strategy``, ``seed``, ``curve`` (best time after each
distinct config evaluated, null before the first success) and ``seconds``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

_FAILURES = {"compile_error": "CompilationFailedConfig"}  # anything else failed at run time


def _problem_size(doc: dict) -> list:
    size = doc.get("problem_size") or [1]
    return list(size) if isinstance(size, list | tuple) else [size]


def write_cache(doc: dict, path: Path) -> None:
    """Writes the landscape ``doc`` as a Kernel Tuner cache file at ``path``."""
    names = list(doc["params"])
    cache = {}
    for record in doc["records"]:
        config = record["config"]
        entry = {name: config[name] for name in names}
        if record["status"] == "ok":
            entry["time"] = record["time_ms"]
        else:
            entry["time"] = _FAILURES.get(record["status"], "RuntimeFailedConfig")
        entry.update(compile_time=1000 * (record.get("compile_s") or 0),
                     verification_time=0,
                     benchmark_time=1000 * (record.get("benchmark_s") or 0))
        cache[",".join(str(config[n]) for n in names)] = entry
    path.write_text(json.dumps({
        "device_name": doc.get("device") or "simulated",
        "kernel_name": doc.get("name") or "landscape",
        "problem_size": _problem_size(doc),
        "tune_params_keys": names,
        "tune_params": doc["params"],
        "objective": "time",
        "cache": cache,
    }))


def run(cache_path: Path, doc: dict, strategy: str, seed: int, budget: int) -> list:
    """Kernel Tuner's ``strategy`` for ``budget`` evaluations: best time after each distinct
    config, in the order evaluated."""
    import numpy as np
    from constraint import FunctionConstraint
    from kernel_tuner import tune_kernel

    names = list(doc["params"])
    recorded = {tuple(r["config"][n] for n in names) for r in doc["records"]}

    def restriction(*values):  # noqa: ANN002, ANN202 - one value per parameter, in order
        return values in recorded

    random.seed(seed)  # the strategies draw from both global generators
    np.random.seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results, _ = tune_kernel(
            doc.get("name") or "landscape", "", _problem_size(doc), [], doc["params"],
            restrictions=[FunctionConstraint(restriction)], cache=str(cache_path), simulation_mode=True,
            strategy=strategy, strategy_options={"max_fevals": budget}, quiet=True)
    seen, curve, best = set(), [], None
    for result in results:
        key = tuple(result[n] for n in names)
        if key in seen:
            continue
        seen.add(key)
        value = result.get("time")
        if "__error__" not in result and isinstance(value, int | float) and (
                best is None or value < best):
            best = float(value)
        curve.append(best)
    return curve[:budget]


def _seed_latin_hypercube() -> None:
    """Makes Kernel Tuner's Latin hypercube samples (the first population of ``diff_evo``,
    ``bayes_opt``'s initial sample) follow the run's seed: Kernel Tuner builds scipy's
    ``LatinHypercube`` without one, so those strategies gave other curves on every run."""
    import numpy as np
    import scipy.stats.qmc
    from kernel_tuner.strategies import bayes_opt

    unseeded = scipy.stats.qmc.LatinHypercube

    def seeded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        kwargs.setdefault("rng", np.random.randint(2**31))  # from the generator run() seeds
        return unseeded(*args, **kwargs)

    scipy.stats.qmc.LatinHypercube = bayes_opt.LatinHypercube = seeded


def _seeds(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-")
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("landscape", type=Path)
    parser.add_argument("--strategies", required=True, help="comma-separated strategy names")
    parser.add_argument("--seeds", type=_seeds, default=[0], help="0-19 or 0,3,7")
    parser.add_argument("--budget", type=int, default=200)
    args = parser.parse_args()
    with gzip.open(args.landscape, "rt") as f:
        doc = json.load(f)
    _seed_latin_hypercube()
    with tempfile.TemporaryDirectory() as tmp:
        cache_path = Path(tmp) / "cache.json"
        write_cache(doc, cache_path)
        for strategy in args.strategies.split(","):
            for seed in args.seeds:
                start = time.perf_counter()
                curve = run(cache_path, doc, strategy, seed, args.budget)
                print(json.dumps({"strategy": strategy, "seed": seed, "curve": curve,
                                  "seconds": round(time.perf_counter() - start, 2)}),
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
