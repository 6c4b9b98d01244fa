"""Variants of our flash kernel against splash over the whole training step (issue 61).

Each ``--variant NAME=PATH`` is a copy of ``kernel/backends/flash/pallas.py`` (one step of the
issue's changes, e.g. ``git show REV:kernel/backends/flash/pallas.py > .ablation/NAME.py``),
loaded as a module of its own in this one process (it imports the rest of the package as
usual). Each variant, at flash's config with every block ``--block`` and pipeline depth
``--depth``, and splash with every block ``--splash-block`` (the project's backend), runs the
fwd_bwd step the tuner measures (the gradients of the attention's sum, jitted); the time of a
step is the host wall time of ``--calls`` back-to-back calls over ``--calls`` (on a TPU v5e the
device's busy time, pallas-facts section 11), median over ``--rounds`` interleaved rounds. Each
output (out, dq, dk, dv) has its relative error against the float32 reference. On a CPU the
kernels run in interpret mode: errors only, the times mean nothing::

    python bench/chip/flash_ablation.py --variant before=.ablation/before.py \\
        --variant rows=.ablation/rows.py [--out F.json]

The problem is causal unless ``--full``. ``--fused both`` runs each variant's backward unfused
(row ``NAME``) and fused (``fused_bwd``, row ``NAME fused``: a variant from before the flag
cannot), ``--splash-fused both`` splash's likewise (``splash``, ``splash fused``); each row's
``vs_splash`` is over the fastest splash row (issue 74)::

    python bench/chip/flash_ablation.py --variant now=kernel/backends/flash/pallas.py --full \\
        --fused both --splash-fused both --batch 32 --seq 512 --head-dim 64
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import jax  # noqa: E402

from autotune.measure import Timing, interleaved  # noqa: E402
from bench.chip import OUTPUTS, Bench, write_report  # noqa: E402
from bench.chip.timing import back_to_back_ms, spread  # noqa: E402
from kernel import FlashConfig, Problem, get_kernel  # noqa: E402
from kernel.backends.splash import fused as splash_fused  # noqa: E402
from kernel.backends.flash.blocks import Reach  # noqa: E402
from kernel.contract import AttentionFn, default_scale, measured_fn  # noqa: E402
from kernel.tolerance import relative_error  # noqa: E402

FLASH_BLOCKS = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv",
                "block_q_dq", "block_kv_dq")
SPLASH_BLOCKS = FLASH_BLOCKS + ("block_kv_dkv_compute",)


def load_variant(name: str, path: Path) -> ModuleType:
    """The kernel file at ``path`` as a module of its own, named after ``name``."""
    module_name = "kernel.backends.flash._ablation_" + re.sub(r"\W", "_", name)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or not path.is_file():
        raise SystemExit(f"--variant {name}={path}: no such file; write it with git show "
                         "REV:kernel/backends/flash/pallas.py > PATH")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def variant_attention(module: ModuleType, problem: Problem, config: FlashConfig) -> AttentionFn:
    """The variant's kernels as ``FlashKernel.attention`` runs ``pallas``'s."""
    logits = module.Logits(default_scale(problem), Reach.of(problem), problem.softcap)
    return lambda q, k, v, *ids: module.flash_attention(q, k, v, ids or None, logits,
                                                        lambda mode: config)


def measure(bench: Bench, attend: AttentionFn) -> tuple[Any, dict[str, float]]:
    """(the jitted fwd_bwd step, each output's relative error) of ``attend``."""
    problem = bench.problem
    step = jax.jit(measured_fn(problem, attend))
    forward = jax.jit(measured_fn(dataclasses.replace(problem, mode="fwd"), attend))
    got = (forward(*bench.inputs), *step(*bench.inputs))
    return step, {name: relative_error(g, w)
                  for name, g, w in zip(OUTPUTS, got, bench.reference, strict=True)}


def parse_variant(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=PATH")
    return name, Path(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", type=parse_variant, action="append", required=True,
                        metavar="NAME=PATH", help="a copy of kernel/backends/flash/pallas.py")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block", type=int, default=512, help="flash's every block")
    parser.add_argument("--depth", type=int, default=2, help="flash's every pipeline depth")
    parser.add_argument("--splash-block", type=int, default=1024, help="splash's every block")
    parser.add_argument("--full", action="store_true", help="unmasked (default: causal)")
    both = ("no", "yes", "both")
    parser.add_argument("--fused", choices=both, default="no",
                        help="flash's fused backward: each variant unfused, fused or both")
    parser.add_argument("--splash-fused", choices=both, default="no",
                        help="splash's use_fused_bwd_kernel: unfused, fused or both")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    problem = Problem(batch=args.batch, q_heads=args.heads, kv_heads=args.heads,
                      q_len=args.seq, kv_len=args.seq, head_dim=args.head_dim,
                      dtype=args.dtype, causal=not args.full, mode="fwd_bwd")
    flash, splash = get_kernel("flash"), get_kernel("splash")
    unfused = FlashConfig(**dict.fromkeys(FLASH_BLOCKS, args.block)).replace(
        pipeline_depth=args.depth, pipeline_depth_dkv=args.depth, pipeline_depth_dq=args.depth)
    splash_unfused = splash.default_config(problem, "v5e").replace(
        **dict.fromkeys(SPLASH_BLOCKS, args.splash_block))
    flash_configs = fused_choices(args.fused, unfused, unfused.fused())
    splash_configs = fused_choices(args.splash_fused, splash_unfused,
                                   splash_fused(splash_unfused))
    for kernel, configs in ((flash, flash_configs), (splash, splash_configs)):
        for config in configs.values():
            kernel.check(problem, config)
    modules = {name: load_variant(name, path) for name, path in args.variant}
    # inputs, float32 reference
    bench = Bench.of(problem, "splash", next(iter(splash_configs.values())))
    attends = {f"{name}{suffix}": variant_attention(module, problem, config)
               for name, module in modules.items() for suffix, config in flash_configs.items()}
    attends.update({f"splash{suffix}": splash.attention(problem, lambda mode, c=config: c,
                                                        default_scale(problem))
                    for suffix, config in splash_configs.items()})
    rows, timers = {}, {}
    for name, attend in attends.items():
        step, errors = measure(bench, attend)
        rows[name] = {"max_error": max(errors.values()), "errors": errors}
        timers[name] = lambda step=step: Timing((back_to_back_ms(step, bench.inputs,
                                                                 args.calls),))
    for name, timing in interleaved(timers, args.rounds).items():
        rows[name].update(median_ms=round(timing.median_ms, 3),
                          spread=round(spread(list(timing.samples_ms)), 3)
                          if len(timing.samples_ms) > 1 else 0.0)
    fastest_splash = min(rows[f"splash{suffix}"]["median_ms"] for suffix in splash_configs)
    for row in rows.values():
        row["vs_splash"] = round(row["median_ms"] / fastest_splash, 3)
    write_report({"problem": problem.label(),
                  "flash_config": " | ".join(c.label() for c in flash_configs.values()),
                  "splash_config": " | ".join(c.label() for c in splash_configs.values()),
                  "rounds": args.rounds, "calls": args.calls, "rows": rows}, args.out)


def fused_choices(choice: str, unfused: Any, fused: Any) -> dict[str, Any]:
    """Row-name suffix -> config for ``--fused``/``--splash-fused`` ``choice``."""
    return {"no": {"": unfused}, "yes": {" fused": fused},
            "both": {"": unfused, " fused": fused}}[choice]


if __name__ == "__main__":
    main()
