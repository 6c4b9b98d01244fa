"""Checks a published winner in a fresh process on the attached chip: its output and three
gradients against the float32 reference twice, then its kernel's default config, which ran
first, again: bit-identical to that first run (the chip's state was left right).

    python bench/chip/verify_published.py tune.jsonl [--out verify.json]

``tune.jsonl``: the output of ``autotune tune --json`` (its last summary is checked).
Exits 1 when anything is off.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import jax  # noqa: E402

from bench.chip import Bench  # noqa: E402
from kernel.problem import Problem  # noqa: E402
from kernel.registry import KERNELS  # noqa: E402
from kernel.tolerance import max_relative_error  # noqa: E402


def last_summary(path: Path) -> dict:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    summaries = [line for line in lines if "best_config" in line]
    if not summaries:
        sys.exit(f"{path} holds no tuning summary: nothing was published")
    return summaries[-1]


def verify(summary: dict) -> dict:
    problem = Problem.from_dict(summary["problem"])
    kernel = KERNELS[summary["kernel"]]
    config = kernel.config_from_dict(summary["best_config"])
    default = kernel.default_config(problem, jax.devices()[0].device_kind)
    bench = Bench.of(problem, kernel.name, default)
    tolerance = max_relative_error(problem.dtype, jax.devices()[0].platform)
    runs = [bench.errors(kernel.name, config) for _ in range(2)]
    report = {"kernel": kernel.name, "problem": problem.label(), "config": config.label(),
              "published_errors": runs, "tolerance": tolerance,
              "default_after_holds": bench.canary_holds(),
              "default_errors": bench.errors(kernel.name, default)}
    report["ok"] = (report["default_after_holds"]
                    and all(max(r.values()) <= tolerance for r in (*runs, report["default_errors"])))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tune_output", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = verify(last_summary(args.tune_output))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
