"""Issue 73 item 5 on the attached chip: a small Llama-style decode loop over a paged KV cache,
attention through ``kernel.ragged_paged_attention``, its tokens per second under (a) a tuned
table (``--table``, e.g. ``autotune export --kernel rpa``), (b) JAX's own block sizes (its
shipped ``TUNED_BLOCK_SIZES`` entry, else its fallback; where they overflow the scoped VMEM,
also ``jax_vmem``: them under a raised limit, as a serving stack passing ``vmem_limit_bytes``
runs them) and (c) the rpa backend's default,
timed in interleaved rounds, each contender's attention first checked against the float32
reference on the loop's own cache.

The loop: ``--layers`` pre-norm layers (attention with grouped K/V heads, an MLP; no rotary
embedding, no vocabulary: a layer's output is the next token's input), one new token per
sequence per step, its K and V written into the sequence's page before the layer attends;
``--steps`` steps per timed call, from ``--context`` cached tokens per sequence. The serving
problem (the table's key) is the model's heads, head_dim 128, ``--page-size``,
``--max-model-len``, ``--tokens`` (the step's token budget) and ``--seqs``. A contender whose
config the chip's rules refuse (JAX's fallback over a v5e's VMEM) is reported as refused, with
why, and not run: a server would fail to compile it.

``--write-shapes FILE`` writes the serving problems of ``--models`` x ``--seqs`` (a shapes file
for ``autotune tune --kernel rpa --shapes FILE``) and exits: the keys a tuned table needs.
``--interpret`` runs the loop's skeleton on a CPU with tiny shapes, every contender's attention
the float32 reference (the kernel runs on a TPU only), no device figures::

    python bench/chip/serve_step.py --model llama3-8b --seqs 64 --table t.json --out s.json
    python bench/chip/serve_step.py --write-shapes serving.yaml --models llama3-8b --seqs 32,256
    python bench/chip/serve_step.py --interpret --out /tmp/serve-step.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402

import kernel  # noqa: E402
from bench.chip import write_report  # noqa: E402
from bench.chip.timing import spread  # noqa: E402
from kernel import ConfigError, ServingProblem, device_target  # noqa: E402
from kernel.backends.rpa import paged_reference  # noqa: E402
from kernel.registry import SERVING_KERNELS  # noqa: E402
from kernel.tolerance import relative_error  # noqa: E402

# Issue 73's grid models the kernel compiles (head_dim 128; Gemma-2's 256 does not): per-chip
# (q heads, kv heads, sliding window).
MODELS = {"llama3-8b": (32, 8, None), "llama3-70b-tp8": (8, 1, None),
          "qwen2-7b": (28, 4, None), "mistral-7b": (32, 8, 4096)}
HEAD_DIM = 128
TINY = dict(q_heads=4, kv_heads=2, window=None, seqs=4, page_size=4, max_model_len=32,
            tokens=8, context=8, steps=2, layers=1, rounds=2)
Attend = Callable[..., Any]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="llama3-8b")
    parser.add_argument("--models", default="llama3-8b", help="--write-shapes: comma-separated")
    parser.add_argument("--seqs", default="64", help="sequences a step (--write-shapes: a list)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=512, help="the step's token budget")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens at the start")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed call")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--table", type=Path, help="a tuned table of rpa configs")
    parser.add_argument("--write-shapes", type=Path, metavar="FILE")
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not args.interpret and args.context + args.steps > args.max_model_len:
        parser.error(f"--context {args.context} + --steps {args.steps} passes --max-model-len "
                     f"{args.max_model_len}")
    return args


def serving_problem(q_heads: int, kv_heads: int, window: int | None, seqs: int,
                    args: argparse.Namespace) -> ServingProblem:
    return ServingProblem(q_heads, kv_heads, HEAD_DIM, args.page_size,
                          args.max_model_len // args.page_size, args.tokens, seqs,
                          window=window)


def write_shapes(args: argparse.Namespace) -> None:
    """The serving problems of ``--models`` x ``--seqs``, as a shapes file."""
    problems = [serving_problem(*MODELS[model], int(seqs), args).to_dict()
                for model in args.models.split(",") for seqs in args.seqs.split(",")]
    args.write_shapes.write_text(yaml.safe_dump(problems, sort_keys=False))
    print(f"{len(problems)} serving problems -> {args.write_shapes}")


def init(problem: ServingProblem, layers: int, context: int, seed: int = 0) -> tuple:
    """Random bf16 weights (attention and an MLP per layer), the paged cache of each layer
    filled to ``context`` tokens per sequence (its pages shuffled over the cache), and the
    first tokens: ``(params, state, page_indices)``."""
    seqs, width = problem.max_num_seqs, problem.q_heads * HEAD_DIM
    keys = iter(jax.random.split(jax.random.key(seed), 6 * layers + 1))

    def weight(*shape: int) -> jax.Array:
        return (jax.random.normal(next(keys), shape) * shape[0] ** -0.5).astype(jnp.bfloat16)

    params = [dict(wq=weight(width, width), wkv=weight(width, 2 * problem.kv_heads * HEAD_DIM),
                   wo=weight(width, width), up=weight(width, 2 * width),
                   down=weight(2 * width, width)) for _ in range(layers)]
    pages = seqs * problem.pages_per_seq
    caches = [jax.random.normal(next(keys), (pages, problem.page_size, 2 * problem.kv_heads,
                                             HEAD_DIM), jnp.bfloat16) for _ in range(layers)]
    page_indices = np.random.default_rng(seed).permutation(pages).astype(np.int32)
    x = jax.random.normal(next(keys), (seqs, width), jnp.bfloat16)
    state = (x, caches, jnp.full((seqs,), context, jnp.int32))
    return params, state, jnp.asarray(page_indices.reshape(seqs, -1))


def _norm(x: jax.Array) -> jax.Array:
    wide = x.astype(jnp.float32)
    return (wide * jax.lax.rsqrt(jnp.mean(wide * wide, -1, keepdims=True) + 1e-6)).astype(x.dtype)


def decode_steps(problem: ServingProblem, attend: Attend, steps: int) -> Callable:
    """``(params, state, page_indices) -> state`` after ``steps`` decode steps, each
    sequence's new K and V written at its position before its layer attends."""
    seqs, page = problem.max_num_seqs, problem.page_size
    cu_q_lens = jnp.arange(seqs + 1, dtype=jnp.int32)
    num_seqs = jnp.asarray([seqs], jnp.int32)

    def step(params: list, page_indices: jax.Array, state: tuple) -> tuple:
        x, caches, kv_lens = state
        slots = page_indices[jnp.arange(seqs), kv_lens // page], kv_lens % page
        out = []
        for layer, cache in zip(params, caches, strict=True):
            h = _norm(x)
            q = (h @ layer["wq"]).reshape(seqs, problem.q_heads, HEAD_DIM)
            cache = cache.at[slots].set((h @ layer["wkv"]).reshape(seqs, -1, HEAD_DIM))
            queries = jnp.zeros((problem.max_num_batched_tokens, *q.shape[1:]), q.dtype)
            o = attend(queries.at[:seqs].set(q), cache, kv_lens + 1, page_indices, cu_q_lens,
                       num_seqs)[:seqs].astype(x.dtype)
            x = x + o.reshape(seqs, -1) @ layer["wo"]
            x = x + jax.nn.gelu(_norm(x) @ layer["up"]) @ layer["down"]
            out.append(cache)
        return x, out, kv_lens + 1

    def run(params: list, state: tuple, page_indices: jax.Array) -> tuple:
        return jax.lax.fori_loop(0, steps, lambda _, s: step(params, page_indices, s), state)

    return run


def contenders(problem: ServingProblem, args: argparse.Namespace) -> dict[str, Any]:
    """Name -> (attend, config label, how it resolves) or the reason it does not run here."""
    backend = SERVING_KERNELS["rpa"].discover()
    device = jax.devices()[0]
    target = device_target(device.platform, device.device_kind)
    configs = {**backend.baselines(problem, target),
               "default": backend.default_config(problem, target)}
    if args.interpret:  # the kernel runs on a TPU only: each runs the reference
        reference = paged_reference(problem, 1)
        out = {name: (reference, config.label(), "reference (CPU)")
               for name, config in configs.items()}
        return ({"tuned": (reference, None, "reference (CPU)")} if args.table else {}) | out
    out: dict[str, Any] = {"tuned": (_wrapper(problem, None), None, "table")} if args.table else {}
    for name, config in configs.items():
        try:
            backend.check(problem, config, target)
            out[name] = (_wrapper(problem, config), config.label(), "explicit config")
        except ConfigError as error:
            out[name] = f"refused: {error}"
    return out


def _wrapper(problem: ServingProblem, config: Any) -> Attend:
    return lambda *inputs: kernel.ragged_paged_attention(
        *inputs, sliding_window=problem.window, config=config)


def compiled(problem: ServingProblem, run: Callable, params: list, state: tuple,
             page_indices: jax.Array, table: Path | None) -> tuple[Any, str | None]:
    """``run`` compiled, its state donated, and how the wrapper resolved the problem's block
    sizes inside ``kernel.tables(table)`` (None without a table)."""
    lowered = jax.jit(run, donate_argnums=1)
    if table is None:
        return lowered.lower(params, state, page_indices).compile(), None
    with kernel.tables(table):
        program = lowered.lower(params, state, page_indices).compile()
        key = ("rpa", jax.devices()[0].device_kind, problem)
        return program, kernel.resolution_sources().get(key)


def attention_error(problem: ServingProblem, attend: Attend, state: tuple,
                    page_indices: jax.Array, table: Path | None) -> float:
    """The contender's attention against the float32 reference on the loop's first layer's
    cache, one decode query per sequence."""
    seqs = problem.max_num_seqs
    q = jax.random.normal(jax.random.key(1), (problem.max_num_batched_tokens,
                                             problem.q_heads, HEAD_DIM), jnp.bfloat16)
    inputs = (q, state[1][0], state[2], page_indices, jnp.arange(seqs + 1, dtype=jnp.int32),
              jnp.asarray([seqs], jnp.int32))
    want = jax.jit(paged_reference(problem, 1))(*inputs)
    if table is None:
        got = jax.jit(attend)(*inputs)
    else:
        with kernel.tables(table):
            got = jax.jit(attend)(*inputs)
    return relative_error(got[:seqs], want[:seqs])


def measure(problem: ServingProblem, args: argparse.Namespace) -> dict[str, Any]:
    """Every contender's tokens per second over interleaved rounds, its error and config."""
    params, state, page_indices = init(problem, args.layers, args.context)
    runs, rows = {}, {}
    for name, contender in contenders(problem, args).items():
        if isinstance(contender, str):
            rows[name] = {"refused": contender}
            continue
        attend, label, how = contender
        table = args.table if name == "tuned" and not args.interpret else None
        run = decode_steps(problem, attend, args.steps)
        runs[name], resolution = compiled(problem, run, params, state, page_indices, table)
        rows[name] = {"config": label, "resolved": resolution or how,
                      "error": attention_error(problem, attend, state, page_indices, table)}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, program in runs.items():
            fresh = jax.tree.map(jnp.copy, state)  # the loop donates its state
            jax.block_until_ready(fresh)
            start = time.perf_counter()
            final = jax.block_until_ready(program(params, fresh, page_indices))
            seconds[name].append(time.perf_counter() - start)
    tokens = problem.max_num_seqs * args.steps
    for name, times in seconds.items():
        rows[name] |= {"median_s": statistics.median(times), "spread": spread(times),
                       "tokens_per_s": tokens / statistics.median(times)}
    if runs:
        assert int(final[2][0]) == args.context + args.steps  # the loop ran every step
    return {"problem": problem.to_dict(), "label": problem.label(), "contenders": rows,
            "ratios": ratios(rows)}


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """tokens/s of the tuned table over each other contender's (None where either did not
    run)."""
    def over(name: str) -> float | None:
        fast, slow = (rows.get(key, {}).get("tokens_per_s") for key in ("tuned", name))
        return fast / slow if fast and slow else None

    return {f"tuned_over_{name}": over(name) for name in rows if name != "tuned"}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.write_shapes:
        write_shapes(args)
        return None
    if args.interpret:
        jax.config.update("jax_platforms", "cpu")
        shape = ("q_heads", "kv_heads", "window", "seqs")
        args = argparse.Namespace(**{**vars(args), **{key: value for key, value in TINY.items()
                                                      if key not in shape}})
        problem = serving_problem(*(TINY[key] for key in shape), args)
    else:
        problem = serving_problem(*MODELS[args.model], int(args.seqs), args)
    report = {"model": "tiny" if args.interpret else args.model,
              "interpret": args.interpret, "layers": args.layers, "steps": args.steps,
              "context": args.context, "table": str(args.table) if args.table else None,
              **measure(problem, args)}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
