"""Throughput of ``autotune tune --devices 2`` against ``--devices 1`` on CPU, in one run.

Tunes the same shapes file of four small forward problems twice, each time on a fresh SQLite
database: once in one process (``--devices 1``), once with two worker processes
(``--devices 2``). The figure of merit is measured configs per minute of wall time (the whole
command: start-up, search, confirmation, publishing), as a ratio of the two runs. Two CPU cores
give at most about 2x. Where the rest goes is printed per run: the start-up (command start to
the first measured config), the time inside ``measure`` summed over trials (``measure_s``), and
the remainder (confirmation, compiles not hidden by the compile pool, database).

    python bench/service/devices.py [--trials 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna

from kernel import Problem

PROBLEMS = [Problem(batch=1, q_heads=qh, kv_heads=1, q_len=256, kv_len=256, head_dim=128,
                    dtype="float32", causal=causal, mode="fwd")
            for qh in (1, 2) for causal in (False, True)]
AUTOTUNE = str(Path(sys.executable).with_name("autotune"))


def run(devices: int, trials: int, work: Path) -> dict[str, float]:
    db = f"sqlite:///{work / f'devices{devices}.db'}"
    shapes = work / "shapes.json"
    shapes.write_text(json.dumps([p.to_dict() for p in PROBLEMS]))
    start = time.perf_counter()
    process = subprocess.Popen([AUTOTUNE, "tune", "--kernel", "flash", "--shapes", str(shapes),
                                "--devices", str(devices), "--trials", str(trials), "--db", db, "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    first = None
    measured = 0
    for line in process.stdout:
        if line.startswith("{") and '"trial"' in line and first is None:
            first = time.perf_counter() - start
        if '"summary": true' in line:
            measured += json.loads(line)["measured"]
    if process.wait() != 0:
        raise SystemExit(f"--devices {devices} failed with exit status {process.returncode}")
    wall = time.perf_counter() - start
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    measure_s = sum(t.user_attrs.get("measure_s", 0.0)
                    for name in optuna.get_all_study_names(db)
                    for t in optuna.load_study(study_name=name, storage=db).trials)
    return {"devices": devices, "measured": measured, "wall_s": round(wall, 1),
            "configs_per_min": round(60 * measured / wall, 2),
            "startup_s": round(first or 0.0, 1), "measure_s_summed": round(measure_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one, two = (run(devices, args.trials, Path(tmp)) for devices in (1, 2))
    ratio = two["configs_per_min"] / one["configs_per_min"]
    if args.json:
        print(json.dumps({"one": one, "two": two, "ratio": round(ratio, 2)}))
        return
    for result in (one, two):
        print(f"--devices {result['devices']}: {result['measured']} configs in "
              f"{result['wall_s']} s = {result['configs_per_min']} configs/min; start-up to "
              f"the first measured config {result['startup_s']} s, inside measure "
              f"{result['measure_s_summed']} s (summed over workers)")
    print(f"ratio --devices 2 / --devices 1: {ratio:.2f}x (ideal on two cores: 2x)")


if __name__ == "__main__":
    main()
