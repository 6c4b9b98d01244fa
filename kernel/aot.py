"""Ahead-of-time compiles of any backend for a TPU generation, with no TPU attached.

With libtpu installed, JAX exposes deviceless TPU topologies; compiling against one runs the
real Mosaic compiler, so VMEM overflows surface as real compiler errors on a CPU-only machine.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import jax
from jax.experimental import topologies

from kernel.contract import TunableKernel
from kernel.errors import ConfigError
from kernel.problem import Problem
from kernel.targets import Target, get_target

# libtpu takes a machine-wide lock file by default, meant for processes sharing a real TPU.
# Deviceless compiles share nothing, and precheck runs several compiler processes at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


@functools.cache
def topology_device(target_name: str) -> jax.Device:
    """The single device of a deviceless 1-chip topology for ``target_name`` (e.g. ``v5e``)."""
    target = get_target(target_name)
    if target.topology is None:
        raise ConfigError(f"target {target.name!r} has no TPU topology to compile against")
    topology = topologies.get_topology_desc(
        topology_name=target.topology, platform="tpu", chips_per_host_bounds=(1, 1, 1))
    return topology.devices[0]


def compile_for_target(
    kernel: TunableKernel, problem: Problem, config: Any, target: Target | str,
    compiler_options: dict[str, str | int | bool] | None = None, *,
    forward_only: bool = False,
) -> float:
    """Compiles ``kernel``'s measured function (``TunableKernel.build``) for a TPU generation
    without a TPU and returns the compile seconds. Raises what the compiler raises (e.g.
    ``RESOURCE_EXHAUSTED ... vmem``). Needs libtpu."""
    device = topology_device(kernel.target(target).name)
    start = time.perf_counter()
    fn = kernel.build(problem, config, forward_only=forward_only)
    with jax.default_device(device):  # Pallas reads the chip's facts from it when lowering
        jax.jit(fn).trace(*kernel.input_specs(problem, device)).lower().compile(
            compiler_options=compiler_options)
    return time.perf_counter() - start
