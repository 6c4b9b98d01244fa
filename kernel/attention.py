"""The public entry point: ``flash_attention``, with its config resolved at trace time.

It checks the inputs, asks the resolver which backend runs on the default device's platform,
and hands that backend a ``config_for(mode)``: the explicit config (checked, raising on a
broken rule), else the resolved one (table > service > default, never failing). jax loads on
the first call, so ``import kernel`` stays cheap for the service and storage.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from kernel.capture import Call, note_unplaced, observe
from kernel.context_parallel import sharded_attention
from kernel.contract import ConfigFor, TunableKernel, by_mode, default_device
from kernel.problem import (DTYPES, Problem, dtype_name, finite_float, shown_number,
                            softcap_problem)
from kernel.resolve import NO_TUNABLE_FIELDS
from kernel.scoped_resolver import active_resolver
from kernel.sharded import check_per_device, explicit_specs, unplaced
from kernel.targets import GPU_PLATFORMS, Target, device_target

PLATFORMS = ("tpu", "cpu", *GPU_PLATFORMS)  # cpu: the TPU kernels run in interpret mode
# Array layouts: ours (batch, heads, seq, head_dim), and jax.nn.dot_product_attention's.
LAYOUTS = ("BHSD", "BSHD")
# Where queries sit among the keys when q_len != kv_len: query i at position i (top-left, as
# jax.nn's is_causal), or at i + kv_len - q_len (bottom-right: the last q_len positions).
ALIGNMENTS = ("top_left", "bottom_right")
# More heads than this, over fewer positions, in what the default layout reads as the heads
# axis looks like a [batch, seq, heads, head_dim] array: refused unless the layout is given.
# The most query heads of published models' attention layers (Llama 3.1 405B, DeepSeek-V3).
MOST_PLAUSIBLE_HEADS = 128
# Attention features of other APIs (jax.nn, tokamax, upstream's kernels) that no backend here
# implements, or that this wrapper takes under another name, named in the error when a caller
# passes them.
UNSUPPORTED_FEATURES = {
    "q_segment_ids": "pass segment_ids=(q_segment_ids, kv_segment_ids)",
    "kv_segment_ids": "pass segment_ids=(q_segment_ids, kv_segment_ids)",
    "bias": "an attention bias", "ab": "an attention bias",
    "mask": "a mask other than causal, window and segments",
    "sliding_window": "pass window=(left, right)", "local_window_size": "pass window=(left, right)",
    "attn_logits_soft_cap": "pass logits_soft_cap", "dropout_rate": "dropout",
    "query_seq_lengths": "sequence lengths (pass segment_ids, padding a segment of its own)",
    "key_value_seq_lengths": "sequence lengths (flash_attention takes kv_lengths)",
    "implementation": "an implementation (the tuned kernel choice picks it)",
}


def flash_attention(q: Any, k: Any, v: Any, *, causal: bool = False,
                    sm_scale: float | None = None, window: tuple[int, int] | None = None,
                    logits_soft_cap: float | None = None, segment_ids: Any = None,
                    config: Any = None, layout: str | None = None, alignment: str | None = None,
                    kv_lengths: Any = None, **unsupported: Any) -> Any:
    """Softmax(``sm_scale`` q kᵀ) v, differentiable.

    ``q``: ``[batch, q_heads, q_len, head_dim]``; ``k``, ``v``: ``[batch, kv_heads, kv_len,
    head_dim]`` with ``q_heads % kv_heads == 0``; float32 or bfloat16. ``layout="BSHD"`` takes
    and returns ``[batch, seq, heads, head_dim]`` arrays instead (``jax.nn``'s layout, as
    :func:`dot_product_attention`). Without ``layout``, shapes that read better as BSHD are
    refused naming both readings and the fix: q or k with more than ``MOST_PLAUSIBLE_HEADS``
    (128) heads over fewer positions, or head counts only BSHD makes consistent;
    ``layout="BHSD"`` says they are meant. ``causal`` masks keys after the query's
    position. ``sm_scale`` defaults to ``head_dim ** -0.5``.

    ``alignment``: where query i sits among the keys when ``q_len != kv_len``:
    ``"top_left"``, at position i (``jax.nn.dot_product_attention``'s ``is_causal``: query 0
    sees key 0 only), or ``"bottom_right"``, at position ``i + kv_len - q_len`` (the queries
    are the last ``q_len`` tokens: decode, chunked prefill, speculative decode). A causal or
    windowed call with ``q_len != kv_len`` must name one (it is refused naming both); with
    equal lengths, or neither mask, both mean the same and it may be left out.

    ``kv_lengths``: integer ``[batch]``, each row's valid keys (the first ``kv_lengths[b]``;
    the rest is padding, never seen), from 0 to ``kv_len`` (concrete lengths outside are
    refused, traced ones clipped). Bottom-right, row b's queries are the last ``q_len``
    positions of its valid keys (query i at ``i + kv_lengths[b] - q_len``); with a causal mask
    or a window, ``alignment`` must be named whatever the lengths. It runs as segment ids (the
    padding a segment no query is in; bottom-right, each row's keys first rolled to end at
    ``kv_len``: a copy of K and V per call), so it is keyed as a segmented problem and cannot
    be combined with ``segment_ids``.

    ``window=(left, right)``: the query at position p sees keys ``p - left`` to ``p + right`` (as
    ``jax.nn.dot_product_attention``'s ``local_window_size``; with ``causal`` the right side is
    0). ``logits_soft_cap``: the scaled logits become ``cap * tanh(logits / cap)`` (Gemma 2), in
    float32: a cap outside ``kernel.problem.SOFTCAP_RANGE`` (1e-30 to 1e30) is refused.
    ``segment_ids=(q_segment_ids, kv_segment_ids)``: integer arrays ``[batch, q_len]`` and
    ``[batch, kv_len]`` (a tuple or list; cast to int32, concrete ids outside its range are
    refused, as are traced ids of a wider type under ``jax_enable_x64``); a query sees the
    keys of its own segment only (packed sequences). A query that sees no key at all gets
    zeros from ``flash`` and ``xla`` (as from the reference), an average of the values from
    ``splash`` and ``jax_tpu_flash``.
    Each is part of the problem: only a kernel that runs it is picked (see the table in
    docs/models.md), and tuning measures it.

    Without ``config``, the backend is the one the kernel choice for this problem, device and
    mode names (pinned table > lookup service; ``fwd_bwd`` when differentiated; when it cannot
    run here, the choice's next best candidate that can, else ``xla``), and its config is
    resolved per problem at trace time, the ``fwd_bwd`` entry when differentiated. Without a
    choice it is the platform's backend (:meth:`kernel.resolve.Resolver.platform_kernel`: ours
    on a TPU, or ``AUTOTUNE_TPU_KERNEL`` which also disables choices there, and, interpreted,
    on a CPU; upstream's Pallas Triton kernel on a GPU), or ``xla`` where that cannot run the
    problem. With an explicit ``config`` (one of its configs, checked against its rules), it
    is the platform's backend, which must run the problem's features. Any other keyword
    (bias, a mask, dropout, ...) raises ``TypeError`` naming it as unsupported.

    Sharded steps (docs/sharded-training.md): inside ``jax.shard_map`` it runs on each
    device's shard; under ``jax.jit`` with q, k and v sharded over a mesh's explicit axes
    (batch, heads and the sequence: :func:`context_parallel_attention`) it runs itself per
    device under ``jax.shard_map``. Either way the problem resolved, tuned and captured is
    the one each device computes.
    """
    if unsupported:
        raise TypeError(_unsupported_message(unsupported))
    _check_layout(layout)
    if alignment not in (None, *ALIGNMENTS):
        raise ValueError(f"alignment must be one of {', '.join(ALIGNMENTS)}, got {alignment!r}")
    if layout == "BSHD":
        return _in_bhsd(functools.partial(
            flash_attention, causal=causal, sm_scale=sm_scale, window=window,
            logits_soft_cap=logits_soft_cap, segment_ids=segment_ids, config=config,
            layout="BHSD", alignment=alignment, kv_lengths=kv_lengths), q, k, v)
    problem = _problem(q, k, v, causal, checked=layout == "BHSD")
    _check_alignment(problem, window, alignment, kv_lengths is not None)
    if sm_scale is None:
        sm_scale = problem.head_dim ** -0.5
    _check_positive("sm_scale", sm_scale)
    if logits_soft_cap is not None:
        _check_positive("logits_soft_cap", logits_soft_cap)
        if out_of_range := softcap_problem("logits_soft_cap", logits_soft_cap):
            raise ValueError(out_of_range)
    ids = _segment_ids(segment_ids, problem)
    if kv_lengths is not None:
        masked = causal or window is not None
        k, v, ids = _valid_lengths(kv_lengths, problem, ids,
                                   masked and alignment == "bottom_right", k, v)
    sharded = explicit_specs(q, k, v)
    if sharded:  # under jit over a mesh: run per device, resolving the per-device problem
        return _per_device(sharded, {"causal": causal, "sm_scale": sm_scale, "window": window,
                                     "logits_soft_cap": logits_soft_cap, "config": config,
                                     "layout": "BHSD"}, alignment, q, k, v, ids)
    if not check_per_device(q):  # plain jit on several devices: known only when lowered
        q = unplaced(q)
        note_unplaced()
    problem = dataclasses.replace(problem, window=window, softcap=logits_soft_cap,
                                  segmented=bool(ids), bottom_right=alignment == "bottom_right")
    platform, device_kind = _default_device()
    if platform not in PLATFORMS:
        raise NotImplementedError(f"flash_attention runs on TPU, GPU and CPU (interpret mode), "
                                  f"not on {platform!r}")
    resolver = active_resolver()
    target = device_target(platform, device_kind)
    if config is not None:
        backend = resolver.platform_kernel(platform)
        backend.check_problem(problem)
        config_for = _explicit(backend, problem, config, target, platform)
        return backend.attention(problem, config_for, float(sm_scale))(q, k, v, *ids)

    call = Call()

    def attend(mode: str) -> Any:
        # The backend is picked per mode: a training step runs the fwd_bwd kernel choice,
        # and a backend whose backward cannot run the problem is not picked for it.
        moded = dataclasses.replace(problem, mode=mode)
        pick = resolver.pick(moded, device_kind, platform, target)
        backend = pick.kernel
        backend.check_problem(moded)  # raises only where no backend can run it

        def config_for(config_mode: str) -> Any:
            return resolver.resolve(dataclasses.replace(problem, mode=config_mode),
                                    device_kind, backend.name, target, pick.by).config

        observe(call, moded, backend.name, *_source(resolver, moded, device_kind, backend,
                                                    target, pick.by),
                refusals=lambda: resolver.refusals(moded, target))
        return backend.attention(moded, config_for, float(sm_scale))

    return by_mode(attend)(q, k, v, *ids)


def context_parallel_attention(q: Any, k: Any, v: Any, *, axis_name: Any, causal: bool = False,
                               sm_scale: float | None = None,
                               window: tuple[int, int] | None = None,
                               logits_soft_cap: float | None = None, segment_ids: Any = None,
                               config: Any = None, layout: str | None = None,
                               load_balanced: bool = False) -> Any:
    """:func:`flash_attention` over a sequence sharded over the mesh axis ``axis_name`` (a
    name or a tuple of names), called inside ``jax.shard_map``: ``q``, ``k``, ``v`` (and
    ``segment_ids``) are this device's shards of the sequence, ``length`` positions each, the
    shards in device order (``load_balanced``: in :func:`load_balanced_order`'s, MaxText's
    ``context_parallel_load_balance``). Returns this device's shard of the output, the
    attention of its queries over the whole sequence, as the unsharded call computes it.

    Each device all-gathers K and V along the sequence (memory: the whole sequence's K and V
    on every device) and calls :func:`flash_attention` on its queries with the mask that puts
    them at their global positions: each device's problem is resolved, tuned and captured as
    any call's (``kernel.capture``, ``autotune.tune_model``). The other arguments are
    :func:`flash_attention`'s; ``kv_lengths`` and a query length other than the keys' are
    not taken (self-attention over one sequence). On one device it is the plain call.
    docs/sharded-training.md#context-parallelism."""
    _check_layout(layout)
    if layout == "BSHD":
        return _in_bhsd(functools.partial(
            context_parallel_attention, axis_name=axis_name, causal=causal, sm_scale=sm_scale,
            window=window, logits_soft_cap=logits_soft_cap, segment_ids=segment_ids,
            config=config, layout="BHSD", load_balanced=load_balanced), q, k, v)
    problem = _problem(q, k, v, causal, checked=layout == "BHSD")
    _check_context_parallel(problem, axis_name, load_balanced)
    attention = functools.partial(flash_attention, sm_scale=sm_scale,
                                  logits_soft_cap=logits_soft_cap, config=config, layout="BHSD")
    return sharded_attention(attention, q, k, v, _segment_ids(segment_ids, problem),
                             axis_name=axis_name, causal=causal, window=window,
                             load_balanced=load_balanced)


def _check_context_parallel(problem: Problem, axis_name: Any, load_balanced: bool) -> None:
    """Raises naming the fix unless the call runs inside ``jax.shard_map`` over
    ``axis_name``, with as many query positions as key positions per device (an even number
    of them when ``load_balanced``: two chunks each)."""
    import jax

    try:
        shards = jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(f"context_parallel_attention runs inside jax.shard_map over a mesh "
                         f"axis {axis_name!r}, which is not bound here; call it in the body of "
                         f"a jax.shard_map whose in_specs shard the sequence axis of q, k and "
                         f"v over {axis_name!r} (P(None, None, {axis_name!r}) for [batch, "
                         "heads, seq, head_dim])") from None
    if problem.q_len != problem.kv_len:
        raise ValueError(f"context_parallel_attention is self-attention over one sharded "
                         f"sequence: q holds {problem.q_len} positions per device but k and v "
                         f"{problem.kv_len}; shard q, k and v alike over {axis_name!r} (for "
                         "decode or cross-attention, all-gather k and v and call "
                         "flash_attention)")
    if load_balanced and shards > 1 and problem.q_len % 2:
        raise ValueError(f"load_balanced: each device holds two chunks of equal length, but "
                         f"its {problem.q_len} positions are odd; pad the sequence to a "
                         f"multiple of {2 * shards}")


def _per_device(sharded: tuple[Any, Any, Any], options: dict[str, Any], alignment: str | None,
                q: Any, k: Any, v: Any, ids: tuple[Any, ...]) -> Any:
    """The call (``options``: its arguments) on each device's shard under ``jax.shard_map``
    over the inputs' mesh (``sharded``: :func:`kernel.sharded.explicit_specs`), the segment ids
    resharded as q's batch and sequence; a sharded sequence by
    :func:`context_parallel_attention`."""
    import jax

    mesh, q_spec, kv_spec = sharded
    ids_spec = jax.sharding.PartitionSpec(q_spec[0], q_spec[2])
    ids_sharding = jax.sharding.NamedSharding(mesh, ids_spec)
    ids = tuple(jax.sharding.reshard(x, ids_sharding) for x in ids)

    def local(q: Any, k: Any, v: Any, *ids: Any) -> Any:
        if q_spec[2] is None:
            return flash_attention(q, k, v, alignment=alignment, segment_ids=ids or None,
                                   **options)
        return context_parallel_attention(q, k, v, axis_name=q_spec[2],
                                          segment_ids=ids or None, **options)

    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec,
                                                      *(ids_spec,) * len(ids)),
                         out_specs=q_spec)(q, k, v, *ids)


