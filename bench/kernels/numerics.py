"""Numerical error of every registered kernel against float64, next to plain XLA's.

Per kernel, dtype, masking and input magnitude (q scaled by x1e-3, x1, x100, x1e4, so the
logits span nearly uniform to nearly one-hot softmax), the error of the output and of each
gradient of ``sum(output)`` (what the tuner measures), relative to the float64 truth's largest
magnitude (``kernel.tolerance.relative_error``), computed on the same rounded inputs. The XLA
columns are ``jax.nn.dot_product_attention`` in the same dtype (``TunableKernel.reference``).
Each kernel runs its default config; off its platform, in interpret mode.

    python bench/kernels/numerics.py [--kernels flash jax_tpu_flash] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from kernel import Problem, get_kernel, kernel_names
from kernel.contract import input_specs
from kernel.tolerance import float64_attention, relative_error

MAGNITUDES = (1e-3, 1.0, 1e2, 1e4)
OUTPUTS = ("out", "dq", "dk", "dv")
SHAPE = {"batch": 1, "q_heads": 4, "kv_heads": 2, "q_len": 256, "kv_len": 256, "head_dim": 64}


def _measured(kernel, problem: Problem):
    """(output fn, gradients fn) of ``kernel`` with its default config, and XLA's."""
    fwd, fwd_bwd = (Problem(**{**problem.to_dict(), "mode": m}) for m in ("fwd", "fwd_bwd"))
    config = kernel.default_config(fwd_bwd)
    return ((jax.jit(kernel.build(fwd, config)), jax.jit(kernel.build(fwd_bwd, config))),
            (jax.jit(kernel.reference(fwd)), jax.jit(kernel.reference(fwd_bwd))))


def _errors(fns, inputs, truth) -> list[float]:
    out_fn, grads_fn = fns
    return [relative_error(got, want)
            for got, want in zip((out_fn(*inputs), *grads_fn(*inputs)), truth, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="+", default=kernel_names())
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    header = ["kernel", "dtype", "mask", "q x"] + list(OUTPUTS) + [f"XLA {o}" for o in OUTPUTS]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    keys = jax.random.split(jax.random.key(0), 3)
    for name in args.kernels:
        kernel = get_kernel(name)
        if "cpu" not in kernel.targets:  # nothing to interpret it with here
            print(f"| {name} | skipped: runs only on {', '.join(kernel.targets)} |")
            continue
        for dtype in args.dtypes:
            for causal in (False, True):
                problem = Problem(**SHAPE, dtype=dtype, causal=causal)
                if broken := kernel.problem_violations(problem):
                    print(f"| {name} | {dtype} | skipped: {broken[0]} |")
                    continue
                ours, xla = _measured(kernel, problem)
                base = [jax.random.normal(key, spec.shape, jnp.float32)
                        for key, spec in zip(keys, input_specs(problem), strict=True)]
                for magnitude in MAGNITUDES:
                    inputs = [(x * magnitude if i == 0 else x).astype(dtype)
                              for i, x in enumerate(base)]
                    truth = float64_attention(*inputs, jnp.ones_like(inputs[0]), causal=causal,
                                              sm_scale=problem.head_dim ** -0.5)
                    cells = _errors(ours, inputs, truth) + _errors(xla, inputs, truth)
                    print(f"| {name} | {dtype} | {'causal' if causal else 'full'} | "
                          f"{magnitude:g} | " + " | ".join(f"{e:.1e}" for e in cells) + " |",
                          flush=True)


if __name__ == "__main__":
    main()
