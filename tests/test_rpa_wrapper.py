"""``kernel.ragged_paged_attention`` resolving its block sizes at trace time on a v5e: traced
abstractly (``jax.eval_shape``) with a deviceless v5e as the default device, under a pinned
table of serving entries (schema 5): an exact entry, the nearest legal one, the default for a
miss (recorded as flash's are), and an explicit config checked against the chip's rules."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

import kernel
from kernel import ConfigError, LookupTable, ServingProblem, TableEntry, TableError
from kernel.aot import topology_device
from kernel.backends.rpa import RpaConfig, batch_inputs
from kernel.registry import SERVING_KERNELS
from kernel.resolve import ResolverSettings, reset_resolver

RPA = SERVING_KERNELS["rpa"]
V5E = "TPU v5 lite"
LLAMA = ServingProblem(32, 8, 128, page_size=16, pages_per_seq=128, max_num_batched_tokens=512,
                       max_num_seqs=64)
FAR = dataclasses.replace(LLAMA, max_num_batched_tokens=8192)


def _table(*entries: TableEntry) -> LookupTable:
    return LookupTable(RPA.name, RPA.version, V5E, entries)


@pytest.fixture()
def pinned(tmp_path):
    """The process's resolver over a pinned table of two Llama-3-8B entries: (8, 32) at 512
    tokens, (16, 64) at 8192."""
    path = tmp_path / "rpa.json"
    table = _table(TableEntry(LLAMA, RpaConfig(8, 32), time_ms=1.0),
                   TableEntry(FAR, RpaConfig(16, 64), time_ms=2.0))
    path.write_text(json.dumps(table.to_dict()))
    reset_resolver(ResolverSettings(table_paths=(str(path),)))
    yield path
    reset_resolver(ResolverSettings())


def _traced(problem: ServingProblem, **options) -> jax.ShapeDtypeStruct:
    """The output of the wrapper traced abstractly on a deviceless v5e."""
    device = topology_device("v5e")
    with jax.default_device(device):
        specs = RPA.call_specs(problem, device)
        return jax.eval_shape(lambda *inputs: kernel.ragged_paged_attention(*inputs, **options),
                              *specs)


def _one_batch() -> list[jax.Array]:
    """A tiny mixed batch's inputs of one call."""
    tiny = dataclasses.replace(LLAMA, pages_per_seq=4, max_num_seqs=4, max_num_batched_tokens=8)
    return batch_inputs(RPA.example_inputs(tiny), -1)


def _source(problem: ServingProblem) -> str:
    return kernel.resolution_sources()[(RPA.name, V5E, problem)]


def test_a_serving_table_round_trips_at_schema_5(tmp_path):
    table = _table(TableEntry(LLAMA, RpaConfig(8, 32, vmem_limit_mib=32), time_ms=1.0))
    data = table.to_dict()
    assert data["problem_type"] == "serving" and data["schema_version"] == 5
    assert LookupTable.from_dict(data) == table
    with pytest.raises(TableError, match="problem_type 'attention' is not that of kernel 'rpa'"):
        LookupTable.from_dict({**data, "problem_type": "attention"})
    with pytest.raises(TableError, match="came with schema_version 5"):
        LookupTable.from_dict({**data, "schema_version": 4})


def test_an_exact_entry_runs(pinned):
    out = _traced(LLAMA)
    assert out.shape == (512, 32, 128) and out.dtype == jnp.bfloat16
    assert _source(LLAMA) == "table, exact, config kv_pages8 q32"


def test_a_near_problem_borrows_the_nearest_legal_entry(pinned):
    near = dataclasses.replace(LLAMA, max_num_batched_tokens=1024, max_num_seqs=128)
    _traced(near)
    assert _source(near).startswith(f"table, nearest (from {LLAMA.label()}), config kv_pages8")
    assert [b.origin for b in kernel.borrowed() if b.problem == near] == [LLAMA]


def test_a_nearest_entry_illegal_here_falls_back_to_the_legal_default(tmp_path):
    """A (128, 32) entry (JAX's fallback, over a v5e's scoped VMEM at this key) is nearest but
    illegal on the chip: the default runs, legal, and the miss says why."""
    path = tmp_path / "illegal.json"
    near = dataclasses.replace(LLAMA, max_num_seqs=128)
    path.write_text(json.dumps(_table(TableEntry(LLAMA, RpaConfig(128, 32))).to_dict()))
    reset_resolver(ResolverSettings(table_paths=(str(path),)))
    try:
        _traced(near)
        source = _source(near)
        assert source.startswith("default")
        default = RPA.discover().default_config(near, "v5e")
        assert source.endswith(f"config {default.label()}")
        assert RPA.is_legal(near, default, "v5e")
        misses = [m for m in kernel.untuned() if m.problem == near]
        assert [(m.kernel, m.reason) for m in misses] == [(RPA.name, "illegal here")]
    finally:
        reset_resolver(ResolverSettings())


def test_a_nearest_entry_illegal_here_gives_way_to_the_next_nearest_legal_one(tmp_path):
    """Issue 73: a key not in the table resolves to the nearest entry legal for its shape on
    the chip, VMEM included. The nearest, (128, 32), is over a v5e's scoped VMEM; a farther
    one, (8, 32), fits: it runs (borrowed, as flash's nearest entries are), not the default."""
    path = tmp_path / "mixed.json"
    near = dataclasses.replace(LLAMA, max_num_seqs=128)
    path.write_text(json.dumps(_table(TableEntry(LLAMA, RpaConfig(128, 32)),
                                      TableEntry(FAR, RpaConfig(8, 32))).to_dict()))
    assert near.distance(LLAMA) < near.distance(FAR)
    reset_resolver(ResolverSettings(table_paths=(str(path),)))
    try:
        _traced(near)
        assert _source(near) == f"table, nearest (from {FAR.label()}), config kv_pages8 q32"
        assert [b.origin for b in kernel.borrowed() if b.problem == near] == [FAR]
        assert not [m for m in kernel.untuned() if m.problem == near]
    finally:
        reset_resolver(ResolverSettings())


def test_a_miss_runs_the_default_and_is_recorded(pinned):
    other = dataclasses.replace(LLAMA, page_size=32, pages_per_seq=64)  # no entry of its family
    _traced(other)
    assert _source(other).startswith("default")
    assert [m.reason for m in kernel.untuned() if m.problem == other] == ["no entry"]


def test_an_explicit_config_is_checked_against_the_chip(pinned):
    _traced(LLAMA, config=RpaConfig(4, 16))
    with pytest.raises(ConfigError, match=r"\[vmem\].*v5e"):
        _traced(LLAMA, config=RpaConfig(128, 32))
    with pytest.raises(TypeError, match="config must be a RpaConfig"):
        _traced(LLAMA, config={"num_kv_pages_per_block": 8})


@pytest.mark.parametrize(("change", "message"), [
    (lambda x: x[:2] + [x[2].astype(jnp.float32)] + x[3:], "kv_lens must be int32"),
    (lambda x: x[:4] + [x[4][:-1]] + x[5:], r"cu_q_lens must have shape \[max_num_seqs \+ 1\]"),
    (lambda x: [x[0][None]] + x[1:], r"q must have rank 3"),
])
def test_bad_inputs_are_named(change, message):
    inputs = _one_batch()
    with pytest.raises((TypeError, ValueError), match=message):
        kernel.ragged_paged_attention(*change(inputs))


def test_off_a_tpu_it_says_where_it_runs():
    inputs = _one_batch()
    with pytest.raises(NotImplementedError, match="runs on a TPU"):
        kernel.ragged_paged_attention(*inputs)