def _source(resolver: Any, problem: Problem, device_kind: str, backend: TunableKernel,
            target: Target, kernel_by: str) -> tuple[str, str, bool, Problem | None]:
    """Where the config of ``problem`` (as it runs) comes from, why, whether ``backend`` has
    fields to tune for it (one without, like ``xla``, resolves nothing: never a miss), and
    the tuned problem it borrowed the config from when that was the nearest entry."""
    if not backend.space_params(problem):
        return "default", NO_TUNABLE_FIELDS, False, None
    resolution = resolver.resolve(problem, device_kind, backend.name, target, kernel_by)
    nearest = resolution.match == "nearest"
    return resolution.source, resolution.detail, True, resolution.origin if nearest else None


def _unsupported_message(unsupported: dict[str, Any]) -> str:
    names = ", ".join(f"'{name}'" + (f" ({UNSUPPORTED_FEATURES[name]})"
                                      if name in UNSUPPORTED_FEATURES else "")
                      for name in unsupported)
    plural = "s" if len(unsupported) > 1 else ""
    return (f"flash_attention got unsupported keyword argument{plural} {names}: it takes only "
            "q, k, v, causal, sm_scale, window, logits_soft_cap, segment_ids, config, layout, "
            "alignment and kv_lengths; "
            "drop the argument, or use an attention implementation that supports it")


