"""Issue 56 goals 1 and 2 on the attached chip: on a grid of problems, what the wrapper runs
after a default ``autotune tune --trials N`` (the kernel choice) against every hand-set
baseline, and our flash kernel tuned against splash tuned, all timed in interleaved rounds in
one run (device time, the tuner's own timing).

The hand-set baselines: splash at MaxText's default, splash with every block 1024 and 2048
where legal, every block 512 and 1024 with the fused backward, MaxText's two recipes, our
flash's default (in fwd_bwd also with its fused backward, issue 74), ``jax_tpu_flash``'s
default and XLA.
Per problem: each contender's median and its ratio to the tuned; ``tuned_vs_fastest_handset``
(the fastest hand-set's time over the tuned's: goal 1 wants at least 1.00), ``over_maxtext``
(MaxText's default over the tuned), ``tuned_same_as`` (the hand-set contenders that run the
published kernel and config themselves: a ratio to those is noise), ``flash_over_splash``
(tuned flash over tuned splash: goal 2 wants at most 1.10) and each one's fraction of the
chip's peak. Over the problems run: the
geometric mean of ``over_maxtext`` (goal 1 wants at least 1.10). Each row also has
``kernel_ms``, the part of its step the kernel's named ``pallas_call``s took (the rest is the
XLA ops around them).

The grid (bfloat16, head_dim 128, 16 heads, batch x sequence = 16k tokens): causal fwd_bwd at
2048, 4096 and 8192; full fwd_bwd at 4096; causal fwd at 4096; GQA 32/8 heads causal fwd_bwd at
8192; then the long problems users train (issue 60): GQA 32/8 causal fwd_bwd at 32768 tokens
(batch 1), and a Gemma-2-style local layer (GQA 16/8, 8192 tokens, a 4096-key causal window,
soft cap 50); then issue 74's short unmasked problems (encoders, ViT): b32 at 512 tokens
(``--head-dim 64`` as the issue has it) and b8 at 2048. ``--problems 1,3`` runs some of them
(a chip session runs a part)::

    python bench/chip/handset.py --problems 1 --trials 30 --out handset-1.json
    python bench/chip/handset.py --interpret     # a CPU check with tiny shapes, no device figures
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

GRID = [  # (batch, q_heads, kv_heads, seq, causal, mode[, window, softcap])
    (8, 16, 16, 2048, True, "fwd_bwd"),
    (4, 16, 16, 4096, True, "fwd_bwd"),
    (2, 16, 16, 8192, True, "fwd_bwd"),
    (4, 16, 16, 4096, False, "fwd_bwd"),
    (4, 16, 16, 4096, True, "fwd"),
    (2, 32, 8, 8192, True, "fwd_bwd"),
    (1, 32, 8, 32768, True, "fwd_bwd"),
    (2, 16, 8, 8192, True, "fwd_bwd", (4095, 0), 50.0),
    (32, 16, 16, 512, False, "fwd_bwd"),
    (8, 16, 16, 2048, False, "fwd_bwd"),
]
INTERPRET_GRID = [(1, 2, 2, 256, True, "fwd_bwd"), (1, 4, 2, 256, True, "fwd"),
                  (1, 2, 1, 256, True, "fwd_bwd", (127, 0), 50.0)]
MAXTEXT = "splash MaxText default"
UNIFORM = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
           "block_kv_dkv_compute", "block_q_dq", "block_kv_dq")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_problem_arguments(parser)
    parser.add_argument("--trials", type=int, default=30, help="configs measured per kernel")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--kernels", default=None,
                        help="the tune's candidates, a,b (default: every kernel that runs here)")
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


def add_problem_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags :func:`problems` reads (``--problems``, ``--head-dim``, ``--interpret``), for
    this bench's parser and every other over the same grid (``peers.py``)."""
    parser.add_argument("--problems", default=None,
                        help="comma-separated indices into bench/chip/handset.py's grid "
                             "(default: all)")
    parser.add_argument("--head-dim", type=int, default=128,
                        help="head_dim of every problem run (default 128)")
    parser.add_argument("--interpret", action="store_true",
                        help="a CPU check: tiny shapes, the kernels in interpret mode")


def problems(args: argparse.Namespace) -> list[Any]:
    from kernel import Problem

    grid, dtype, head_dim = ((INTERPRET_GRID, "float32", 128) if args.interpret
                             else (GRID, "bfloat16", args.head_dim))
    chosen = (range(len(grid)) if args.problems is None
              else [int(i) for i in args.problems.split(",")])
    return [Problem(b, hq, hkv, seq, seq, head_dim, dtype, causal, mode, *features)
            for b, hq, hkv, seq, causal, mode, *features in (grid[i] for i in chosen)]


