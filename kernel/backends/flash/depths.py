"""Which pipeline depths (ring buffers per streamed operand) the installed JAX lowers for TPU.

The kernels stream their operands from HBM through a ring of ``depth`` VMEM buffers inside the
kernel (``kernel.backends.flash.pallas.stream_ahead``: a ``pallas_call`` BlockSpec lowers only
depths 1 and 2); the probe lowers that same mechanism at each depth. Interpret mode runs
any depth, so a depth is only known to work once a kernel using it has been lowered
for TPU; this runs on any host (no TPU needed).
"""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernel.backends.flash.pallas import STREAMS_AHEAD, ring_scratch, stream_ahead, window
from kernel.backends.flash.rules import MAX_PROBED_DEPTH

_PROBE_SHAPE = (4 * 8, 128)  # four (8, 128) tiles: two grid steps of two, enough to pipeline


def pipeline_depth_lowers(depth: int) -> bool:
    """Whether a tiny kernel streaming an HBM input through ``stream_ahead`` at ``depth``
    lowers for TPU. At depth 1 an error raises: the same kernel failing at the shallowest depth is no
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
    steps = _PROBE_SHAPE[0] // block[0]

    def copy_kernel(x_hbm, o_ref, *ring):
        # Grid steps of two blocks each: step o's last steps fetch o + 1's first blocks.
        def body(t, x_ref):
            row = (2 * pl.program_id(2) + t) * block[0]
            o_ref[pl.ds(pl.multiple_of(row, block[0]), block[0]), :] = x_ref[...]

        stream_ahead(body, lambda o, t: [window(x_hbm, 0, (2 * o + t) * block[0], block[0])],
                     lambda o: 2, ring, depth)

    # Lower for real even inside a caller's force_tpu_interpret_mode context (pallas_call
    # reads that context when it is built).
    with pltpu.force_tpu_interpret_mode(None):
        call = pl.pallas_call(
            copy_kernel,
            grid=(1, 1, steps // 2),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
            out_shape=jax.ShapeDtypeStruct(_PROBE_SHAPE, jnp.float32),
            scratch_shapes=ring_scratch([(block, jnp.float32)], depth),
            compiler_params=pltpu.CompilerParams(dimension_semantics=STREAMS_AHEAD),
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
