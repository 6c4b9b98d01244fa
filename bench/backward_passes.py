"""Measure before building (issue 56, goal 2): what our flash backward would gain from one
bf16 MXU pass for its dS products instead of two.

Our dK and dQ kernels multiply the f32 logit gradients dS by Q and K as two bf16 passes (dS's
bf16 rounding and its remainder, ``_dot_f32`` in ``kernel/backends/flash/pallas.py``): 9 MXU
passes a block pair over both kernels, where splash takes 7 (dS rounded to bf16 once). This
times, interleaved on the attached device with the tuner's own timing, our default config and
a tuned one each as they are and with dS in one pass, against splash at MaxText's default and
with every block at 1024, and checks each one's error against the reference.

    python bench/backward_passes.py [--seq 4096] [--rounds 5] [--out F.json]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

import jax  # noqa: E402
from jax import lax  # noqa: E402

import kernel.backends.flash.pallas as flash_pallas  # noqa: E402
from autotune.measure import Measurer, interleaved, relative_error  # noqa: E402
from bench.chip import write_report  # noqa: E402
from kernel import Problem, get_kernel  # noqa: E402

# The tuned config the chip published for s4096 causal fwd_bwd (bench/results/tpu-v5e-2026-12-05).
TUNED = dict(block_q=1024, block_kv=256, block_kv_compute=256, pipeline_depth=4,
             block_q_dkv=1024, block_kv_dkv=1024, pipeline_depth_dkv=2, block_q_dq=256,
             block_kv_dq=512, pipeline_depth_dq=2)


def one_pass_dot(x: jax.Array, y: jax.Array, dims: Any = (((1,), (0,)), ((), ()))) -> jax.Array:
    """``x @ y`` with ``x`` rounded to ``y``'s dtype: one MXU pass, as splash's dS products."""
    return lax.dot_general(x.astype(y.dtype), y, dims, preferred_element_type=jax.numpy.float32)


@contextmanager
def one_pass() -> Iterator[None]:
    two_pass, flash_pallas._dot_f32 = flash_pallas._dot_f32, one_pass_dot
    try:
        yield
    finally:
        flash_pallas._dot_f32 = two_pass


def traced_under(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, whose kernels are traced (at compile) with dS in one pass."""
    def run(*args: Any) -> Any:
        with one_pass():
            return fn(*args)
    return run


def candidates(problem: Problem) -> dict[str, tuple[str, Any, bool]]:
    """name: (kernel, config, dS in one pass)."""
    flash, splash = get_kernel("flash"), get_kernel("splash")
    default = flash.default_config(problem, "v5e")
    tuned = default.replace(**TUNED)
    every_1024 = splash.default_config(problem, "v5e").replace(**{
        name: 1024 for name in ("block_q", "block_kv", "block_kv_compute", "block_q_dkv",
                                "block_kv_dkv", "block_kv_dkv_compute", "block_q_dq",
                                "block_kv_dq")})
    return {"flash default": ("flash", default, False),
            "flash default, dS one pass": ("flash", default, True),
            "flash tuned": ("flash", tuned, False),
            "flash tuned, dS one pass": ("flash", tuned, True),
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
        for name, (kernel_name, config, single) in candidates(problem).items():
            kernel = get_kernel(kernel_name)
            try:
                fn = kernel.build(problem, config)
                program = measurer.compile(traced_under(fn) if single else fn,
                                           kernel.profile_names)
                error = relative_error(measurer.run(program), measurer.expected)
            except Exception as failure:  # noqa: BLE001 - a config that fails is a row too
                rows[name] = {"error": str(failure).splitlines()[0]}
                continue
            rows[name] = {"max_error": error, "timing": measurer.timing}
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
