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
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

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


def input_specs(problem: Problem, device: jax.Device | None = None) -> list[jax.ShapeDtypeStruct]:
    """Abstract q, k, v for ``problem``, and for a segmented one its q and kv segment ids
    (int32), placed on ``device`` when given."""
    sharding = SingleDeviceSharding(device) if device is not None else None
    dtype = jnp.dtype(problem.dtype)
    q_shape = (problem.batch, problem.q_heads, problem.q_len, problem.head_dim)
    kv_shape = (problem.batch, problem.kv_heads, problem.kv_len, problem.head_dim)
    ids = [(problem.batch, problem.q_len), (problem.batch, problem.kv_len)]
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            for shape in (q_shape, kv_shape, kv_shape)] + [
        jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
        for shape in (ids if problem.segmented else [])]


# The packing a segmented problem is tuned and checked with: each batch row holds
# DOCUMENTS_PER_ROW documents (ids 1, 2, ...) of lengths drawn from the row's seed (cut
# points uniform without repetition), then a padding tail of PADDING_FRACTION of the row (id 0,
# a segment of its own, as MaxText pads packed rows). The row is the keys' (kv_len); positions
# are shared by queries and keys (top-left aligned, as causal is): q ids are the row's first
# q_len, and queries past the last key continue its segment, so that every query's segment has
# keys (a query that sees no key gets zeros from the reference, an average from some kernels,
# which would fail their correctness gate).
DOCUMENTS_PER_ROW = 4
PADDING_FRACTION = 1 / 16


def packed_segment_ids(problem: Problem, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The representative q and kv segment ids of ``problem`` (int32 ``[batch, q_len]`` and
    ``[batch, kv_len]``), deterministic in ``seed``: see :data:`DOCUMENTS_PER_ROW`."""
    length = problem.kv_len
    padding = int(length * PADDING_FRACTION)
    filled = length - padding
    rows = []
    for row in range(problem.batch):
        rng = np.random.default_rng([seed, row])
        cuts = rng.choice(np.arange(1, filled), min(DOCUMENTS_PER_ROW, filled) - 1,
                          replace=False) if filled > 1 else np.array([], int)
        documents = np.searchsorted(np.sort(cuts), np.arange(filled), side="right") + 1
        rows.append(np.concatenate([documents, np.zeros(padding, int)]))
    ids = np.asarray(rows, np.int32)
    past_the_keys = np.repeat(ids[:, -1:], max(problem.q_len - length, 0), axis=1)
    return np.concatenate([ids, past_the_keys], axis=1)[:, :problem.q_len], ids


def example_inputs(problem: Problem, seed: int = 0) -> list[jax.Array]:
    """Concrete inputs of ``problem`` (:func:`input_specs`): standard normal q, k, v drawn
    from ``seed``, and for a segmented problem :func:`packed_segment_ids`."""
    keys = jax.random.split(jax.random.key(seed), 3)
    specs = input_specs(problem)
    arrays = [jax.random.normal(key, spec.shape, spec.dtype)
              for key, spec in zip(keys, specs[:3], strict=True)]
    if problem.segmented:
        arrays += [jnp.asarray(ids) for ids in packed_segment_ids(problem, seed)]
    return arrays


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
    jax.jit(fn).trace(*input_specs(problem, device)).lower().compile(
        compiler_options=compiler_options)
    return time.perf_counter() - start
