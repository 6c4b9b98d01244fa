"""The work a local (sliding-window) layer saves: blocks computed by our flash kernel and by
splash, with a causal window of 512 at sequence 8192 against the same kernel causal without a
window, at each kernel's default config, per kernel of the gradient (fwd, dq, dkv).

Counts, not times: our kernel's come from the predicate its kernels skip blocks with
(``kernel.backends.flash.blocks``); splash's from the block mask upstream's ``MaskInfo`` gives
its kernels (a block is computed unless it is wholly masked). On a CPU no times are taken.

    PYTHONPATH=$PWD python bench/kernels/window.py [--seq 8192] [--window 512] [--out window.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from kernel import get_kernel
from kernel.backends.flash.blocks import block_counts
from kernel.problem import Problem

KERNELS = ("fwd", "dq", "dkv")


def splash_computed_blocks(problem: Problem, target: str) -> dict[str, int]:
    """Blocks splash computes per kernel at its default config: the blocks its ``MaskInfo``
    does not mark empty, for one head's mask (``LocalMask`` for a window, as splash runs
    one; else the backend's own mask), times batch and query heads."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask_info as mask_info,
    )

    from kernel.backends.splash import splash_mask

    config = get_kernel("splash").default_config(problem, target)
    shape = (problem.q_len, problem.kv_len)
    head = (masks.LocalMask(shape, problem.window, offset=0) if problem.window
            else splash_mask(dataclasses.replace(problem, q_heads=1, kv_heads=1)).masks[0])
    one_head = masks.MultiHeadMask([head])
    blocks = {"fwd": (mask_info.process_mask, config.block_q, config.block_kv),
              "dq": (mask_info.process_mask, config.block_q_dq, config.block_kv_dq),
              "dkv": (mask_info.process_mask_dkv, config.block_q_dkv, config.block_kv_dkv)}
    out = {}
    for name, (process, rows, cols) in blocks.items():
        if rows is None:  # a fused backward: no separate dq kernel
            continue
        info, _ = process(one_head, (rows, cols))
        out[name] = problem.batch * problem.q_heads * int(np.count_nonzero(info.block_mask))
    return out


def flash_computed_blocks(problem: Problem, target: str) -> dict[str, int]:
    """Blocks our flash kernel computes per kernel at its default config (the forward in
    compute sub-blocks of ``block_kv_compute`` keys)."""
    config = get_kernel("flash").default_config(problem, target)
    return {name: counts["computed"] for name, counts in block_counts(problem, config).items()}


def compare(seq: int, window: int, target: str) -> list[dict]:
    """One row per kernel and pass: blocks computed causal, with the window, and the ratio."""
    causal = Problem(batch=1, q_heads=8, kv_heads=8, q_len=seq, kv_len=seq, head_dim=128,
                     dtype="bfloat16", causal=True, mode="fwd_bwd")
    local = dataclasses.replace(causal, window=(window, 0))
    rows = []
    for kernel, count in (("flash", flash_computed_blocks), ("splash", splash_computed_blocks)):
        config = get_kernel(kernel).default_config(causal, target)
        full, windowed = count(causal, target), count(local, target)
        for name in KERNELS:
            if name in full:
                rows.append({"kernel": kernel, "pass": name, "config": config.label(),
                             "causal": full[name], "window": windowed[name],
                             "fraction": round(windowed[name] / full[name], 4)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--window", type=int, default=512, help="keys left of each query")
    parser.add_argument("--target", default="v5e", help="the TPU the default configs are for")
    parser.add_argument("--out", type=Path, default=Path("window.json"))
    args = parser.parse_args()
    rows = compare(args.seq, args.window, args.target)
    result = {"problem": f"b1 h8/8 q{args.seq} kv{args.seq} d128 bfloat16 causal fwd_bwd",
              "window": [args.window, 0], "target": args.target,
              "times": "none: blocks counted on a CPU, no kernel timed", "rows": rows}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['problem']}, window ({args.window}, 0), default configs for "
          f"{args.target}; computed blocks (no times: counted on a CPU)")
    print(f"{'kernel':8} {'pass':5} {'causal':>8} {'window':>8} {'fraction':>9}  config")
    for row in rows:
        print(f"{row['kernel']:8} {row['pass']:5} {row['causal']:8d} {row['window']:8d} "
              f"{row['fraction']:9.4f}  {row['config']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
