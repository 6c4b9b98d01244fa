"""Deviceless v5e compiles of flash's default config at sequence lengths off the lane tile
(128): every pair of lengths below by causal or full, plain, window, soft cap or packed
segments, bf16 and f32, forward and backward. Prints each failure and the count compiled.

    python bench/kernels/unaligned_compile.py

Mosaic rejects a DMA at a lane offset it cannot prove a multiple of 128, which interpret mode
does not check: on a TPU v5e a causal 200-token problem failed to compile (fixed in 27135b0;
38 of these 80 compiled before it, 80 after)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

import kernel
from kernel import Problem
from kernel.aot import topology_device
from kernel.contract import input_specs

LENGTHS = [(200, 200), (200, 384), (384, 200), (1000, 1000), (136, 520)]
FEATURES = {"plain": {}, "window": {"window": (64, 64)}, "softcap": {"logits_soft_cap": 30.0},
            "segments": {"segmented": True}}


def compiles(problem: Problem, features: dict) -> str | None:
    """None if the default config's forward and backward compile for v5e, else the error."""
    config = kernel.get_kernel("flash").default_config(problem, "v5e")
    features = {k: v for k, v in features.items() if k != "segmented"}

    def loss(q, k, v, *ids):
        out = kernel.flash_attention(q, k, v, causal=problem.causal, config=config,
                                     segment_ids=ids or None, alignment=problem.alignment,
                                     **features)
        return out.astype(jnp.float32).sum()

    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
            *input_specs(problem, topology_device("v5e"))).lower().compile()
    except Exception as error:  # noqa: BLE001 - each failure is a result
        return str(error).splitlines()[0]
    return None


def main() -> None:
    total = failed = 0
    for (q_len, kv_len), causal, (name, features), dtype in itertools.product(
            LENGTHS, (True, False), FEATURES.items(), ("bfloat16", "float32")):
        window = features.get("window")
        problem = Problem(batch=1, q_heads=4, kv_heads=2, q_len=q_len, kv_len=kv_len,
                          head_dim=128, dtype=dtype, causal=causal, mode="fwd_bwd",
                          window=(window[0], 0) if window and causal else window,
                          softcap=features.get("logits_soft_cap"),
                          segmented=features.get("segmented", False))
        features = {**features, "window": problem.window} if window else features
        total += 1
        if error := compiles(problem, features):
            failed += 1
            print(f"FAIL {problem.label()} ({name}): {error[:160]}")
    print(f"compiled {total - failed} of {total}")


if __name__ == "__main__":
    main()