def _check_alignment(problem: Problem, window: Any, alignment: str | None,
                     lengths: bool) -> None:
    """Raises naming both readings when a causal or windowed call with ``q_len != kv_len`` (or
    with ``kv_lengths``) names no ``alignment``: the mask differs, and neither is a safe
    guess."""
    if alignment is not None or (problem.q_len == problem.kv_len and not lengths):
        return
    if not problem.causal and window is None:
        return
    masked = "causal=True" if problem.causal else f"window={window!r}"
    given, length = (("kv_lengths", "kv_lengths[b]") if lengths else
                     (f"q_len {problem.q_len} != kv_len {problem.kv_len}", "kv_len"))
    raise ValueError(f"{masked} with {given} has two readings; pass alignment='bottom_right' "
                     f"when the queries are the last q_len tokens (query i at position i + "
                     f"{length} - q_len: decode, chunked prefill, speculative decode) or "
                     "alignment='top_left' for query i at position i "
                     "(jax.nn.dot_product_attention's is_causal)")


def _check_positive(name: str, value: Any) -> None:
    """Raises naming ``name`` unless ``value`` is a positive finite Python number (static)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python float (static), got {value!r}")
    number = finite_float(value)
    if number is None or number <= 0:
        raise ValueError(f"{name} must be positive and finite, got {shown_number(value)}")


def _segment_ids(segment_ids: Any, problem: Problem) -> tuple[Any, ...]:
    """``segment_ids`` as ``(q_segment_ids, kv_segment_ids)`` int32 arrays of the problem's
    shapes (``()`` for None); anything else raises naming the argument and the fix."""
    if segment_ids is None:
        return ()
    if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
        fix = "; pass segment_ids=(ids['q'], ids['kv'])" if isinstance(segment_ids, dict) else ""
        raise TypeError("segment_ids must be a pair (q_segment_ids, kv_segment_ids) as a tuple "
                        f"or list, got {type(segment_ids).__name__}{fix}")
    import jax.numpy as jnp

    for name, ids, axis in (("q_segment_ids", segment_ids[0], "q_len"),
                            ("kv_segment_ids", segment_ids[1], "kv_len")):
        shape = (problem.batch, getattr(problem, axis))
        if not (hasattr(ids, "shape") and hasattr(ids, "dtype")):
            raise TypeError(f"segment_ids: {name} must be a jax array, got {type(ids).__name__}")
        if tuple(ids.shape) != shape:
            raise ValueError(f"segment_ids: {name} must have shape [batch, {axis}] = {shape}, "
                             f"got {tuple(ids.shape)}")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"segment_ids: {name} must be integers (one id per document), got "
                            f"dtype {dtype_name(ids)}; cast them")
        _check_int32_range(name, ids)
    return tuple(jnp.asarray(ids, jnp.int32) for ids in segment_ids)


def _valid_lengths(kv_lengths: Any, problem: Problem, ids: tuple[Any, ...], bottom_right: bool,
                   k: Any, v: Any) -> tuple[Any, Any, tuple[Any, Any]]:
    """K, V and the segment ids that hide each row's keys past ``kv_lengths``: every query
    and valid key has id 1, padding 0. ``bottom_right``: each row's keys are rolled to end at
    ``kv_len`` (the padding first), so that the problem's offset ``kv_len - q_len`` puts query
    i at ``i + kv_lengths[b] - q_len`` of the row's own keys."""
    import jax.numpy as jnp

    if ids:
        raise ValueError("kv_lengths and segment_ids cannot be combined: give the padding keys "
                         "a kv segment id that no query has, and drop kv_lengths")
    lengths = _checked_lengths(kv_lengths, problem)
    positions = jnp.arange(problem.kv_len)
    valid = positions[None, :] < lengths[:, None]
    if bottom_right:
        shift = (problem.kv_len - lengths)[:, None]
        source = (positions[None, :] - shift) % problem.kv_len
        k, v = (jnp.take_along_axis(x, source[:, None, :, None], axis=2) for x in (k, v))
        valid = positions[None, :] >= shift
    return k, v, (jnp.ones((problem.batch, problem.q_len), jnp.int32), valid.astype(jnp.int32))


