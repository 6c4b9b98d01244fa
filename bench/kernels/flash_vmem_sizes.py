"""Each flash kernel's scoped VMEM allocation alone, per block shape, against its estimate.

``vmem_sizes.py`` measures whole configs, so a kernel smaller than another of its gradient
program goes unreported. Here each point varies one kernel's fields (forward, dK/dV or dQ) and
leaves the other kernels at 128-blocks, so the allocation the rising limit reaches last is that
kernel's (``vmem_sizes.allocations``; the forward is compiled alone, as the tuner's forward
variants are). Batch 1, one head, causal, ``--seq-len`` tokens; the points: ``GRID``.

    python bench/kernels/flash_vmem_sizes.py --dtype float32 --head-dims 64 128 256 \\
        --out bench/kernels/data/flash_vmem/v5e_float32.jsonl
    python bench/kernels/flash_vmem_sizes.py --rescore bench/kernels/data/flash_vmem/*.jsonl

Prints per point the allocation, the estimate (``kernel.backends.flash.rules.vmem_estimate``)
and their ratio; ``--rescore`` compiles nothing and exits 1 if an estimate falls below its
allocation. Issue 74: the float32 points behind ``F32_HIGHEST_TILES`` in rules.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from autotune.precheck import Candidate
from kernel import FlashConfig, Problem, get_kernel
from kernel.backends.flash.rules import vmem_estimate
from kernel.targets import MiB

sys.path.insert(0, str(Path(__file__).parent))
from vmem_sizes import allocations  # noqa: E402

# (kernel, fields) measured per head dim: the forward's query block, kv block and compute
# block, dK/dV's and dQ's query and kv blocks; depth 2 unless given.
GRID: list[tuple[str, dict[str, int]]] = [
    *(("fwd", {"block_q": q, "block_kv": max(c, 512), "block_kv_compute": c})
      for q in (512, 1024, 2048) for c in (128, 256, 512, 1024)),
    ("fwd", {"block_q": 1024, "block_kv": 2048, "block_kv_compute": 256, "pipeline_depth": 3}),
    *(("dkv", {"block_q_dkv": q, "block_kv_dkv": kv})
      for q, kv in ((512, 128), (512, 512), (512, 1024), (1024, 256), (1024, 1024),
                    (2048, 128), (2048, 256), (2048, 512), (4096, 128), (4096, 256))),
    ("dkv", {"block_q_dkv": 2048, "block_kv_dkv": 256, "pipeline_depth_dkv": 1}),
    ("dkv", {"block_q_dkv": 1024, "block_kv_dkv": 512, "pipeline_depth_dkv": 3}),
    *(("dq", {"block_q_dq": q, "block_kv_dq": kv})
      for q, kv in ((128, 512), (512, 128), (512, 512), (512, 1024), (1024, 256), (1024, 1024),
                    (2048, 128), (2048, 256), (2048, 512), (4096, 128))),
    ("dq", {"block_q_dq": 1024, "block_kv_dq": 512, "pipeline_depth_dq": 3}),
]
NAMES = {"fwd": "flash_fwd", "dkv": "flash_bwd_dkv", "dq": "flash_bwd_dq"}


def point(row: dict) -> tuple[Problem, FlashConfig]:
    """The problem and config a saved row measured."""
    prob = Problem(1, 1, 1, row["seq_len"], row["seq_len"], row["head_dim"], row["dtype"], True,
                   "fwd_bwd")
    return prob, FlashConfig.from_dict(row["config"])


def allocated(row: dict) -> int | None:
    """The row's kernel's allocation, or None if another kernel of its program was larger."""
    return next((size for name, size in row["allocations"].items()
                 if name.split(".")[0] == NAMES[row["kernel"]]), None)


def show(row: dict) -> float | None:
    """Prints the row against the current estimate; returns estimate / allocation."""
    prob, config = point(row)
    estimate, size = vmem_estimate(prob, config)[row["kernel"]], allocated(row)
    fields = " ".join(f"{k}={v}" for k, v in row["fields"].items())
    if size is None:
        print(f"{row['dtype']} d{row['head_dim']} {row['kernel']} {fields}: below the others "
              f"{row['allocations']}")
        return None
    print(f"{row['dtype']} d{row['head_dim']} {row['kernel']} {fields}: {size / MiB:.2f} MiB, "
          f"estimate {estimate / MiB:.2f} ({estimate / size:.2f}x)", flush=True)
    return estimate / size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5e")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--kernels", nargs="+", default=list(NAMES))
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--out", type=Path, help="append every measurement here (JSON lines)")
    parser.add_argument("--rescore", type=Path, nargs="+",
                        help="judge the estimate against these saved measurements; no compiles")
    args = parser.parse_args()

    if args.rescore:
        ratios: dict[str, list[float]] = {}
        for row in (json.loads(line) for path in args.rescore
                    for line in path.read_text().splitlines()):
            if (ratio := show(row)) is not None:
                ratios.setdefault(row["kernel"], []).append(ratio)
        for kernel, values in ratios.items():
            print(f"{kernel}: {len(values)} points, estimate / allocation {min(values):.2f} to "
                  f"{max(values):.2f}, median {statistics.median(values):.2f}")
        sys.exit(min(min(values) for values in ratios.values()) < 1)
    flash = get_kernel("flash").discover()
    for head_dim in args.head_dims:
        for kernel, fields in GRID:
            if kernel not in args.kernels:
                continue
            prob = Problem(1, 1, 1, args.seq_len, args.seq_len, head_dim, args.dtype, True,
                           "fwd_bwd")
            config = FlashConfig(**fields)
            sizes = allocations(flash, prob, Candidate(config, True, kernel == "fwd"),
                                args.target)
            row = {"target": args.target, "seq_len": args.seq_len, "head_dim": head_dim,
                   "dtype": args.dtype, "kernel": kernel, "fields": fields,
                   "config": config.to_dict(), "allocations": sizes}
            show(row)
            if args.out:
                with args.out.open("a") as out:
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
