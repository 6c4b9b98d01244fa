"""Issue 63 goal 2: a model's training step on the attached device, its attention from the
table ``autotune.tune_model`` publishes against the same step with each candidate kernel's own
tuned configs, with MaxText's default splash blocks and with XLA's attention.

The models (bfloat16, ``jax.value_and_grad`` of a loss and a plain SGD update, one jitted
step): ``llama``, a decoder of ``--layers`` pre-norm blocks (RMSNorm, grouped-query causal
attention, a SwiGLU MLP of 4x the width, residuals); ``gemma2``, the same blocks alternating a
local layer (a ``--window``-key causal window) and a global one, every logit soft-capped at 50.

The variants: ``tuned`` (the table ``tune_model(..., confirm_step=True)`` returned: the
published choice, confirmed over this step, docs/step-choice.md), ``KERNEL tuned`` for each candidate with
configs to tune that tuned (e.g. ``flash tuned``, ``splash tuned``: that kernel at its own
tuned config for every problem, so an in-model loss can be pinned on one kernel), ``splash
MaxText default`` and ``xla``; ``--variants`` runs some. Each is the same step traced under
its own table (``kernel.tables``) and compiled ahead of time (variants that lower to the same
program share one compile); the steps run in interleaved rounds (A B C, A B C, ...), each
timed as the host wall time of ``--steps`` back-to-back steps (the parameters of one feed the
next), which is the step's whole device time. A variant that fails to compile or run (its
device memory running out, or any error), or whose compiled step needs more than
``--memory-gib``, is a row with one line naming it and the cause; the others still run.

The report: ``tune``, per attention problem, what the tune measured in isolation (the
attention's forward and backward alone): the chosen kernel, each candidate's tuned config and
confirmed median, each kernel's default config's median, MaxText's default's.
``step_confirmation``: which table ``tune_model`` returned and why (each table's median step
and IQR over the confirmation's rounds, ``chosen``: ``tuned`` kept or the kernel whose own
table replaced it, and each problem's kernel). ``variants``,
per variant: its median step, its ratio to the tuned step, which kernel and config each
attention problem ran, the device memory its compiled step needs (``memory_gib``), and
``device_time`` from a ``jax.profiler`` trace of a few steps: per step, the busy time of
every op (``step_ms``), of the ``pallas_call``s the kernels that ran name (``kernels_ms``;
None for a kernel that names none, such as XLA's), the rest (``outside_kernels_ms``), the
kernels' share (``attention_share``), and the 10 other ops with the most busy time
(``other_ops``: HLO instruction, ms, and the JAX operation it came from; instruction names
differ between compiles, the operation does not), so that the gap between two variants'
steps can be attributed. ``--db`` keeps the tune: a
rerun on it measures nothing again::

    python bench/chip/model_step.py --model llama --seq 4096 --trials 10 --out llama-4096.json
    python bench/chip/model_step.py --interpret     # a CPU check: a tiny model, kernels interpreted
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kernel  # noqa: E402
from bench.chip.handset import MAXTEXT  # noqa: E402

SOFTCAP = 50.0  # Gemma 2's attention logit soft cap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("llama", "gemma2"), default="llama")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--window", type=int, default=4096, help="gemma2's local window")
    parser.add_argument("--trials", type=int, default=10, help="configs per kernel and problem")
    parser.add_argument("--kernels", default=None, help="tune_model's candidates (a,b)")
    parser.add_argument("--steps", type=int, default=5, help="back-to-back steps per sample")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--variants", default=None,
                        help="the variants to run (a,b; default all): tuned, KERNEL tuned, "
                             f"{MAXTEXT}, xla")
    parser.add_argument("--db", default=None,
                        help="the tune's database URL (default: a temporary one); a rerun on "
                             "the same one measures nothing already tuned")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="refuse to run a variant whose compiled step needs more device "
                             "memory (GiB) than this (default: the device's own limit)")
    parser.add_argument("--interpret", action="store_true",
                        help="a CPU check: a tiny model, the kernels in interpret mode")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    known = {"tuned", MAXTEXT, "xla",
             *(f"{name} tuned" for name in kernel.kernel_names() if name != "xla")}
    unknown = [name for name in (args.variants or "").split(",") if name and name not in known]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r} in --variants: choose among "
                     f"{', '.join(sorted(known))}")
    if args.interpret:
        args.layers, args.d_model, args.heads, args.kv_heads = 2, 256, 2, 1
        args.seq, args.window, args.trials, args.steps, args.rounds = 256, 128, 1, 1, 2
        args.kernels = args.kernels or "flash,xla"
    return args


def init_params(args: argparse.Namespace, key: Any) -> dict[str, Any]:
    """Each layer's weights, bfloat16, scaled so activations stay near unit size."""
    d, hd = args.d_model, args.head_dim
    shapes = {"q": (d, args.heads * hd), "k": (d, args.kv_heads * hd),
              "v": (d, args.kv_heads * hd), "o": (args.heads * hd, d),
              "gate": (d, 4 * d), "up": (d, 4 * d), "down": (4 * d, d)}
    layers = []
    for layer_key in jax.random.split(key, args.layers):
        keys = dict(zip(shapes, jax.random.split(layer_key, len(shapes))))
        layers.append({name: (jax.random.normal(keys[name], shape, jnp.float32)
                              * shape[0] ** -0.5).astype(jnp.bfloat16)
                       for name, shape in shapes.items()})
    return {"layers": layers}


