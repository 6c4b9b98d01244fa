"""The trade our flash backward takes (issue 56, goal 2): dS in one bf16 MXU pass, as splash,
against two.

Our dK and dQ kernels multiply the f32 logit gradients dS by Q and K with dS rounded to bf16
(``_ds_dot`` in ``kernel/backends/flash/pallas.py``: 7 MXU passes a block pair over both
kernels, as splash). Two passes (dS's bf16 rounding and its remainder, 9 passes) meet tighter
tolerances. This times, interleaved on the attached device with the tuner's own timing, our
default config and a tuned one each as the kernel runs them and with dS in two passes, against
splash at MaxText's default and with every block at 1024, with each output's error against the
reference.

    python bench/chip/backward_passes.py [--seq 4096] [--rounds 5] [--out F.json]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import jax  # noqa: E402
from jax import lax  # noqa: E402

import kernel.backends.flash.pallas as flash_pallas  # noqa: E402
from autotune.measure import Measurer, interleaved  # noqa: E402
from bench.chip import OUTPUTS, write_report  # noqa: E402
from kernel import Problem, get_kernel  # noqa: E402
from kernel.tolerance import relative_error  # noqa: E402

# The tuned config the chip published for s4096 causal fwd_bwd (bench/results/tpu-v5e-2026-12-05).
TUNED = dict(block_q=1024, block_kv=256, block_kv_compute=256, pipeline_depth=4,
             block_q_dkv=1024, block_kv_dkv=1024, pipeline_depth_dkv=2, block_q_dq=256,
             block_kv_dq=512, pipeline_depth_dq=2)


def two_pass_dot(x: jax.Array, y: jax.Array, dims: Any = (((1,), (0,)), ((), ()))) -> jax.Array:
    """``x @ y`` for an f32 ``x`` and a bf16 ``y`` as two bf16 MXU passes: ``x``'s bf16
    rounding and its remainder (16 mantissa bits of ``x`` instead of 8)."""
    def dot(a: jax.Array) -> jax.Array:
        return lax.dot_general(a, y, dims, preferred_element_type=jax.numpy.float32)

    high = x.astype(y.dtype)
    return dot(high) + dot((x - high.astype(jax.numpy.float32)).astype(y.dtype))


@contextmanager
def two_passes() -> Iterator[None]:
    one_pass, flash_pallas._ds_dot = flash_pallas._ds_dot, two_pass_dot
    try:
        yield
    finally:
        flash_pallas._ds_dot = one_pass


def traced_under(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, whose kernels are traced (at compile) with dS in two passes."""
    def run(*args: Any) -> Any:
        with two_passes():
            return fn(*args)
    return run


def output_errors(got: Any, want: Any) -> dict[str, float]:
    """Each output's relative error (out, dq, dk, dv as the program returns them)."""
    return dict(zip(OUTPUTS[-len(jax.tree.leaves(want)):], map(
        relative_error, jax.tree.leaves(got), jax.tree.leaves(want)), strict=True))


def candidates(problem: Problem) -> dict[str, tuple[str, Any, bool]]:
    """name: (kernel, config, dS in two passes)."""
    flash, splash = get_kernel("flash"), get_kernel("splash")
    default = flash.default_config(problem, "v5e")
    tuned = default.replace(**TUNED)
    every_1024 = splash.default_config(problem, "v5e").replace(**{
        name: 1024 for name in ("block_q", "block_kv", "block_kv_compute", "block_q_dkv",
                                "block_kv_dkv", "block_kv_dkv_compute", "block_q_dq",
                                "block_kv_dq")})
    return {"flash default": ("flash", default, False),
            "flash default, dS two passes": ("flash", default, True),
            "flash tuned": ("flash", tuned, False),
            "flash tuned, dS two passes": ("flash", tuned, True),
            "splash MaxText default": ("splash", splash.default_config(problem, "v5e"), False),
            "splash every block 1024": ("splash", every_1024, False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    problem = Problem(batch=args.batch, q_heads=16, kv_heads=16, q_len=args.seq,
                      kv_len=args.seq, head_dim=128, dtype="bfloat16", causal=True,
                      mode="fwd_bwd")
    flash = get_kernel("flash")
    # One measurer: its inputs, reference (XLA's attention) and timing serve every candidate.
    measurer = Measurer(problem, flash.default_config(problem, "v5e"), flash, pool_size=1)
    rows, timers = {}, {}
    try:
        for name, (kernel_name, config, two) in candidates(problem).items():
            kernel = get_kernel(kernel_name)
            try:
                fn = kernel.build(problem, config)
                program = measurer.compile(traced_under(fn) if two else fn,
                                           kernel.profile_names)
                errors = output_errors(measurer.run(program), measurer.expected)
            except Exception as failure:  # noqa: BLE001 - a config that fails is a row too
                rows[name] = {"error": str(failure).splitlines()[0]}
                continue
            rows[name] = {"max_error": max(errors.values()), "errors": errors,
                          "timing": measurer.timing}
            timers[name] = measurer.timer(program)
        for name, timing in interleaved(timers, args.rounds).items():
            rows[name]["median_ms"] = round(timing.median_ms, 3)
            rows[name]["iqr_ms"] = round(timing.iqr_ms, 3)
    finally:
        measurer.close()
    best_splash = min((r["median_ms"] for n, r in rows.items()
                       if n.startswith("splash") and "median_ms" in r), default=None)
    for row in rows.values():
        if best_splash and "median_ms" in row:
            row["vs_best_splash"] = round(row["median_ms"] / best_splash, 3)
    write_report({"problem": problem.label(), "rounds": args.rounds, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
