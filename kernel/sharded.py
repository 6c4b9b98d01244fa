"""Sharded steps: the wrapper and the Pallas kernels inside ``jax.shard_map`` and under
``jax.jit`` over a mesh.

- Inside ``jax.shard_map`` (its default ``check_vma=True``) a ``pallas_call``'s ``out_shape``
  must say which mesh axes its outputs vary over: :func:`varying_struct` builds it from the
  inputs (``jax.typeof(x).mat``, passed as ``manual_axis_type``: the same in JAX 0.10.2, the
  oldest supported, and 0.12.1). Our kernels build every ``out_shape`` with it, and their
  backward sums a K/V gradient over the axes the query heads vary over and K/V do not
  (:func:`summed_as`). Upstream's kernels (splash, jax_tpu_flash) build theirs without, so
  there they are refused by rule (:func:`vma_violations`, as x64) and the kernel choice's
  next candidate that can run runs instead.
- Under ``jax.jit`` with inputs sharded over a mesh's explicit axes (``jax.make_mesh``'s
  default), a Mosaic kernel is not partitioned by XLA ("cannot be automatically
  partitioned"): :func:`explicit_specs` reads the inputs' shardings, and the wrapper runs
  itself per device under ``jax.shard_map`` over them, so the problem it resolves is the
  per-device one (a sharded sequence by context parallelism). A sharded head_dim axis is
  refused naming the fix.
- Where XLA chooses the shardings after tracing (a context mesh of ``Auto`` axes, or plain
  ``jax.jit`` over several devices with ``in_shardings`` or ``with_sharding_constraint`` on
  such a mesh), the per-device problem is not known while tracing: :func:`check_per_device`
  raises naming the fix (call it inside ``jax.shard_map``) at trace time where the context
  mesh says so, else when the program is lowered over several devices (:func:`unplaced`).

jax loads on the first call (``import kernel`` stays cheap).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from kernel.errors import ShardingError
from kernel.rules import Violation

# Axes of our [batch, heads, seq, head_dim] layout that may be sharded: each device then
# computes its batch rows and heads, over the whole sequence (a sharded one all-gathered:
# context parallelism, kernel.context_parallel).
SHARDABLE = ("batch", "heads", "seq")
AXES = ("batch", "heads", "seq", "head_dim")
PER_DEVICE_FIX = ("call it inside jax.shard_map over the mesh (as MaxText's attention op does), "
                  "or shard q, k and v over Explicit mesh axes (jax.make_mesh's default; "
                  "jax.set_mesh for bare PartitionSpecs)")


def checked_vma() -> bool:
    """Whether the current trace is the body of a ``jax.shard_map`` with ``check_vma=True``
    (JAX's ``check_vma`` context). False while jax is not loaded."""
    jax = sys.modules.get("jax")
    return jax is not None and bool(getattr(jax.config, "check_vma", False))


def vma_violations() -> list[Violation]:
    """``check_vma``, inside a ``jax.shard_map`` with ``check_vma=True``: for an upstream
    Pallas kernel whose ``out_shape`` names no varying mesh axes (JAX refuses to trace it)."""
    if not checked_vma():
        return []
    return [Violation("check_vma", "upstream's kernel does not trace inside jax.shard_map with "
                      "check_vma=True (its pallas_call outputs name no varying mesh axes); use "
                      "the flash or xla kernel, or pass check_vma=False to jax.shard_map")]


def varying_struct(shape: tuple[int, ...], dtype: Any, *inputs: Any) -> Any:
    """``jax.ShapeDtypeStruct(shape, dtype)`` varying over every manual mesh axis that one of
    ``inputs`` varies over: a ``pallas_call`` output computed from them."""
    import jax

    varying = frozenset().union(*(jax.typeof(x).mat.varying for x in inputs))
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def summed_as(cotangent: Any, primal: Any) -> Any:
    """``cotangent`` summed over the manual mesh axes it varies over and ``primal`` does not:
    the gradient of an input replicated over them (K/V of one head while the query heads are
    sharded) sums what each device's kernel computed."""
    import jax

    extra = jax.typeof(cotangent).mat.varying - jax.typeof(primal).mat.varying
    return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


def explicit_specs(q: Any, k: Any, v: Any) -> tuple[Any, Any, Any] | None:
    """``(mesh, q_spec, kv_spec)`` when ``q``, ``k`` or ``v`` (``[batch, heads, seq,
    head_dim]``) is sharded over a mesh's explicit axes, or all three are replicated over a
    mesh whose axes are all Explicit (the Pallas kernels then run in ``jax.shard_map`` too:
    interpreted outside it, their stores fail JAX's sharding check), else None. Only batch,
    heads and the sequence may be sharded, alike in all three (k and v unsharded over heads
    when they have one head, as multi-query attention); anything else raises naming the fix."""
    import jax

    shardings = [jax.typeof(x).sharding for x in (q, k, v)]
    specs = [padded(sharding.spec) for sharding in shardings]
    if not any(any(spec) for spec in specs) and not _all_explicit(shardings[0].mesh):
        return None
    for name, spec in zip("qkv", specs, strict=True):
        sharded = unshardable_axes(spec)
        if sharded:
            raise ValueError(f"{name} is sharded over its {' and '.join(sharded)} axis "
                             f"({jax.sharding.PartitionSpec(*spec)}): flash_attention "
                             "computes whole head vectors per device; shard [batch, heads, "
                             "seq, head_dim] over batch, heads and seq only "
                             "(jax.sharding.reshard)")
    q_spec, k_spec, v_spec = specs
    kv_heads = q_spec[1] if k.shape[1] > 1 else k_spec[1]
    if k_spec != v_spec or k_spec[:3] != (q_spec[0], kv_heads, q_spec[2]):
        raise ValueError(f"q, k and v must be sharded alike over batch, heads and seq, got "
                         f"{[str(jax.sharding.PartitionSpec(*s)) for s in specs]}; reshard k "
                         "and v as q (jax.sharding.reshard)")
    P = jax.sharding.PartitionSpec
    return shardings[0].mesh, P(*q_spec), P(*k_spec)


def _all_explicit(mesh: Any) -> bool:
    """Whether ``mesh`` has axes and every one is Explicit (none Manual, as inside a
    ``jax.shard_map``, nor Auto)."""
    import jax

    return not mesh.empty and all(kind == jax.sharding.AxisType.Explicit
                                  for kind in mesh.axis_types)


def padded(spec: Any) -> tuple[Any, ...]:
    """A rank-4 array's ``PartitionSpec`` as four entries (a shorter spec leaves the rest
    unsharded)."""
    entries = tuple(spec)
    return entries + (None,) * (len(AXES) - len(entries))


def unshardable_axes(entries: tuple[Any, ...],
                     shardable: tuple[str, ...] = SHARDABLE) -> list[str]:
    """The axes of ``AXES`` that ``entries`` (a :func:`padded` spec) shards and must not."""
    return [axis for axis, entry in zip(AXES, entries, strict=True)
            if entry is not None and axis not in shardable]


def unknown_per_device(where: str) -> ShardingError:
    """The error of a call whose per-device problem cannot be known (``where``: the trace)."""
    return ShardingError(f"flash_attention is traced {where}, whose shardings XLA chooses after "
                         "tracing: the problem each device computes, which is what is tuned and "
                         "looked up, is not known there (and a TPU cannot partition the Mosaic "
                         f"kernel); {PER_DEVICE_FIX}")


def check_per_device(q: Any) -> bool:
    """Whether the per-device problem of a call is q's shape: True inside ``jax.shard_map``,
    under a mesh's Explicit axes, or on a host of one device. Raises :class:`ShardingError`
    where the context mesh (else q's, as a sharding constraint gives it) has ``Auto`` axes
    over several devices; False where neither is known on a host of several devices (plain
    ``jax.jit`` with ``in_shardings``, say): mark q :func:`unplaced`."""
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:  # no context mesh: q's own (a sharding constraint's, say)
        mesh = jax.typeof(q).sharding.mesh
    auto = [name for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types,
                                              strict=True)
            if size > 1 and kind == jax.sharding.AxisType.Auto]
    if auto:
        raise unknown_per_device(f"over a mesh whose axes {', '.join(auto)} are Auto")
    return not (mesh.empty and jax.device_count() > 1)


def unplaced(q: Any) -> Any:
    """``q`` through an identity whose lowering raises :func:`unknown_per_device` inside a
    program over several devices outside ``jax.shard_map`` (XLA partitions it as it likes)."""
    return _unplaced_primitive().bind(q)


@functools.cache
def _unplaced_primitive() -> Any:
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    primitive = Primitive("flash_attention_unplaced")
    primitive.def_impl(lambda x: x)
    primitive.def_abstract_eval(lambda x: x)
    ad.primitive_jvps[primitive] = lambda primals, tangents: (primitive.bind(*primals),
                                                              tangents[0])
    batching.primitive_batchers[primitive] = lambda args, dims: (primitive.bind(*args), dims[0])

    def lower(ctx: Any, x: Any) -> list[Any]:
        devices = getattr(ctx.module_context.axis_context, "num_devices", 1)
        if devices > 1:
            raise unknown_per_device(f"in a jax.jit program over {devices} devices without "
                                     "Explicit mesh axes on its inputs")
        return [x]

    mlir.register_lowering(primitive, lower)
    return primitive
