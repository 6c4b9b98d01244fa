"""What the hardware tier (tests/test_tpu_tier.py) and ``bench/chip/verify_published.py`` check on
a chip: a config's output and three gradients against a float32 XLA reference at ``highest``
matmul precision, and a canary (a config run again on the same inputs, bit-identical to its
first run) that shows a chip state left corrupt by whatever ran in between."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from autotune.measure import same_bits
from kernel.contract import example_inputs
from kernel.problem import Problem
from kernel.registry import KERNELS
from kernel.tolerance import relative_error

OUTPUTS = ("out", "dq", "dk", "dv")


def write_report(report: dict[str, Any], out: Path | None) -> None:
    """Prints ``report`` as JSON, headed by the device and JAX version it was measured with,
    and writes it to ``out`` when given."""
    text = json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       **report}, indent=1)
    print(text)
    if out:
        out.write_text(text + "\n")


def compiled(kernel_name: str, problem: Problem, config: Any):
    """A function of the inputs to (out, dq, dk, dv) of one config, left on the device (the
    comparisons reduce them there)."""
    kernel = KERNELS[kernel_name]
    forward = jax.jit(kernel.build(dataclasses.replace(problem, mode="fwd"), config))
    grads = jax.jit(kernel.build(problem, config))
    return lambda inputs: (forward(*inputs), *grads(*inputs))


def _reference(kernel: Any, problem: Problem, inputs: list[Any]) -> tuple[Any, ...]:
    """(out, dq, dk, dv) of the float32 gate reference at ``highest`` precision (blockwise,
    :mod:`kernel.reference`: its logits take a query block's memory, not the whole batch's)."""
    forward = jax.jit(kernel.reference(dataclasses.replace(problem, mode="fwd")))
    grads = jax.jit(kernel.reference(problem))
    args = [x.astype(np.float32) if x.dtype.kind == "f" else x for x in inputs]
    with jax.default_matmul_precision("highest"):
        return tuple(x.astype(np.float32) for x in (forward(*args), *grads(*args)))


@dataclasses.dataclass
class Bench:
    """One fwd_bwd problem's inputs, float32 reference and canary (``canary_kernel`` at
    ``canary_config``, run once here)."""

    problem: Problem
    inputs: list[Any]
    reference: tuple[Any, ...]
    canary_run: Any
    canary: tuple[Any, ...]

    @classmethod
    def of(cls, problem: Problem, canary_kernel: str, canary_config: Any) -> Bench:
        inputs = example_inputs(problem)
        canary = compiled(canary_kernel, problem, canary_config)
        return cls(problem, inputs, _reference(KERNELS[canary_kernel], problem, inputs), canary,
                   canary(inputs))

    def errors(self, kernel_name: str, config: Any) -> dict[str, float]:
        """Each output's relative error of ``config`` against the reference."""
        got = compiled(kernel_name, self.problem, config)(self.inputs)
        return dict(zip(OUTPUTS, (relative_error(g, w) for g, w in zip(got, self.reference))))

    def canary_holds(self) -> bool:
        return same_bits(self.canary_run(self.inputs), self.canary)
