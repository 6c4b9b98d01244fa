"""Which pipeline depths (``pl.Buffered`` buffer counts) the installed JAX lowers for TPU.

The kernels stream their operands through ``pltpu.emit_pipeline`` inside the kernel (a
``pallas_call`` BlockSpec lowers only depths 1 and 2); the probe lowers that same mechanism
(``kernel.backends.flash.pallas.stream``) at each depth. Interpret mode ignores
``pipeline_mode``, so a depth is only known to work once a kernel using it has been lowered
for TPU; this runs on any host (no TPU needed).
"""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel.backends.flash.pallas import stream
from kernel.backends.flash.rules import MAX_PROBED_DEPTH

_PROBE_SHAPE = (4 * 8, 128)  # four (8, 128) tiles: a grid long enough to pipeline


def pipeline_depth_lowers(depth: int) -> bool:
    """Whether a tiny kernel streaming an HBM input through ``stream`` at ``depth`` lowers for
    TPU. At depth 1 an error raises: the same kernel failing at the shallowest depth is no
    depth's, and reading it as one would hide it (and leave no depth)."""
    try:
        _lower_probe(depth)
    except Exception:  # noqa: BLE001 - Mosaic raises several private exception types
        if depth == 1:
            raise  # the same kernel at the shallowest depth: not a depth that does not lower
        return False
    return True


def _lower_probe(depth: int) -> None:
    """Lowers the probe kernel for TPU at ``depth``, in a thread of its own: the caller's trace
    context (a ``jax.shard_map`` body, a mesh, x64) would change what is probed."""
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        thread.submit(_lower_here, depth).result()


def _lower_here(depth: int) -> None:
    block = (8, 128)

    def copy_kernel(x_hbm, o_ref):
        def body(x_ref):
            i = pl.program_id(0)
            o_ref[pl.ds(pl.multiple_of(i * block[0], block[0]), block[0]), :] = x_ref[...]

        stream(body, (_PROBE_SHAPE[0] // block[0],), [x_hbm], [block], [lambda i: (i, 0)],
               depth)

    # Lower for real even inside a caller's force_tpu_interpret_mode context (pallas_call
    # reads that context when it is built).
    with pltpu.force_tpu_interpret_mode(None):
        call = pl.pallas_call(
            copy_kernel,
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_shape=jax.ShapeDtypeStruct(_PROBE_SHAPE, jnp.float32),
        )
        jax.export.export(jax.jit(call), platforms=["tpu"])(
            jax.ShapeDtypeStruct(_PROBE_SHAPE, jnp.float32))


@functools.cache
def supported_pipeline_depths() -> tuple[int, ...]:
    """The depths 1..``MAX_PROBED_DEPTH`` that lower, up to the first one that does not. When
    even depth 1 does not lower, raises naming the error: no Pallas kernel lowers for TPU
    then."""
    try:
        pipeline_depth_lowers(1)
    except Exception as error:  # noqa: BLE001 - named in the message, chained
        raise RuntimeError(
            "no Pallas kernel lowers for TPU with this JAX installation: the pipeline-depth "
            f"probe (pl.Buffered(1)) failed with {type(error).__name__}: {error} (a JAX "
            "without TPU lowering support needs the 'tpu' extra)") from error
    depths = [1]
    for depth in range(2, MAX_PROBED_DEPTH + 1):
        if not pipeline_depth_lowers(depth):
            break
        depths.append(depth)
    return tuple(depths)
