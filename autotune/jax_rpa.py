"""JAX's ``TUNED_BLOCK_SIZES`` of ragged paged attention from tuned serving configs (``autotune
export --format jax-rpa``): a Python module, and the same as JSON, that a serving stack drops
into its copy of ``tuned_block_sizes.py`` (docs/serving.md).

Keys are JAX's tuple, made by the installed JAX's own ``get_min_heads_per_blk`` (heads per
block) and ``simplify_key``, so the two cannot drift: ``(q dtype, kv dtype, q heads per block,
kv heads per block, head_dim, page_size, max_num_batched_tokens, max_model_len)``, each
simplified to a power of two (head_dim to a multiple of 128). JAX's key has no
``max_num_seqs``, window or soft cap, and its value no VMEM limit: tuned problems that share a
key give one entry (the one whose own key it is, else the first), and a config that needs a
raised VMEM limit is left out (JAX would run it at the default limit); both are reported.
"""

from __future__ import annotations

import json
import pprint
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kernel import LookupTable, ServingProblem

JaxKey = tuple[Any, ...]


@dataclass(frozen=True)
class JaxTable:
    """One device kind's entries in JAX's form, and what could not be written."""

    entries: dict[JaxKey, tuple[int, int]]
    left_out: list[str] = field(default_factory=list)  # why each left-out entry is

    def module(self, device_keys: Iterable[str]) -> str:
        """The Python module: ``TUNED_BLOCK_SIZES`` with the entries under each device key."""
        table = {key: dict(sorted(self.entries.items())) for key in device_keys}
        return ('"""Tuned block sizes of JAX\'s ragged paged attention, measured by '
                'flash-autotune\n(autotune export --format jax-rpa)."""\n\nTUNED_BLOCK_SIZES = '
                f"{pprint.pformat(table, width=100, sort_dicts=False)}\n")

    def json(self, device_keys: Iterable[str]) -> str:
        """The same as JSON: each device key's entries as ``{"key": [...], "value": [...]}``."""
        return json.dumps({key: [{"key": list(jax_key), "value": list(value)}
                                 for jax_key, value in sorted(self.entries.items())]
                           for key in device_keys}, indent=2) + "\n"


def raw_key(problem: ServingProblem) -> JaxKey:
    """JAX's key of ``problem`` before ``simplify_key``, heads per block from JAX's
    ``get_min_heads_per_blk``."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as upstream

    q_heads, combined = upstream.get_min_heads_per_blk(
        problem.q_heads, 2 * problem.kv_heads, jnp.dtype(problem.dtype),
        jnp.dtype(problem.kv_dtype))
    return (problem.dtype, problem.kv_dtype, q_heads, combined // 2, problem.head_dim,
            problem.page_size, problem.max_num_batched_tokens, problem.pages_per_seq)


def jax_key(problem: ServingProblem) -> JaxKey:
    """The key JAX looks ``problem`` up under (its own ``simplify_key``)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

    return tuned_block_sizes.simplify_key(raw_key(problem))


def own_key(problem: ServingProblem) -> bool:
    """Whether ``problem`` is the one its JAX key stands for (its key needs no simplifying)."""
    return jax_key(problem) == (*raw_key(problem)[:7], problem.max_model_len)


def jax_table(table: LookupTable) -> JaxTable:
    """``table``'s serving entries in JAX's form (module docstring)."""
    entries: dict[JaxKey, tuple[int, int]] = {}
    owners: dict[JaxKey, ServingProblem] = {}
    left_out = []
    for entry in table.entries:
        problem, config = entry.problem, entry.config
        if config.vmem_limit_mib is not None:
            left_out.append(f"{problem.label()}: its config {config.label()} needs a VMEM limit, "
                            "which JAX's table cannot carry")
            continue
        key = jax_key(problem)
        if key in owners:
            if own_key(owners[key]) or not own_key(problem):
                left_out.append(f"{problem.label()}: JAX's key {key} is "
                                f"{owners[key].label()}'s too (it has no max_num_seqs, window "
                                "or soft cap)")
                continue
            left_out.append(f"{owners[key].label()}: JAX's key {key} is {problem.label()}'s")
        entries[key] = (config.num_kv_pages_per_block, config.num_queries_per_block)
        owners[key] = problem
    return JaxTable(entries, left_out)
