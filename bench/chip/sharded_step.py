"""Issue 71's step on one device: a Gemma-2-style training step (local sliding-window and
global layers alternating, every logit soft-capped at 50, grouped-query heads; the model of
``bench/chip/model_step.py``) in both sharded styles of docs/sharded-training.md, each over a mesh of
the one device:

- ``maxtext``: a mesh of Auto axes (MaxText's), each layer's attention through
  ``kernel.maxtext.tpu_flash_attention`` (its own ``shard_map(check_vma=False)``), the query
  scaled before it as MaxText scales it;
- ``set_mesh``: ``jax.set_mesh`` over a mesh of Explicit axes, the wrapper called directly.

Each style's step is tuned with ``autotune.tune_model`` (``--trials`` configs per kernel and
problem, ``--kernels``; the second style finds the first's problems tuned), compiled under the
table it returned and run (``--steps`` back-to-back steps, ``--rounds`` interleaved rounds,
host wall time). ``ran``: what each attention problem of the step ran and why (the
wrapper's ``resolution_sources()``); ``fallbacks``: each problem that did not run the kernel
its choice names (a next best, the platform's kernel, or no choice at all): any makes the exit
status 1. ``export``: ``autotune export --format maxtext`` on the tuned database over the
step's problems (a local and a global layer), run in this process as a user runs it: its exit
code, the flags it prints (``flags``: ``sa_*`` of the global layer's config, ``local_sa_*`` of
the local one's) and what it says on stderr (``lines``: each layer type's confirmation, and
what it could not express).

    python bench/chip/sharded_step.py --trials 8 --out sharded-step.json
    python bench/chip/sharded_step.py --interpret --out /tmp/step.json  # a CPU check: tiny, no figures
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

import kernel  # noqa: E402
from bench.chip.model_step import (  # noqa: E402
    SOFTCAP,
    attention,
    init_params,
    lowered_under,
    make_step,
    timed_rounds,
)
from kernel.maxtext import tpu_flash_attention  # noqa: E402

STYLES = ("maxtext", "set_mesh")
AXES = ("data", "model")  # batch over "data", heads over "model": one device each here
CHOSEN = "kernel: chosen"  # a resolution source's mark of the choice's own kernel having run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="local and global alternating")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024,
                        help="the local layers' window (keys), below --seq")
    parser.add_argument("--trials", type=int, default=8, help="configs per kernel and problem")
    parser.add_argument("--kernels", default="flash,splash", help="tune_model's candidates")
    parser.add_argument("--steps", type=int, default=3, help="back-to-back steps per sample")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds of the steps and of the tune's confirmation")
    parser.add_argument("--db", default=None, help="the tune's database URL (default: a "
                                                   "temporary one)")
    parser.add_argument("--interpret", action="store_true",
                        help="a CPU check: a tiny model, the kernels in interpret mode")
    parser.add_argument("--out", type=Path)
    parser.set_defaults(model="gemma2")
    args = parser.parse_args(argv)
    if args.interpret:
        args.d_model, args.heads, args.kv_heads, args.head_dim = 128, 2, 1, 128
        args.seq, args.window, args.batch, args.trials = 128, 64, 1, 1
        args.steps, args.rounds, args.kernels = 1, 1, "flash"
    if not 0 < args.window < args.seq:
        parser.error(f"--window {args.window} must be above 0 and below --seq {args.seq}: a "
                     "window over every key is a global layer")
    return args


def one_device_mesh(style: str) -> Any:
    """A mesh of the default device, its axes Auto (``maxtext``) or Explicit (``set_mesh``)."""
    kind = AxisType.Auto if style == "maxtext" else AxisType.Explicit
    return jax.make_mesh((1, 1), AXES, axis_types=(kind, kind), devices=jax.devices()[:1])


def maxtext_attention(mesh: Any) -> Any:
    """Each layer's attention as MaxText's attention op runs it, through the drop-in: the
    query scaled by ``head_dim ** -0.5`` before (MaxText's query projection does), BSHD in and
    out, the specs its logical axes resolve to over ``mesh``."""
    spec = PartitionSpec(*AXES)

    def attend(q: Any, k: Any, v: Any, args: argparse.Namespace, local: bool) -> Any:
        scaled = (q * args.head_dim ** -0.5).astype(q.dtype)
        return tpu_flash_attention(scaled, k, v, None, SOFTCAP, mesh=mesh, axis_names_q=spec,
                                   axis_names_kv=spec,
                                   attention_type="local_sliding" if local else "global",
                                   sliding_window_size=args.window)

    return attend


def fallbacks(table: Any, problems: list[Any], ran: dict[str, str]) -> list[str]:
    """One line per problem that did not run the kernel its choice in ``table`` names."""
    chosen = {c.problem: c.kernel for c in table.choices}
    lines = []
    for problem in problems:
        name = chosen.get(problem)
        why = ran.get(f"{name} {problem.label()}", "")
        if name is None or CHOSEN not in why:
            others = {key: source for key, source in ran.items()
                      if key.endswith(problem.label())}
            lines.append(f"{problem.label()}: the choice names {name or 'no kernel'}, it ran "
                         f"{others or 'nothing'}")
    return lines


def tuned_style(style: str, args: argparse.Namespace, params: Any, x: Any,
                db: str) -> tuple[Any, dict[str, Any], list[Any]]:
    """The style's step tuned and compiled under its table: the executable, its row (the
    table's choices, what each problem ran, the fallbacks) and the step's problems."""
    import autotune
    from autotune.tune import TuneOptions

    mesh = one_device_mesh(style)
    step = make_step(args, maxtext_attention(mesh) if style == "maxtext" else attention)
    with jax.set_mesh(mesh):
        placed = jax.device_put((params, x), NamedSharding(mesh, PartitionSpec()))
        with kernel.capture() as captured:
            jax.eval_shape(step, *placed)
        problems = list(captured)
        table = autotune.tune_model(step, *placed, db=db, trials=args.trials,
                                    kernels=args.kernels,
                                    options=TuneOptions(confirm_rounds=args.rounds))
        lowered, ran = lowered_under(table, step, *placed, problems)
        executable = lowered.compile()
    row = {"problems": [p.label() for p in problems],
           "choices": {c.problem.label(): {"kernel": c.kernel,
                                            "candidates": c.times_ms()} for c in table.choices},
           "ran": ran, "fallbacks": fallbacks(table, problems, ran)}
    return executable, row, problems


def maxtext_export(problems: list[Any], db: str, folder: str) -> dict[str, Any]:
    """``autotune export --format maxtext --shapes`` of ``problems`` on ``db``, in this
    process (a second process could not open the device): its exit code, the flags it printed
    and its stderr lines."""
    from typer.testing import CliRunner

    from autotune.cli import app

    shapes = Path(folder) / "shapes.json"
    shapes.write_text(json.dumps([p.to_dict() for p in problems]))
    done = CliRunner().invoke(app, ["export", "--format", "maxtext", "--shapes", str(shapes),
                                    "--db", db], env={"COLUMNS": "250"})
    return {"shapes": [p.label() for p in problems], "exit_code": done.exit_code,
            "flags": done.stdout.split(), "lines": done.stderr.splitlines()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from bench.chip import write_report

    params = init_params(args, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (args.batch, args.seq, args.d_model),
                          jnp.float32).astype(jnp.bfloat16)
    with tempfile.TemporaryDirectory() as folder:
        db = args.db or f"sqlite:///{folder}/sharded-step.db"
        executables, rows, problems = {}, {}, []
        for style in STYLES:
            executables[style], rows[style], problems = tuned_style(style, args, params, x, db)
            rows[style]["loss"] = float(executables[style](params, x)[1])
        samples = timed_rounds(executables, params, x, args)
        for style, times in samples.items():
            rows[style] |= {"median_ms": statistics.median(times), "samples_ms": times}
        export = maxtext_export(problems, db, folder)
    report = {"model": vars(args) | {"out": None}, "styles": rows, "export": export,
              "fallbacks": [line for row in rows.values() for line in row["fallbacks"]],
              "timing": f"host wall time of {args.steps} back-to-back steps, median of "
                        f"{args.rounds} interleaved rounds"}
    write_report(report, args.out)
    if report["fallbacks"]:
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
