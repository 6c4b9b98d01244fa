"""Issue 63 goal 2: a model's training step on the attached device, its attention from the
table ``autotune.tune_model`` publishes against the same step with MaxText's default splash
blocks and with XLA's attention.

The models (bfloat16, ``jax.value_and_grad`` of a loss and a plain SGD update, one jitted
step): ``llama``, a decoder of ``--layers`` pre-norm blocks (RMSNorm, grouped-query causal
attention, a SwiGLU MLP of 4x the width, residuals); ``gemma2``, the same blocks alternating a
local layer (a ``--window``-key causal window) and a global one, every logit soft-capped at 50.

Each variant is the same step traced under its own table (``kernel.tables``) and compiled
ahead of time; the steps run in interleaved rounds (A B C, A B C, ...), each timed as the host
wall time of ``--steps`` back-to-back steps (the parameters of one feed the next), which is
the step's whole device time. The report has each variant's median step, its ratio to the
tuned step, which kernel and config each attention problem ran, the attention problems the
tune found, and the attention's share of the step: from a ``jax.profiler`` trace of a few
steps, the busy time of the ``pallas_call``s the kernels that ran name over that of every op
of the step (None for a kernel that names none, such as XLA's)::

    python bench/model_step.py --model llama --seq 4096 --trials 10 --out llama-4096.json
    python bench/model_step.py --interpret     # a CPU check: a tiny model, kernels interpreted
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kernel  # noqa: E402
from bench.handset import MAXTEXT  # noqa: E402

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
    parser.add_argument("--interpret", action="store_true",
                        help="a CPU check: a tiny model, the kernels in interpret mode")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.interpret:
        args.layers, args.d_model, args.heads, args.kv_heads = 2, 256, 2, 1
        args.seq, args.window, args.trials, args.steps, args.rounds = 256, 128, 2, 1, 2
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


def block(x: Any, w: dict[str, Any], args: argparse.Namespace, local: bool) -> Any:
    """One pre-norm decoder block: attention through the wrapper, then a SwiGLU MLP."""
    b, s, _ = x.shape
    h = rms_norm(x)
    q = (h @ w["q"]).reshape(b, s, args.heads, args.head_dim)
    k, v = ((h @ w[n]).reshape(b, s, args.kv_heads, args.head_dim) for n in "kv")
    gemma = args.model == "gemma2"
    out = kernel.flash_attention(q, k, v, causal=True, layout="BSHD",
                                 window=(args.window - 1, 0) if local else None,
                                 logits_soft_cap=SOFTCAP if gemma else None)
    x = x + out.reshape(b, s, -1) @ w["o"]
    h = rms_norm(x)
    return x + (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]


def make_step(args: argparse.Namespace) -> Any:
    def loss(params: dict[str, Any], x: Any) -> Any:
        for i, w in enumerate(params["layers"]):
            x = block(x, w, args, local=args.model == "gemma2" and i % 2 == 0)
        return jnp.mean(rms_norm(x).astype(jnp.float32) ** 2)

    def step(params: dict[str, Any], x: Any) -> tuple[dict[str, Any], Any]:
        value, grads = jax.value_and_grad(loss)(params, x)
        return jax.tree.map(lambda p, g: (p - 1e-3 * g).astype(p.dtype), params, grads), value

    return step


def pinned_table(problems: list[Any], kernel_name: str, default_for: Any) -> Any:
    """A table choosing ``kernel_name`` at ``default_for(kernel, problem)`` for each problem:
    a hand-set choice, as a user pins one (no timing stands behind it)."""
    from kernel.table import KernelChoice, KernelTiming

    chosen = kernel.get_kernel(kernel_name).discover()
    choices = tuple(KernelChoice(p, kernel_name, default_for(chosen, p),
                                 {kernel_name: KernelTiming()}) for p in problems)
    return kernel.LookupTable(kernel_name, chosen.version, jax.devices()[0].device_kind, (),
                              choices=choices)


def variants(args: argparse.Namespace, step: Any, abstract: tuple[Any, ...],
             folder: str) -> tuple[dict[str, Any], list[Any]]:
    """The tables each variant traces under (name -> table), and the problems tuned."""
    import autotune
    from bench.tpu_check import target_here

    with kernel.capture() as captured:
        jax.eval_shape(step, *abstract)
    problems = list(captured)
    tuned = autotune.tune_model(step, *abstract, db=f"sqlite:///{folder}/model.db",
                                trials=args.trials, kernels=args.kernels)
    return {"tuned": tuned,
            MAXTEXT: pinned_table(problems, "splash",
                                  lambda k, p: k.default_config(p, target_here(k))),
            "xla": pinned_table(problems, "xla", lambda k, p: k.default_config(p))}, problems


def compiled_under(table: Any, step: Any, params: Any, x: Any,
                   problems: list[Any]) -> tuple[Any, dict[str, str]]:
    """The step compiled with its attention resolved by ``table``, and what each of its
    ``problems`` ran (the process's other resolutions left out)."""
    with kernel.tables(table):
        executable = jax.jit(step).lower(params, x).compile()
        sources = {f"{name} {problem.label()}": why
                   for (name, _, problem), why in kernel.resolution_sources().items()
                   if problem in problems}
    return executable, sources


def timed_rounds(executables: dict[str, Any], params: Any, x: Any,
                 args: argparse.Namespace) -> dict[str, list[float]]:
    """Per variant, the wall time of ``args.steps`` back-to-back steps (each feeding its
    parameters to the next) over ``args.rounds`` interleaved rounds (ms per step), after one
    untimed warm-up sample each."""
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
    interleaved(timers, 1)  # warms each executable up
    return {name: list(timing.samples_ms) for name, timing in
            interleaved(timers, args.rounds).items()}


def attention_share(executable: Any, params: Any, x: Any, ran: dict[str, str],
                    runs: int = 3) -> float | None:
    """The named attention kernels' part of the step's device time, from one profiler trace
    of ``runs`` steps (None when the kernels that ran name no ``pallas_call``)."""
    from autotune.timing import kernel_op_matcher, op_names, run_times, trace_runs

    names = {name for key in ran for name in kernel.get_kernel(key.split()[0]).profile_names}
    events = trace_runs(lambda: executable(params, x)[1], runs)
    step = run_times(events, runs, kernel_op_matcher(op_names(executable), ()))
    attention = run_times(events, runs, kernel_op_matcher((), names)) if names else None
    if not step or not attention:
        return None
    return statistics.median(attention) / statistics.median(step)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from bench.chip import write_report

    step = make_step(args)
    params = init_params(args, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (args.batch, args.seq, args.d_model),
                          jnp.float32).astype(jnp.bfloat16)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x))
    with tempfile.TemporaryDirectory() as folder:
        tables, problems = variants(args, step, abstract, folder)
    executables, sources = {}, {}
    for name, table in tables.items():
        executables[name], sources[name] = compiled_under(table, step, params, x, problems)
    samples = timed_rounds(executables, params, x, args)
    medians = {name: statistics.median(times) for name, times in samples.items()}
    report = {"model": vars(args) | {"out": None},
              "problems": [p.label() for p in problems],
              "variants": {name: {"median_ms": medians[name], "samples_ms": samples[name],
                                  "over_tuned": medians[name] / medians["tuned"],
                                  "attention_share": attention_share(executables[name], params, x,
                                                                     sources[name]),
                                  "ran": sources[name]} for name in tables},
              "timing": f"host wall time of {args.steps} back-to-back steps, median of "
                        f"{args.rounds} interleaved rounds"}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