def rms_norm(x: Any) -> Any:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def attention(q: Any, k: Any, v: Any, args: argparse.Namespace, local: bool) -> Any:
    """One layer's attention through the wrapper (``[batch, seq, heads, head_dim]``): causal,
    a ``--window``-key window in a local layer, gemma2's soft cap."""
    return kernel.flash_attention(q, k, v, causal=True, layout="BSHD",
                                  window=(args.window - 1, 0) if local else None,
                                  logits_soft_cap=SOFTCAP if args.model == "gemma2" else None)


def block(x: Any, w: dict[str, Any], args: argparse.Namespace, local: bool,
          attend: Any = attention) -> Any:
    """One pre-norm decoder block: attention (``attend``, as :func:`attention`), then a
    SwiGLU MLP."""
    b, s, _ = x.shape
    h = rms_norm(x)
    q = (h @ w["q"]).reshape(b, s, args.heads, args.head_dim)
    k, v = ((h @ w[n]).reshape(b, s, args.kv_heads, args.head_dim) for n in "kv")
    out = attend(q, k, v, args, local)
    x = x + out.reshape(b, s, -1) @ w["o"]
    h = rms_norm(x)
    return x + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]


def make_step(args: argparse.Namespace, attend: Any = attention) -> Any:
    """The training step: ``jax.value_and_grad`` of the model's loss and an SGD update, each
    layer's attention ``attend`` (:func:`attention`)."""
    def loss(params: dict[str, Any], x: Any) -> Any:
        for i, w in enumerate(params["layers"]):
            x = block(x, w, args, local=args.model == "gemma2" and i % 2 == 0, attend=attend)
        return jnp.mean(rms_norm(x).astype(jnp.float32) ** 2)

    def step(params: dict[str, Any], x: Any) -> tuple[dict[str, Any], Any]:
        value, grads = jax.value_and_grad(loss)(params, x)
        return jax.tree.map(lambda p, g: (p - 1e-3 * g).astype(p.dtype), params, grads), value

    return step


def variants(args: argparse.Namespace, step: Any, params: Any, x: Any,
             db: str) -> tuple[dict[str, Any], list[Any], Any]:
    """The tables each variant traces under (name -> table, or the line saying why it has
    none), the problems tuned, and the table ``tune_model`` returned (confirmed over the
    step)."""
    import autotune
    from autotune.step_choice import own_tuned_tables, pinned_table
    from autotune.tune import TuneOptions
    from bench.chip.tpu_check import target_here

    with kernel.capture() as captured:
        jax.eval_shape(step, params, x)
    problems = list(captured)
    tuned = autotune.tune_model(step, params, x, db=db, trials=args.trials,
                                kernels=args.kernels, confirm_step=True,
                                options=TuneOptions(confirm_rounds=args.rounds))
    own = {f"{name} tuned": table for name, table in own_tuned_tables(tuned, problems).items()
           if any(kernel.get_kernel(name).space_params(p) for p in problems)}
    tables = {"tuned": tuned, **own,
              MAXTEXT: pinned_table(problems, "splash",
                                    lambda k, p: k.default_config(p, target_here(k))),
              "xla": pinned_table(problems, "xla", lambda k, p: k.default_config(p))}
    wanted = args.variants.split(",") if args.variants else list(tables)
    return {name: tables[name] for name in wanted if name in tables}, problems, tuned


