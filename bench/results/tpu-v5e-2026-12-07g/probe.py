"""Which tokamax splash configs give wrong numbers on the chip (issue 72; run from the
repository root as `python3 bench/results/tpu-v5e-2026-12-07g/probe.py [FIRST-CASE]`, DTYPE=float32
for float32): each problem and
config below, with Mosaic's experimental scheduler off and on, against the float32
reference; one JSON row per run on stdout."""
import json
import os
import sys

import jax
import numpy as np

from kernel import Problem
from kernel.backends.tokamax_splash import KERNEL, capped
from kernel.contract import default_scale, example_inputs, gate_reference, measured_fn

CASES = [  # (batch, heads, kv heads, seq, causal, mode, block_q, block_kv)
    (1, 2, 2, 512, False, "fwd", 512, 512), (1, 2, 2, 512, False, "fwd", 256, 256),
    (1, 2, 2, 1024, False, "fwd", 512, 512), (1, 2, 2, 2048, False, "fwd", 512, 512),
    (1, 2, 2, 2048, False, "fwd", 1024, 2048), (1, 2, 2, 2048, True, "fwd", 512, 512),
    (1, 2, 2, 1024, False, "fwd_bwd", 512, 512), (1, 2, 2, 512, False, "fwd_bwd", 512, 512),
    (2, 8, 8, 4096, False, "fwd", 1024, 4096), (2, 8, 8, 4096, False, "fwd_bwd", 1024, 2048),
]


def error(problem, config):
    inputs = example_inputs(problem)
    attend = KERNEL.attention(problem, lambda mode: config, default_scale(problem))
    got = jax.jit(measured_fn(problem, attend))(*inputs)
    want = jax.jit(gate_reference(problem))(*inputs)
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    return [float(np.max(np.abs(np.asarray(g, np.float32) - np.asarray(w, np.float32)))
                  / (float(np.max(np.abs(np.asarray(w, np.float32)))) + 1e-9))
            for g, w in zip(got, want)]


for b, h, hkv, seq, causal, mode, bq, bkv in CASES[int(sys.argv[1]) if len(sys.argv) > 1 else 0:]:
    problem = Problem(b, h, hkv, seq, seq, 128, os.environ.get("DTYPE", "bfloat16"), causal, mode)
    for sched in (False, True):
        config = capped(problem, block_q=bq, block_kv=bkv, block_kv_compute=min(bkv, 512),
                        block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=min(bkv, 512),
                        use_experimental_scheduler=sched)
        try:
            row = {"problem": problem.label(), "config": config.label(mode), "error": error(problem, config)}
        except Exception as e:  # noqa: BLE001
            row = {"problem": problem.label(), "config": config.label(mode), "failed": str(e)[:200]}
        print(json.dumps(row), flush=True)
