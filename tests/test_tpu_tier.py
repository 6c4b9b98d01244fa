"""The hardware tier: every registered TPU kernel on an attached TPU, at model sizes.

Each case compiles one config of one kernel for one problem, runs it once on the chip, and
compares its output and its three gradients with a float32 XLA reference computed at
``highest`` matmul precision (on a TPU the default precision is one bf16 pass). Then the
canary: our flash kernel's default config, compiled once per problem and run first, runs again
on the same inputs and must give bit-identical results: a config that leaves the chip's state
corrupt (a copy in flight at kernel exit, pallas-facts §10) shows there even when its own
result is right. Our flash kernel runs every pipeline depth of each of its kernels and a seeded
sample of its space; splash and ``jax_tpu_flash`` a seeded sample of theirs; ``xla`` its one
config.

Marked ``tpu``: without a TPU every case skips, saying so. On a TPU VM::

    AUTOTUNE_TIER_SUMMARY=tier.json python -m pytest -m tpu tests/test_tpu_tier.py

writes per kernel: configs, passed, corrupting, worst error (and every case) to that file.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import defaultdict
from typing import Any

import jax
import pytest

from bench.chip import Bench
from kernel.problem import Problem
from kernel.registry import KERNELS
from kernel.tolerance import max_relative_error

ON_TPU = jax.devices()[0].platform == "tpu"
pytestmark = [pytest.mark.tpu,
              pytest.mark.skipif(not ON_TPU, reason="the hardware tier needs an attached TPU")]
TARGET = jax.devices()[0].device_kind if ON_TPU else "TPU v5 lite"
TPU_KERNELS = [name for name, kernel in KERNELS.items() if "tpu" in kernel.platforms]
CANARY_KERNEL = "flash"
# Seeded configs per kernel: on the first problem, and on each of the others (which run our
# flash kernel's default, its depth-4 default and these), to stay within 8 minutes on a v5e.
FIRST_SAMPLES = {"flash": 8, "splash": 3, "jax_tpu_flash": 1}
SAMPLES = {"flash": 1, "splash": 1}


def _problem(seq: int, heads: tuple[int, int] = (8, 8), head_dim: int = 128, *, batch: int = 1,
             dtype: str = "bfloat16", causal: bool = True, **features: Any) -> Problem:
    return Problem(batch=batch, q_heads=heads[0], kv_heads=heads[1], q_len=seq, kv_len=seq,
                   head_dim=head_dim, dtype=dtype, causal=causal, mode="fwd_bwd", **features)


PROBLEMS = {
    "s4096-gqa16/4-causal": _problem(4096, (16, 4)),
    "s2048-full-b2": _problem(2048, batch=2, causal=False),
    "s8192-causal": _problem(8192),
    "s4096-d256-causal": _problem(4096, head_dim=256),
    "s4096-window-softcap-segments": _problem(4096, (8, 2), window=(1023, 0), softcap=30.0,
                                              segmented=True),
    "s2048-f32-causal": _problem(2048, dtype="float32"),
    # Off the lane tile: one block as long as the sequence, DMA'd at traced offsets (Mosaic
    # refused flash's at 200 tokens on the chip, which interpret mode does not check).
    "s1000-gqa8/2-causal-segments": _problem(1000, (8, 2), segmented=True),
}


def _sample(kernel, problem: Problem, count: int, seed: int) -> list[Any]:
    """``count`` distinct legal configs of ``kernel`` for ``problem`` on the target, drawn
    uniformly from its declared values (rejection sampling, seeded)."""
    rng, params = random.Random(seed), kernel.space_params(problem)
    base = kernel.default_config(problem, TARGET)
    found: dict[Any, None] = {}
    for _ in range(20_000):
        if len(found) == count:
            break
        try:
            config = base.replace(**{name: rng.choice(values) for name, values in params.items()})
        except Exception:  # noqa: BLE001 - a config type refusing a field relation
            continue
        if config != base and not kernel.violations(problem, config, TARGET):
            found[config] = None
    return list(found)


def _flash_depths(problem: Problem, every: bool) -> list[Any]:
    """Our flash default at each pipeline depth (all three kernels; else the deepest only), and
    the mix the chip first failed with (forward 3, dK/dV 4, dQ 3)."""
    kernel = KERNELS["flash"]
    base = kernel.default_config(problem, TARGET)
    depths = kernel.depths if every else kernel.depths[-1:]
    configs = [base.replace(pipeline_depth=d, pipeline_depth_dkv=d, pipeline_depth_dq=d)
               for d in depths]
    if every:
        configs.append(base.replace(pipeline_depth=3, pipeline_depth_dkv=4, pipeline_depth_dq=3))
    return [c for c in dict.fromkeys(configs) if not kernel.violations(problem, c, TARGET)]


def _cases() -> list[Any]:
    cases = []
    for index, (name, problem) in enumerate(PROBLEMS.items()):
        for kernel_name in TPU_KERNELS:
            kernel = KERNELS[kernel_name]
            if kernel.problem_violations(problem):
                continue  # a feature it does not claim (the rules name it)
            configs = [kernel.default_config(problem, TARGET)]
            if kernel_name == "flash":
                configs += _flash_depths(problem, every=index == 0)
            samples = (FIRST_SAMPLES if index == 0 else SAMPLES).get(kernel_name, 0)
            configs += _sample(kernel, problem, samples, seed=index)
            cases += [pytest.param(name, kernel_name, config,
                                   id=f"{name}-{kernel_name}-{config.label()}".replace(" ", "_"))
                      for config in dict.fromkeys(configs)]
    return cases


_BENCHES: dict[str, Bench] = {}
_RESULTS: list[dict[str, Any]] = []


def _bench(name: str) -> Bench:
    if name not in _BENCHES:
        _BENCHES.clear()  # one problem's arrays on the chip at a time
        problem = PROBLEMS[name]
        _BENCHES[name] = Bench.of(problem, CANARY_KERNEL,
                                  KERNELS[CANARY_KERNEL].default_config(problem, TARGET))
    return _BENCHES[name]


def _record(row: dict[str, Any]) -> None:
    """Keeps ``row`` and rewrites the summary (``AUTOTUNE_TIER_SUMMARY``), so that a run cut
    short still leaves what it measured."""
    _RESULTS.append(row)
    path = os.environ.get("AUTOTUNE_TIER_SUMMARY")
    if not path:
        return
    per_kernel: dict[str, dict[str, Any]] = defaultdict(lambda: {
        "configs": 0, "passed": 0, "corrupting": 0, "worst_error": 0.0})
    for case in _RESULTS:
        kernel = per_kernel[case["kernel"]]
        kernel["configs"] += 1
        kernel["passed"] += case["passed"]
        kernel["corrupting"] += not case["canary_holds"]
        kernel["worst_error"] = max(kernel["worst_error"], case["max_error"])
    with open(path, "w") as out:
        json.dump({"device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
                   "kernels": per_kernel, "cases": _RESULTS}, out, indent=1)


@pytest.mark.parametrize("problem_name, kernel_name, config", _cases())
def test_kernel_is_right_on_the_chip_and_leaves_it_right(problem_name, kernel_name, config):
    bench = _bench(problem_name)
    start = time.perf_counter()
    errors = bench.errors(kernel_name, config)
    holds = bench.canary_holds()
    tolerance = max_relative_error(bench.problem.dtype, jax.devices()[0].platform)
    worst = max(errors.values())
    _record({"problem": problem_name, "kernel": kernel_name, "config": config.to_dict(),
             "errors": errors, "max_error": worst, "passed": worst <= tolerance,
             "canary_holds": holds, "seconds": round(time.perf_counter() - start, 2)})
    assert worst <= tolerance, f"relative errors {errors} over {tolerance}"
    assert holds, f"the {CANARY_KERNEL} default changed its result after {config.label()}"
