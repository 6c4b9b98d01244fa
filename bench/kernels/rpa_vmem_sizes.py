"""The rpa kernel's peak scoped VMEM on a deviceless TPU (libtpu, no chip), per config: compiled
under a 1 KiB scoped limit, raised past each allocation the compiler reports
(``CompileTimeScopedVmemOom``) until it compiles; the last reported size is its peak. The
points calibrate ``kernel.backends.rpa.vmem_estimate`` (docs/serving.md).

    python bench/kernels/rpa_vmem_sizes.py --target v5e > bench/kernels/data/rpa_vmem/v5e.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernel.aot import compile_for_target  # noqa: E402
from kernel.backends.rpa import RpaConfig, vmem_estimate  # noqa: E402
from kernel.registry import SERVING_KERNELS  # noqa: E402
from kernel.serving import ServingProblem  # noqa: E402

LIMIT_STEP_KIB = 16
PROBLEMS = [
    ServingProblem(32, 8, 128, 16, 128, 512, 64),  # Llama-3-8B, page 16
    ServingProblem(32, 8, 128, 64, 32, 2048, 64),  # Llama-3-8B, page 64
    ServingProblem(8, 1, 128, 32, 64, 512, 64),  # Llama-3-70B at TP 8
    ServingProblem(28, 4, 128, 16, 128, 512, 64),  # Qwen2-7B
    ServingProblem(16, 8, 256, 16, 128, 512, 64, window=4096, softcap=50.0),  # Gemma-2-9B local
]
BLOCKS = [(4, 32), (8, 16), (8, 32), (8, 64), (8, 128), (16, 32), (32, 32), (64, 32), (16, 128)]


def peak_bytes(problem: ServingProblem, config: RpaConfig, target: str) -> int:
    """The largest scoped allocation the compiler reports on the way to a compile."""
    limit_kib, size = 1, 0
    while True:
        try:
            compile_for_target(SERVING_KERNELS["rpa"], problem, config, target,
                               {"xla_tpu_scoped_vmem_limit_kib": limit_kib})
            return size
        except Exception as error:  # noqa: BLE001 - the compiler's OOM names the allocation
            found = re.search(r"size ([0-9.]+)([KMG])", str(error))
            if found is None:
                raise
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[found.group(2)]
            size = max(size, int(float(found.group(1)) * scale))
            limit_kib = size // 1024 + LIMIT_STEP_KIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5e")
    args = parser.parse_args()
    for problem in PROBLEMS:
        for pages, queries in BLOCKS:
            if pages > problem.pages_per_seq:
                continue
            config = RpaConfig(pages, queries)
            start = time.perf_counter()
            peak = peak_bytes(problem, config, args.target)
            print(json.dumps({"problem": problem.to_dict(), "config": config.to_dict(),
                              "target": args.target, "peak_bytes": peak,
                              "estimate_bytes": vmem_estimate(problem, config),
                              "seconds": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