def tune_figures(tuned: Any, problems: list[Any]) -> dict[str, dict[str, Any]]:
    """Per problem, what the tune measured in isolation (the whole step of the attention's
    forward and backward alone): the chosen kernel, each candidate's tuned config and its
    confirmed median (``kernels_ms``, the times the choice compared; None: it failed, with
    why in ``failures``), each kernel's default config's median from its own tune
    (``defaults_ms``), and MaxText's default's (splash's default)."""
    figures = {}
    for problem in problems:
        choice = next((c for c in tuned.choices if c.problem == problem), None)
        entries = {table.kernel: entry for table in tuned.kernel_tables()
                   for entry in table.entries if entry.problem == problem}
        figures[problem.label()] = {
            "chosen": choice.kernel if choice else None,
            "kernels_ms": choice.times_ms() if choice else {},
            "failures": {name: timing.failure for name, timing in choice.candidates.items()
                         if timing.failure} if choice else {},
            "configs": {name: entry.config.label(problem.mode)
                        for name, entry in entries.items()},
            "defaults_ms": {name: entry.default_time_ms for name, entry in entries.items()},
            "maxtext_default_ms": entries["splash"].default_time_ms
            if "splash" in entries else None}
    return figures


def step_confirmation(tuned: Any) -> dict[str, Any] | None:
    """Which table ``tune_model`` returned and why: the step confirmation its choices record
    (each variant's median step and spread; ``chosen``: ``tuned``, the isolated choice kept,
    or the kernel whose own tuned table replaced it), and the kernel each problem runs."""
    record = next((c.provenance["step_confirmation"] for c in tuned.choices
                   if "step_confirmation" in c.provenance), None)
    return None if record is None else record | {
        "kernels": {c.problem.label(): c.kernel for c in tuned.choices}}


def lowered_under(table: Any, step: Any, params: Any, x: Any,
                  problems: list[Any]) -> tuple[Any, dict[str, str]]:
    """The step lowered with its attention resolved by ``table``, and what each of its
    ``problems`` ran (the process's other resolutions left out)."""
    with kernel.tables(table):
        lowered = jax.jit(step).lower(params, x)
        sources = {f"{name} {problem.label()}": why
                   for (name, _, problem), why in kernel.resolution_sources().items()
                   if problem in problems}
    return lowered, sources


def failure_line(name: str, doing: str, error: Exception) -> str:
    """One line naming the variant, what failed and why (out of device memory, as
    ``autotune.failures.out_of_memory`` tells it, or the error's class) and the error's first
    line, e.g. ``xla: out of device memory compiling the step (RESOURCE_EXHAUSTED: ...)``."""
    from autotune.failures import out_of_memory
    from present.text import first_line

    cause = "out of device memory" if out_of_memory(error) else type(error).__name__
    return f"{name}: {cause} {doing} ({first_line(str(error))})"


def memory_gib(executable: Any) -> float | None:
    """The device memory the compiled step needs (GiB): its arguments, outputs and
    temporaries, from the compiler's memory analysis (None where it gives none)."""
    from autotune.measure import GIB

    analysis = executable.memory_analysis()
    if analysis is None:
        return None
    return (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
            + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes) / GIB


class StepOutOfMemory(RuntimeError):
    """The compiled step needs more device memory than ``--memory-gib``: worded with the
    status a device's compiler gives a step that does not fit its memory, so both read as
    running out of it (:func:`autotune.failures.out_of_memory`)."""


def check_fits(executable: Any, limit_gib: float | None) -> None:
    """Raises ``StepOutOfMemory`` when the compiled step needs more than ``limit_gib``."""
    needed = memory_gib(executable)
    if limit_gib is not None and needed is not None and needed > limit_gib:
        raise StepOutOfMemory(f"RESOURCE_EXHAUSTED: the compiled step needs {needed:.4g} GiB "
                              f"(arguments, outputs, temporaries) over --memory-gib "
                              f"{limit_gib:.4g}")


