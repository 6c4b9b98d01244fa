"""Ahead-of-time compiles of the flash kernel for a TPU generation, with no TPU attached.

With libtpu installed, JAX exposes deviceless TPU topologies; compiling against one runs the
real Mosaic compiler, so VMEM overflows surface as real compiler errors on a CPU-only machine.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from kernel.config import FlashConfig
from kernel.flash import flash_attention
from kernel.problem import Problem
from kernel.space import Target, get_target

# libtpu takes a machine-wide lock file by default, meant for processes sharing a real TPU.
# Deviceless compiles share nothing, and precheck runs several compiler processes at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


@functools.cache
def topology_device(target_name: str) -> jax.Device:
    """The single device of a deviceless 1-chip topology for ``target_name`` (e.g. ``v5e``)."""
    target = get_target(target_name)
    if target.topology is None:
        raise ValueError(f"target {target.name!r} has no TPU topology to compile against")
    topology = topologies.get_topology_desc(
        topology_name=target.topology, platform="tpu", chips_per_host_bounds=(1, 1, 1))
    return topology.devices[0]


def attention_fn(problem: Problem, config: FlashConfig, *,
                 forward_only: bool = False) -> Callable[..., Any]:
    """The function the tuner measures: the forward pass, or forward plus all three gradients.

    ``forward_only`` (``fwd_bwd`` mode): just the forward kernel as training runs it, saving
    the softmax statistics for the backward pass (``jax.vjp``), without the two backward kernels.
    """
    attend = functools.partial(flash_attention, causal=problem.causal, config=config)
    if problem.mode == "fwd":
        return attend
    if forward_only:
        return lambda q, k, v: jax.vjp(attend, q, k, v)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return attend(q, k, v).astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2))


def input_specs(problem: Problem, device: jax.Device | None = None) -> list[jax.ShapeDtypeStruct]:
    """Abstract q, k, v for ``problem``, placed on ``device`` when given."""
    sharding = SingleDeviceSharding(device) if device is not None else None
    dtype = jnp.dtype(problem.dtype)
    q_shape = (problem.batch, problem.q_heads, problem.q_len, problem.head_dim)
    kv_shape = (problem.batch, problem.kv_heads, problem.kv_len, problem.head_dim)
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            for shape in (q_shape, kv_shape, kv_shape)]


def compile_for_target(
    problem: Problem, config: FlashConfig, target: Target | str,
    compiler_options: dict[str, str | int | bool] | None = None, *,
    forward_only: bool = False,
) -> float:
    """Compiles ``config`` for ``target`` without a TPU and returns the compile seconds.

    Raises whatever the compiler raises (e.g. ``RESOURCE_EXHAUSTED ... vmem``).
    ``forward_only``: see ``attention_fn``.
    """
    target_name = target if isinstance(target, str) else target.name
    device = topology_device(target_name)
    start = time.perf_counter()
    fn = attention_fn(problem, config, forward_only=forward_only)
    lowered = jax.jit(fn).trace(*input_specs(problem, device)).lower()
    lowered.compile(compiler_options=compiler_options)
    return time.perf_counter() - start
