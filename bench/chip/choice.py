"""Which kernel wins each shape: every candidate kernel tuned, confirmed against the others in
interleaved rounds, and the chosen one, for a grid of shapes, in one run.

The grid: sequence 128 to 8192, head_dim 64 and 128, causal or not (``--full``; the default
grid is a subset that fits a short device check, and on a CPU a few small shapes). Per shape
it runs what ``autotune tune --kernels`` runs (``autotune.choice.choose_kernel``, into a
throw-away SQLite file) and prints each kernel's confirmed median and spread as a ratio to the
chosen kernel's, measured in the same run, then one JSON line per shape.

On a CPU the Pallas kernels run in interpret mode: those figures say nothing about a device
and every line says so. On a TPU or GPU the same script gives the real table::

    PYTHONPATH=. python bench/chip/choice.py                # the default grid
    PYTHONPATH=. python bench/chip/choice.py --full         # 7 lengths x 2 head_dims x causal
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

FULL_SEQ = (128, 256, 512, 1024, 2048, 4096, 8192)
DEVICE_SEQ = (512, 2048, 8192)
CPU_SEQ = (128, 256)
HEAD_DIMS = (64, 128)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true",
                        help=f"the full grid: sequence {', '.join(map(str, FULL_SEQ))}, "
                             "head_dim 64 and 128, causal and not")
    parser.add_argument("--kernels", default=None,
                        help="comma-separated candidates (default: every registered kernel "
                             "with rules for this device; on a TPU flash, jax_tpu_flash, "
                             "splash and xla)")
    parser.add_argument("--trials", type=int, default=None,
                        help="configs measured per kernel and shape (default 4; 1 on a CPU)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--batch", type=int, default=None, help="default 1 (CPU) or 4")
    parser.add_argument("--heads", type=int, default=None, help="default 2 (CPU) or 16")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="default float32 (CPU) or bfloat16")
    return parser.parse_args(argv)


def grid(args: argparse.Namespace, on_cpu: bool) -> list[Any]:
    """The problems to run: the full grid, or a subset sized for the machine."""
    from kernel import Problem

    seqs, dims = (FULL_SEQ, HEAD_DIMS) if args.full else (
        (CPU_SEQ, HEAD_DIMS[:1]) if on_cpu else (DEVICE_SEQ, HEAD_DIMS))
    batch = args.batch or (1 if on_cpu else 4)
    heads = args.heads or (2 if on_cpu else 16)
    dtype = args.dtype or ("float32" if on_cpu else "bfloat16")
    return [Problem(batch, heads, heads, seq, seq, head_dim, dtype=dtype, causal=causal)
            for seq, head_dim, causal in itertools.product(seqs, dims, (False, True))]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Chooses a kernel for every problem of the grid; one result dict per problem."""
    import jax
    import optuna

    from autotune.choice import choose_kernel, local_kernels
    from autotune.tune import NothingToPublish, TuneOptions
    from storage import Store, upgrade

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    on_cpu = jax.devices()[0].platform == "cpu"
    kernels = args.kernels.split(",") if args.kernels else local_kernels()
    options = TuneOptions(trials=args.trials or (1 if on_cpu else 4),
                          confirm_rounds=args.rounds, confirm_top=2)
    out = []
    with tempfile.TemporaryDirectory() as folder:
        url = f"sqlite:///{folder}/choice.db"
        upgrade(url)
        with Store(url) as store:
            for problem in grid(args, on_cpu):
                try:
                    summary = choose_kernel(problem, store, url, kernels, options)
                except NothingToPublish as error:
                    out.append({"problem": problem.label(), "chosen": None,
                                "error": str(error)})
                    print(f"{problem.label()}: no kernel ran ({error})", flush=True)
                    continue
                out.append(report(summary))
    return out


def report(summary: Any) -> dict[str, Any]:
    """Prints one line for a shape (each kernel as a ratio to the chosen one) and its JSON."""
    from present.text import first_line

    choice = summary.choice
    chosen_ms = choice.candidates[choice.kernel].median_ms
    method = choice.provenance["method"]
    parts = []
    for name, timing in choice.candidates.items():
        if timing.failure:
            why = summary.failures.get(name)
            parts.append(f"{name} failed ({timing.failure}"
                         + (f": {first_line(why)})" if why else ")"))
        else:
            parts.append(f"{name} {timing.median_ms:.3f}±{timing.iqr_ms:.3f} ms "
                         f"({timing.median_ms / chosen_ms:.2f}x chosen)")
    note = " [interpret mode: no device figures]" if method == "interpret" else ""
    print(f"{summary.problem.label()} on {summary.device_kind}: chosen {choice.kernel}; "
          + ", ".join(parts) + note, flush=True)
    line = {"problem": summary.problem.label(), "device": summary.device_kind,
            "method": method, "chosen": choice.kernel,
            "kernels": {name: t.to_dict() for name, t in choice.candidates.items()},
            "failures": summary.failures,
            "over_chosen": {name: t.median_ms / chosen_ms
                            for name, t in choice.candidates.items() if t.median_ms}}
    print(json.dumps(line), flush=True)
    return line


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
