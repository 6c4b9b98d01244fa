"""The public serving entry point: ``ragged_paged_attention``, its block sizes resolved at trace
time as ``flash_attention``'s config is (docs/serving.md).

It checks the inputs, builds the :class:`kernel.serving.ServingProblem` from their static shapes
and dtypes, and runs the serving backend with the explicit config (checked, raising on a broken
rule) or the resolved one (pinned table > lookup service > default, never failing), recording
the resolution in ``kernel.resolution_sources()`` and a miss in ``kernel.untuned()``.
"""

from __future__ import annotations

from typing import Any

from kernel.contract import default_device
from kernel.misses import note as note_miss
from kernel.problem import DTYPES, dtype_name, finite_float, shown_number, softcap_problem
from kernel.registry import SERVING_KERNELS
from kernel.scoped_resolver import active_resolver
from kernel.serving import ServingProblem
from kernel.targets import device_target

SERVING_KERNEL = next(iter(SERVING_KERNELS))  # the one serving backend
# The int32 metadata arrays: name -> (rank, what it holds).
METADATA = {"kv_lens": (1, "[max_num_seqs]"), "page_indices": (2, "[max_num_seqs, pages_per_seq]"),
            "cu_q_lens": (1, "[max_num_seqs + 1]"), "num_seqs": (1, "[1]")}


def ragged_paged_attention(q: Any, kv_pages: Any, kv_lens: Any, page_indices: Any,
                           cu_q_lens: Any, num_seqs: Any, *, sm_scale: float | None = None,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           config: Any = None) -> Any:
    """Attention of every sequence's new tokens over its paged KV cache, mixed prefill and
    decode in one call (JAX's ``ragged_paged_attention``), on a TPU.

    ``q``: ``[max_num_batched_tokens, q_heads, head_dim]``, every sequence's new tokens one
    after the other (``cu_q_lens``, int32 ``[max_num_seqs + 1]``, says where each starts);
    ``kv_pages``: ``[total_pages, page_size, 2 * kv_heads, head_dim]``, K and V interleaved
    per head; ``kv_lens`` int32 ``[max_num_seqs]``; ``page_indices`` int32 ``[max_num_seqs,
    pages_per_seq]``; ``num_seqs`` int32 ``[1]``. Each sequence's queries are the last
    ``q_len`` of its ``kv_len`` tokens, causal. float32 or bfloat16.

    ``sm_scale`` defaults to ``head_dim ** -0.5`` (as :func:`kernel.flash_attention`'s; JAX's
    own call defaults to 1.0). ``sliding_window``: the query at position p sees keys after
    ``p - sliding_window``; ``soft_cap``: logits become ``soft_cap * tanh(logits /
    soft_cap)``. Both are part of the problem its block sizes are tuned for.

    Without ``config``, the block sizes are resolved per problem at trace time: a pinned
    table's exact entry, else its nearest entry legal for this problem, else the lookup
    service's, else the backend's default (JAX's own choice, shrunk until it fits the chip's
    VMEM); ``kernel.resolution_sources()`` says which. An explicit ``config`` (an
    ``RpaConfig``) is checked against the rules of the device and raises on a broken one.
    """
    problem = serving_problem(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                              sliding_window, soft_cap)
    scale = problem.head_dim ** -0.5 if sm_scale is None else _positive("sm_scale", sm_scale)
    device = default_device()
    if device.platform != "tpu":
        raise NotImplementedError(f"ragged_paged_attention runs on a TPU (JAX's kernel has no "
                                  f"interpret mode it runs in), not on {device.platform!r}")
    target = device_target(device.platform, device.device_kind)
    resolver = active_resolver()
    backend = SERVING_KERNELS[SERVING_KERNEL]
    backend.check_problem(problem)
    if config is None:
        resolution = resolver.resolve(problem, device.device_kind, SERVING_KERNEL, target)
        config, origin = resolution.config, resolution.origin
        nearest = origin if resolution.match == "nearest" else None
        note_miss((SERVING_KERNEL, problem), problem, SERVING_KERNEL, resolution.source,
                  resolution.detail, True, nearest)
    elif not isinstance(config, backend.config_type):
        name = backend.config_type.__name__
        raise TypeError(f"config must be a {name} or None, got {type(config).__name__}; build "
                        f"one with {name}.from_dict")
    else:
        backend.check(problem, config, target)
    return backend.attention(problem, lambda mode: config, scale)(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)


def serving_problem(q: Any, kv_pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any,
                    num_seqs: Any, sliding_window: Any = None,
                    soft_cap: Any = None) -> ServingProblem:
    """The serving problem of a call, from static shapes and dtypes; malformed inputs raise
    naming the argument and the fix."""
    for name, x, rank in (("q", q, 3), ("kv_pages", kv_pages, 4)):
        _check_array(name, x, rank, "[max_num_batched_tokens, q_heads, head_dim]" if rank == 3
                     else "[total_pages, page_size, 2 * kv_heads, head_dim]")
        if dtype_name(x) not in DTYPES:
            raise TypeError(f"{name} has dtype {dtype_name(x)}; ragged_paged_attention supports "
                            f"{' and '.join(DTYPES)} (cast it)")
    arrays = dict(kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu_q_lens,
                  num_seqs=num_seqs)
    for name, (rank, axes) in METADATA.items():
        _check_array(name, arrays[name], rank, axes)
        if dtype_name(arrays[name]) != "int32":
            raise TypeError(f"{name} must be int32, got {dtype_name(arrays[name])}; cast it")
    tokens, q_heads, head_dim = q.shape
    _, page_size, combined, kv_dim = kv_pages.shape
    seqs, pages_per_seq = page_indices.shape
    if combined % 2:
        raise ValueError(f"kv_pages holds {combined} heads on axis 2: K and V interleaved, "
                         "so an even count (2 * kv_heads)")
    if head_dim != kv_dim:
        raise ValueError(f"q has head_dim {head_dim} but kv_pages has {kv_dim}")
    for name, shape in (("kv_lens", (seqs,)), ("cu_q_lens", (seqs + 1,)), ("num_seqs", (1,))):
        if tuple(arrays[name].shape) != shape:
            raise ValueError(f"{name} must have shape {METADATA[name][1]} = {shape} "
                             f"(max_num_seqs {seqs} from page_indices), got "
                             f"{tuple(arrays[name].shape)}")
    if soft_cap is not None and (why := softcap_problem("soft_cap", soft_cap)):
        raise ValueError(why)
    if sliding_window is not None and (isinstance(sliding_window, bool)
                                       or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive Python int (keys a query sees), "
                         f"got {sliding_window!r}; leave it out for none")
    return ServingProblem(q_heads, combined // 2, head_dim, page_size, pages_per_seq, tokens,
                          seqs, dtype=dtype_name(q), kv_dtype=dtype_name(kv_pages),
                          window=sliding_window, softcap=soft_cap)


def _check_array(name: str, x: Any, rank: int, axes: str) -> None:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be a jax array, got {type(x).__name__}")
    if len(x.shape) != rank:
        raise ValueError(f"{name} must have rank {rank} {axes}, got shape {tuple(x.shape)}")
    if 0 in x.shape:
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")


def _positive(name: str, value: Any) -> float:
    """``value`` as a float if it is a positive finite Python number, else raises."""
    number = finite_float(value)
    if number is None or number <= 0:
        raise ValueError(f"{name} must be a positive finite Python number, got "
                         f"{shown_number(value)}")
    return number