def handset(problem: Any, interpret: bool) -> tuple[dict[str, tuple[Any, Any]],
                                                    list[dict[str, Any]]]:
    """The hand-set contenders (name -> kernel, config) that run here, and a row for each
    that does not (with why)."""
    from bench.chip.tpu_check import runs_here, target_here
    from kernel import ConfigError, get_kernel
    from kernel.backends.splash import RECIPES, fused, recipe

    splash = get_kernel("splash").discover()
    maxtext = splash.default_config(problem, target_here(splash))
    configs = {MAXTEXT: lambda: (splash, maxtext)}
    for size in (1024, 2048):
        configs[f"splash every block {size}"] = lambda size=size: (
            splash, maxtext.replace(**{name: size for name in UNIFORM}))
    for size in (512, 1024):
        configs[f"splash every block {size}, fused"] = lambda size=size: (
            splash, fused(maxtext.replace(**{name: size for name in UNIFORM})))
    for name, changes in RECIPES.items():
        configs[f"splash recipe {name}"] = lambda changes=changes: (
            splash, recipe(problem, **changes))
    for name in ("flash", "jax_tpu_flash", "xla"):
        kernel = get_kernel(name).discover()
        configs[f"{name} default"] = lambda kernel=kernel: (
            kernel, kernel.default_config(problem, target_here(kernel)))
    if problem.mode == "fwd_bwd":  # issue 74: dQ fused into our dK/dV kernel
        flash = get_kernel("flash").discover()
        configs["flash default, fused"] = lambda: (
            flash, flash.default_config(problem, target_here(flash)).fused())
    contenders, refused = {}, []
    for name, make in configs.items():
        try:
            kernel, config = make()
            why = runs_here(kernel, interpret) or "; ".join(
                map(str, kernel.violations(problem, config, target_here(kernel))))
        except ConfigError as error:  # a block size that does not divide another
            kernel, config, why = None, None, str(error)
        if why:
            refused.append({"name": name, "config": config and config.label(), "error": why})
        else:
            contenders[name] = (kernel, config)
    return contenders, refused


def tuned(problem: Any, args: argparse.Namespace, folder: str) -> tuple[dict, list, dict]:
    """The kernel choice a default tune publishes (name "tuned: KERNEL"), and flash's and
    splash's own tuned winners: contenders, failure rows, the choice's summary."""
    from autotune.choice import choose_kernel, local_kernels
    from autotune.tune import NothingToPublish, TuneOptions
    from kernel import get_kernel
    from storage import Store, upgrade

    url = f"sqlite:///{folder}/{problem.label().replace(' ', '_').replace('/', '-')}.db"
    upgrade(url)
    options = TuneOptions(trials=args.trials, confirm_rounds=args.rounds, seed=0)
    with Store(url) as store:
        try:
            kernels = args.kernels.split(",") if args.kernels else local_kernels()
            summary = choose_kernel(problem, store, url, kernels, options)
        except NothingToPublish as error:
            return {}, [{"name": "tuned", "config": None, "error": str(error)}], {}
    chosen = summary.choice.kernel
    contenders = {}
    for name, label in ((chosen, f"tuned: {chosen}"), ("flash", "flash tuned"),
                        ("splash", "splash tuned")):
        if name in summary.tuned:
            kernel = get_kernel(name)
            contenders[label] = (kernel, kernel.config_from_dict(
                summary.tuned[name]["best_config"]))
    return contenders, [], summary.to_dict()


def ratios(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Goal 1's and goal 2's ratios from one problem's timed rows."""
    ms = {row["name"]: row["median_ms"] for row in rows if row.get("median_ms")}
    tuned_ms = next((v for k, v in ms.items() if k.startswith("tuned: ")), None)
    handset_ms = [v for k, v in ms.items() if "tuned" not in k]

    def over(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    return {"tuned_vs_fastest_handset": over(min(handset_ms, default=None), tuned_ms),
            "over_maxtext": over(ms.get(MAXTEXT), tuned_ms),
            "flash_over_splash": over(ms.get("flash tuned"), ms.get("splash tuned"))}


def same_as_tuned(chosen: dict[str, tuple[Any, Any]],
                  contenders: dict[str, tuple[Any, Any]]) -> list[str]:
    """The hand-set contenders that run the published choice's very kernel and config: their
    ratio to it is the noise of the measurement, not a gap (the tune kept that config)."""
    tuned = [pair for name, pair in chosen.items() if name.startswith("tuned: ")]
    return [name for name, (kernel, config) in contenders.items()
            if any(kernel.name == k.name and config == c for k, c in tuned)]


def main() -> None:
    args = parse_args()
    from bench.chip import write_report
    from bench.chip.tpu_check import interleaved

    out = []
    with tempfile.TemporaryDirectory() as folder:
        for problem in problems(args):
            chosen, failed, choice = tuned(problem, args, folder)
            contenders, refused = handset(problem, args.interpret)
            timed = interleaved(problem, {**chosen, **contenders}, failed + refused, args)
            timed["ratios"] = ratios(timed["contenders"])
            timed["ratios"]["tuned_same_as"] = same_as_tuned(chosen, contenders)
            timed["choice"] = {k: choice.get(k) for k in ("chosen_kernel", "kernels",
                                                           "kernel_failures")}
            out.append(timed)
            print(problem.label(), timed["ratios"], flush=True)
    over_maxtext = [p["ratios"]["over_maxtext"] for p in out if p["ratios"]["over_maxtext"]]
    geomean = (math.exp(sum(map(math.log, over_maxtext)) / len(over_maxtext))
               if over_maxtext else None)
    write_report({"trials": args.trials, "rounds": args.rounds, "interpret": args.interpret,
                  "problems": out, "over_maxtext_geomean": geomean}, args.out)


if __name__ == "__main__":
    main()