def compile_each(tables: dict[str, Any], step: Any, params: Any, x: Any, problems: list[Any],
                 limit_gib: float | None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Each variant's compiled step, and a row per variant: what it ran and the device memory
    it needs, or the one-line error of a variant with no table, one that fails to compile or
    one that needs more than ``limit_gib``. Variants whose steps lower to the same program
    (the tuned table's and its chosen kernel's own, when it chose one kernel throughout) share
    one compile."""
    executables, rows, programs = {}, {}, {}
    for name, table in tables.items():
        if isinstance(table, str):
            rows[name] = {"error": table}
            continue
        try:
            lowered, ran = lowered_under(table, step, params, x, problems)
            text = lowered.as_text()  # a variant that lowers as another did runs its program
            executable = programs[text] if text in programs else lowered.compile()
            programs[text] = executable
            check_fits(executable, limit_gib)
        except Exception as error:  # noqa: BLE001 - a variant's failure is its row
            rows[name] = {"error": failure_line(name, "compiling the step", error)}
            continue
        executables[name], rows[name] = executable, {"memory_gib": memory_gib(executable),
                                                     "ran": ran}
    return executables, rows


def warmed(executables: dict[str, Any], params: Any, x: Any,
           rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The executables that run one step (untimed, a warm-up); the others' rows get the
    error."""
    running = {}
    for name, executable in executables.items():
        try:
            jax.block_until_ready(executable(params, x))
        except Exception as error:  # noqa: BLE001 - e.g. the device's memory running out
            rows[name]["error"] = failure_line(name, "running the step", error)
            continue
        running[name] = executable
    return running


def timed_rounds(executables: dict[str, Any], params: Any, x: Any,
                 args: argparse.Namespace) -> dict[str, list[float]]:
    """Per variant, the wall time of ``args.steps`` back-to-back steps (each feeding its
    parameters to the next) over ``args.rounds`` interleaved rounds (ms per step)."""
    from autotune.measure import Timing, interleaved

    def timer(run: Any) -> Any:
        def sample() -> Timing:
            state = jax.block_until_ready(params)
            start = time.perf_counter()
            for _ in range(args.steps):
                state, value = run(state, x)
            jax.block_until_ready(value)
            return Timing(((time.perf_counter() - start) * 1e3 / args.steps,))
        return sample

    timers = {name: timer(run) for name, run in executables.items()}
    return {name: list(timing.samples_ms) for name, timing in
            interleaved(timers, args.rounds).items()}


def device_time(executable: Any, params: Any, x: Any, ran: dict[str, str], runs: int = 3,
                top: int = 10) -> dict[str, Any]:
    """From one profiler trace of ``runs`` steps, per step: the busy time of every op of the
    step (``step_ms``), of the ``pallas_call``s the kernels that ran name (``kernels_ms``,
    None for a kernel that names none, such as XLA's), the rest (``outside_kernels_ms``), the
    kernels' share (``attention_share``), and the ``top`` other ops by busy time
    (``other_ops``: HLO instruction, ms, and the JAX operation it came from; an op inside
    another, a loop's body, counts in both), so that the gap between two variants can be
    attributed."""
    from autotune.timing import (
        busy_per_op,
        kernel_op_matcher,
        op_names,
        op_sources,
        run_times,
        trace_runs,
    )

    names = {name for key in ran for name in kernel.get_kernel(key.split()[0]).profile_names}
    events = trace_runs(lambda: executable(params, x)[1], runs)
    every_op = kernel_op_matcher(op_names(executable), ())
    named = kernel_op_matcher((), names) if names else (lambda _: False)
    step = run_times(events, runs, every_op)
    kernels = run_times(events, runs, named) if names else None
    others = busy_per_op(events, runs, lambda op: every_op(op) and not named(op))
    sources = op_sources(executable)
    step_ms = statistics.median(step) if step else None
    kernels_ms = statistics.median(kernels) if kernels else None
    both = step_ms is not None and kernels_ms is not None
    return {"step_ms": step_ms, "kernels_ms": kernels_ms,
            "outside_kernels_ms": step_ms - kernels_ms if both else None,
            "attention_share": kernels_ms / step_ms if both and step_ms else None,
            "other_ops": [{"op": op, "ms": ms, "source": sources.get(op, "")}
                          for op, ms in sorted(others.items(), key=lambda item: -item[1])[:top]]}


def profiled(name: str, executable: Any, params: Any, x: Any,
             row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with the variant's :func:`device_time` (its attention share beside), or the
    line saying why the profile failed."""
    try:
        breakdown = device_time(executable, params, x, row["ran"])
    except Exception as error:  # noqa: BLE001 - the timing stands without it
        return row | {"attention_share": None,
                      "device_time_error": failure_line(name, "profiling the step", error)}
    return row | {"attention_share": breakdown["attention_share"], "device_time": breakdown}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from bench.chip import write_report

    step = make_step(args)
    params = init_params(args, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (args.batch, args.seq, args.d_model),
                          jnp.float32).astype(jnp.bfloat16)
    with tempfile.TemporaryDirectory() as folder:
        tables, problems, tuned = variants(args, step, params, x,
                                           args.db or f"sqlite:///{folder}/model.db")
    executables, rows = compile_each(tables, step, params, x, problems, args.memory_gib)
    executables = warmed(executables, params, x, rows)
    samples = timed_rounds(executables, params, x, args)
    medians = {name: statistics.median(times) for name, times in samples.items()}
    for name, times in samples.items():
        rows[name] = profiled(name, executables[name], params, x, rows[name]) | {
            "median_ms": medians[name], "samples_ms": times,
            "over_tuned": medians[name] / medians["tuned"] if "tuned" in medians else None}
    report = {"model": vars(args) | {"out": None},
              "problems": [p.label() for p in problems],
              "tune": tune_figures(tuned, problems),
              "step_confirmation": step_confirmation(tuned),
              "variants": rows,
              "timing": f"host wall time of {args.steps} back-to-back steps, median of "
                        f"{args.rounds} interleaved rounds"}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