def _checked_lengths(kv_lengths: Any, problem: Problem) -> Any:
    """``kv_lengths`` as int32 ``[batch]`` from 0 to ``kv_len`` (a traced one clipped); anything
    else raises naming the argument and the fix."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    if not (hasattr(kv_lengths, "shape") and hasattr(kv_lengths, "dtype")):
        raise TypeError(f"kv_lengths must be a jax array, got {type(kv_lengths).__name__}")
    if tuple(kv_lengths.shape) != (problem.batch,):
        raise ValueError(f"kv_lengths must have shape [batch] = ({problem.batch},), got "
                         f"{tuple(kv_lengths.shape)}")
    if not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
        raise TypeError(f"kv_lengths must be integers (valid keys per row), got dtype "
                        f"{dtype_name(kv_lengths)}; cast them")
    if not isinstance(kv_lengths, jax.core.Tracer):
        values = np.asarray(kv_lengths)
        low, high = values.min(), values.max()
        if low < 0 or high > problem.kv_len:
            raise ValueError(f"kv_lengths holds lengths from {low} to {high}, outside 0 to "
                             f"kv_len={problem.kv_len}; a row has at most kv_len valid keys")
    return jnp.clip(kv_lengths, 0, problem.kv_len).astype(jnp.int32)


def _check_int32_range(name: str, ids: Any) -> None:
    """Raises naming ``segment_ids`` when concrete ids lie outside int32, which the kernels
    take (cast, 0 and 2**32 would be one segment). A traced array's values are not known
    here: jit casts wider ids to int32 unless x64 is on, when a traced array wider than
    int32 is refused."""
    import jax
    import numpy as np

    if ids.size == 0 or np.can_cast(ids.dtype, np.int32):
        return
    if isinstance(ids, jax.core.Tracer):
        if np.dtype(ids.dtype).itemsize > 4:  # an unsigned 32-bit id casts one-to-one
            raise TypeError(f"segment_ids: {name} is a traced {dtype_name(ids)} array "
                            "(jax_enable_x64 is on), whose ids cannot be checked against "
                            "int32, which the kernels compare (cast, 0 and 2**32 would be one "
                            "segment); pass int32 ids (ids.astype(jnp.int32) where they fit)")
        return
    low, high, bounds = np.min(ids), np.max(ids), np.iinfo(np.int32)
    if low < bounds.min or high > bounds.max:
        raise ValueError(f"segment_ids: {name} holds ids from {low} to {high}, outside int32 "
                         f"({bounds.min} to {bounds.max}), which the kernels compare; number "
                         "the segments within that range")


def _explicit(backend: TunableKernel, problem: Problem, config: Any, target: Target,
              platform: str) -> ConfigFor:
    """``config_for`` of an explicit config: checked for the mode it runs in (its backward
    tiles only matter when differentiated); a broken rule raises ``ConfigError``."""
    if not isinstance(config, backend.config_type):
        name = backend.config_type.__name__
        raise TypeError(f"on {platform}, flash_attention runs kernel {backend.name!r}: config "
                        f"must be a {name} or None, got {type(config).__name__}; build one "
                        f"with {name}.from_dict")

    def config_for(mode: str) -> Any:
        backend.check(dataclasses.replace(problem, mode=mode), config, target)
        return config

    return config_for


def dot_product_attention(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None,
                          *, scale: float | None = None, is_causal: bool = False,
                          query_seq_lengths: Any = None, key_value_seq_lengths: Any = None,
                          local_window_size: Any = None, implementation: Any = None) -> Any:
    """``jax.nn.dot_product_attention``'s signature and layout (``[batch, seq, heads,
    head_dim]``, or ``[seq, heads, head_dim]``) on :func:`flash_attention`: a drop-in for the
    calls it supports (``scale``, ``is_causal``, ``local_window_size``: an int ``w`` is ``(w,
    w)``, as there); any other argument given raises naming it. ``implementation`` must stay
    None: the kernel is the tuned choice's. Masks are top-left aligned, as jax.nn's (query i
    at position i whatever the lengths; it has no other alignment): for decode or chunked
    prefill against a longer cache, call :func:`flash_attention` with
    ``alignment="bottom_right"``."""
    given = {name: value for name, value in (
        ("bias", bias), ("mask", mask), ("query_seq_lengths", query_seq_lengths),
        ("key_value_seq_lengths", key_value_seq_lengths), ("implementation", implementation))
        if value is not None}
    if given:
        raise TypeError(_unsupported_message(given))
    rank = getattr(query, "ndim", 4)
    if rank not in (3, 4):
        raise ValueError("query must have rank 4 [batch, seq, heads, head_dim] or rank 3 [seq, "
                         f"heads, head_dim], got shape {tuple(query.shape)}")
    batched = rank == 4
    axes = "[batch, seq, heads, head_dim]" if batched else "[seq, heads, head_dim]"
    for name, x in (("key", key), ("value", value)):
        if getattr(x, "ndim", rank) != rank:  # told apart before a rank-3 call is batched
            raise ValueError(f"{name} must have the query's rank {rank} {axes}, got shape "
                             f"{tuple(x.shape)}")
    if not batched:
        query, key, value = (x[None] for x in (query, key, value))
    if isinstance(local_window_size, int) and not isinstance(local_window_size, bool):
        local_window_size = (local_window_size, local_window_size)
    out = flash_attention(query, key, value, causal=is_causal, sm_scale=scale,
                          window=local_window_size, layout="BSHD", alignment="top_left")
    return out if batched else out[0]


def _check_layout(layout: str | None) -> None:
    if layout not in (None, *LAYOUTS):
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def _in_bhsd(attention: Any, q: Any, k: Any, v: Any) -> Any:
    """``attention(q, k, v)`` (its other arguments bound, ``layout="BHSD"``) of BSHD arrays:
    each transposed to BHSD, and the output back to BSHD."""
    import jax.numpy as jnp

    _check_arrays(q, k, v, "BSHD")
    out = attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)))
    return jnp.swapaxes(out, 1, 2)


def _check_arrays(q: Any, k: Any, v: Any, layout: str) -> None:
    """Raises naming the fix unless q, k and v are rank-4 arrays of a supported dtype."""
    axes = "[batch, heads, seq, head_dim]" if layout == "BHSD" else "[batch, seq, heads, head_dim]"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be a jax array, got {type(x).__name__}")
        if len(x.shape) != 4:
            raise ValueError(f"{name} must have rank 4 {axes}, got shape {tuple(x.shape)} "
                             f"(layout {layout})")


def _layout_mix_up(q: Any, k: Any) -> str:
    """Why these BHSD-read shapes look like BSHD arrays ('' when they do not): more heads than
    is plausible over fewer positions, or head counts that only the BSHD reading makes a
    grouped-query pair (with fewer heads than positions, as models have)."""
    for name, x in (("q", q), ("k", k)):
        heads, seq = x.shape[1], x.shape[2]
        if heads > MOST_PLAUSIBLE_HEADS and seq < heads:
            return (f"{name} {tuple(x.shape)} reads as {heads} heads over {seq} positions "
                    f"(models use at most {MOST_PLAUSIBLE_HEADS} heads) or, as [batch, seq, "
                    f"heads, head_dim], as {heads} positions of {seq} heads")
    if 0 in (*q.shape, *k.shape):
        return ""  # refused below, saying which size is empty
    if (q.shape[1] % k.shape[1] and not q.shape[2] % k.shape[2]
            and q.shape[2] < q.shape[1] and k.shape[2] < k.shape[1]):
        return (f"q_heads ({q.shape[1]}) is no multiple of kv_heads ({k.shape[1]}), while as "
                f"[batch, seq, heads, head_dim] they would be {q.shape[2]} and {k.shape[2]}")
    return ""


def _problem(q: Any, k: Any, v: Any, causal: Any, checked: bool = False) -> Problem:
    """The problem of a call, from static shapes; malformed inputs raise naming the fix.
    Unless the layout was ``checked`` (given), a likely BSHD array raises saying so."""
    _check_arrays(q, k, v, "BHSD")
    mix_up = "" if checked else _layout_mix_up(q, k)
    if mix_up:
        raise ValueError(f"{mix_up}: flash_attention takes [batch, heads, seq, head_dim]; if "
                         "your arrays are [batch, seq, heads, head_dim] (jax.nn's layout), pass "
                         "layout='BSHD' or call kernel.dot_product_attention; if the shapes "
                         "are meant, pass layout='BHSD'")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if dtype_name(x) not in DTYPES:
            raise TypeError(f"{name} has dtype {dtype_name(x)}; flash_attention supports "
                            f"{' and '.join(DTYPES)} (cast the inputs)")
    if not dtype_name(q) == dtype_name(k) == dtype_name(v):
        raise TypeError(f"q, k and v must share one dtype, got {dtype_name(q)}, {dtype_name(k)}, "
                        f"{dtype_name(v)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    (batch, q_heads, q_len, head_dim), (kv_batch, kv_heads, kv_len, kv_dim) = q.shape, k.shape
    if batch != kv_batch:
        raise ValueError(f"q has batch {batch} but k/v have batch {kv_batch}")
    if head_dim != kv_dim:
        raise ValueError(f"q has head_dim {head_dim} but k/v have head_dim {kv_dim}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}) "
                         "for grouped-query attention")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a Python bool (static), got {causal!r}")
    return Problem(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype=dtype_name(q),
                   causal=causal)




def _default_device() -> tuple[str, str]:
    """The platform and device kind of the default device (``jax_default_device``)."""
    device = default_device()
    return device.platform, device.device_kind
