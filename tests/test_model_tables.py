"""``with kernel.tables(...)``: tables for the code inside a block only, context-local, nested
innermost first, thread-safe, and named by ``resolution_sources()``."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import threading
import weakref

import jax
import jax.numpy as jnp
import pytest

import kernel
from bench.service.soak import rss_mib
from kernel import LookupTable, Problem, TableEntry, get_kernel, get_target
from conftest import plain_sources
from kernel.resolve import ResolverSettings, reset_resolver
from kernel.scoped_resolver import active_resolver
from kernel.table import KernelChoice, KernelTiming

FLASH = get_kernel("flash")
P = Problem(batch=1, q_heads=1, kv_heads=1, q_len=256, kv_len=256, head_dim=128,
            dtype="float32", mode="fwd")
Q = Problem(batch=1, q_heads=2, kv_heads=2, q_len=256, kv_len=256, head_dim=128,
            dtype="float32", mode="fwd")
SMALL = FLASH.default_config(P).replace(block_q=128, block_kv=128, block_kv_compute=128)
LARGE = FLASH.default_config(P).replace(block_q=256, block_kv=256, block_kv_compute=256)


def table(*entries: tuple[Problem, object], choices: tuple[KernelChoice, ...] = ()):
    return LookupTable(kernel="flash", kernel_version=FLASH.version, device_kind="cpu",
                       entries=tuple(TableEntry(p, c) for p, c in entries), choices=choices)


def attend(q):
    return kernel.flash_attention(q, q, q)


def trace(problem: Problem, fn=attend) -> None:
    jax.eval_shape(fn, jax.ShapeDtypeStruct((1, problem.q_heads, problem.q_len, 128),
                                            jnp.float32))


def ran(problem: Problem, kernel_name: str = "flash"):
    """The config the resolver here gives ``problem`` (what the trace above ran), and how
    ``resolution_sources()`` describes it."""
    source = kernel.resolution_sources()[(kernel_name, "cpu", problem)]  # before resolving
    config = active_resolver().resolve(problem, "cpu", kernel_name, get_target("cpu")).config
    return config, source


def test_a_block_resolves_from_its_table_and_names_it(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps(table((P, SMALL)).to_dict()))
    with kernel.tables(path):
        trace(P)
        config, source = ran(P)
    assert config == SMALL and source.startswith(f"scoped table '{path}'")
    trace(P, lambda q: attend(q))  # outside: the process's own order (no table: default)
    config, source = ran(P)
    assert config == FLASH.default_config(P) and "scoped" not in source


def test_blocks_nest_innermost_first():
    outer, inner = table((P, LARGE), (Q, SMALL)), table((P, SMALL))
    with kernel.tables(outer):
        with kernel.tables(inner):
            trace(P), trace(Q)
            assert ran(P)[0] == SMALL and "scoped table 'flash table on cpu'" in ran(P)[1]
            assert ran(Q)[0] == SMALL  # the inner table has no Q: the outer answers
        trace(P)
        assert ran(P)[0] == LARGE


def test_a_function_traced_outside_is_traced_again_inside():
    step = jax.jit(attend)
    x = jax.ShapeDtypeStruct((1, 1, 256, 128), jnp.float32)
    step.lower(x)
    with kernel.tables(table((P, SMALL))) as block:
        step.lower(x)  # a trace cached outside would never ask the block's tables
        assert kernel.resolution_sources()[("flash", "cpu", P)].startswith("scoped table")
    assert block[0].table.entries[0].config == SMALL


def test_use_table_after_a_trace_reaches_the_traced_function(tmp_path):
    """``kernel.use_table`` after a step was traced: the step is traced again on its next
    call and runs the table's config; until then the sources still name what it ran."""
    path = tmp_path / "small.json"
    path.write_text(json.dumps(table((P, SMALL)).to_dict()))
    reset_resolver(ResolverSettings())
    try:
        step = jax.jit(lambda q: attend(q))  # a function no test traced before
        x = jnp.zeros((1, 1, 256, 128), jnp.float32)
        step(x)
        assert plain_sources(kernel.resolution_sources()) == {("flash", "cpu", P): "default"}
        kernel.use_table(path)
        assert plain_sources(kernel.resolution_sources()) == {("flash", "cpu", P): "default"}
        step(x)
        assert plain_sources(kernel.resolution_sources()) == {("flash", "cpu", P): "table"}
        with kernel.tables(table((Q, SMALL))):  # a block entered later keys by the pinning
            step(x)
        assert ran(P)[0] == SMALL
    finally:
        reset_resolver(ResolverSettings())


def test_use_table_inside_a_block_reaches_what_the_block_traced(tmp_path):
    """``kernel.use_table`` inside a ``kernel.tables`` block (or while another thread is in
    one) reaches a step the block traced before, as outside: the block's tables do not answer
    the step's problem, so the process's new table does."""
    path = tmp_path / "small.json"
    path.write_text(json.dumps(table((P, SMALL)).to_dict()))
    elsewhere = dataclasses.replace(table((P, LARGE)), device_kind="TPU v5 lite")
    reset_resolver(ResolverSettings())
    try:
        step = jax.jit(lambda q: attend(q))  # a function no test traced before
        x = jnp.zeros((1, 1, 256, 128), jnp.float32)
        with kernel.tables(elsewhere):
            step(x)
            kernel.use_table(path)
            step(x)
            assert plain_sources(kernel.resolution_sources()) == {("flash", "cpu", P): "table"}
    finally:
        reset_resolver(ResolverSettings())


def resolved(problem: Problem):
    """The config a trace here would run for ``problem`` (as the wrapper resolves it)."""
    return active_resolver().resolve(problem, "cpu", "flash", get_target("cpu")).config


def _alive(refs: list[weakref.ref]) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)


def test_a_table_is_freed_once_no_block_uses_it(tmp_path):
    """100 blocks, each with a fresh table (inside a block whose table lives on, as a model's
    outer table does), resolve from it; after each block the table is garbage. A table file
    changed between blocks frees its older versions likewise."""
    causal = Problem(**{**Q.to_dict(), "causal": True})  # a family only the outer table has
    kept = table((causal, LARGE))
    fresh, reloaded = [], []
    path = tmp_path / "table.json"
    with kernel.tables(kept):
        for i in range(100):
            made = table((P, SMALL if i % 2 else LARGE))
            with kernel.tables(made):
                if i % 10 == 0:  # JAX keeps the trace (of attend, which lives on): not the table
                    trace(P)
                assert resolved(P) == made.entries[0].config and resolved(causal) == LARGE
            fresh.append(weakref.ref(made))
            del made
            path.write_text(json.dumps(table((P, SMALL if i % 2 else LARGE)).to_dict()))
            os.utime(path, ns=(i * 10**9, i * 10**9))  # a new version of the file each time
            with kernel.tables(path) as block:
                assert resolved(P) == (SMALL if i % 2 else LARGE)
            reloaded.append(weakref.ref(block[0].table))
            del block
        assert _alive(fresh) == 0 and _alive(reloaded) <= 1  # the file's latest version
        with kernel.tables(path):
            assert resolved(P) == SMALL  # its blocks' answers went with the tables, correctly


def test_the_resident_set_stays_flat_over_100_blocks_of_fresh_tables():
    """100 blocks, each with a fresh table of 5,000 entries (about 4 MiB) that resolves P, one
    block in ten tracing: from the tenth block on, the process grows by less than 5 tables
    (kept alive, they grew it by 330 MiB; JAX's caches of the traces take about 5 MiB)."""
    for i in range(100):
        with kernel.tables(table(*((dataclasses.replace(P, kv_len=256 + n), SMALL)
                                   for n in range(5000)))):
            if i % 10 == 0:
                trace(P)
            assert resolved(P) == SMALL
        if i == 9:
            warm = rss_mib()
    assert rss_mib() - warm < 20


def test_a_block_entered_again_names_what_it_answered():
    """Re-entered, a block's traces are cached by JAX: the sources still name the block."""
    small = table((P, SMALL))
    with kernel.tables(small):
        trace(P, lambda q: attend(q) * 2)
    with kernel.tables(small):
        assert kernel.resolution_sources()[("flash", "cpu", P)].startswith("scoped table")


def test_two_threads_each_see_their_own_table():
    step = jax.jit(attend)  # one function, traced by both threads at once
    tables = {"small": table((P, SMALL)), "large": table((P, LARGE))}
    seen: dict[str, tuple[object, str]] = {}
    start = threading.Barrier(2)

    def run(name: str) -> None:
        with kernel.tables(tables[name]):
            start.wait()
            step.lower(jax.ShapeDtypeStruct((1, 1, 256, 128), jnp.float32))
            seen[name] = ran(P)

    threads = [threading.Thread(target=run, args=(name,)) for name in tables]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert seen["small"][0] == SMALL and seen["large"][0] == LARGE
    assert all(source.startswith("scoped table") for _, source in seen.values())


def test_a_block_kernel_choice_picks_the_kernel():
    choice = KernelChoice(P, "xla", get_kernel("xla").default_config(P),
                          {"xla": KernelTiming(1.0), "flash": KernelTiming(2.0)},
                          {"kernel_version": get_kernel("xla").version})
    with kernel.tables(table(choices=(choice,))):
        trace(P)
        _, source = ran(P, "xla")
    assert "chosen (exact choice in scoped table 'flash table on cpu')" in source


def test_a_malformed_table_file_is_refused_before_the_block(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{")
    with pytest.raises(kernel.TableError, match="is not valid JSON"):
        with kernel.tables(path):
            pytest.fail("the block ran")


def test_a_table_prints_as_its_counts_device_and_file_not_its_entries(tmp_path):
    """Issue 62 item 11: ``print(table)`` dumped every entry (10 KB of repr for a real
    table); it says how many entries of which kernel, on which device kind, from which file."""
    many = table(*((dataclasses.replace(P, q_len=128 * n, kv_len=128 * n), SMALL)
                   for n in range(1, 101)))
    assert repr(many) == (f"LookupTable('cpu': entries 100 flash v{FLASH.version}; 0 kernel "
                          "choices)")
    path = tmp_path / "v5e.json"
    path.write_text(json.dumps(many.to_dict()))
    loaded = LookupTable.load(path)
    assert str(loaded) == (f"LookupTable('cpu': entries 100 flash v{FLASH.version}; 0 kernel "
                           f"choices, from {path})")
    assert loaded == many  # where it came from is no part of what it holds
    xla = get_kernel("xla")
    both = dataclasses.replace(many, others=(LookupTable(
        kernel="xla", kernel_version=xla.version, device_kind="cpu",
        entries=(TableEntry(P, xla.default_config(P)),)),))
    path.write_text(json.dumps(both.to_dict()))
    assert repr(LookupTable.load(path)) == (
        f"LookupTable('cpu': entries 100 flash v{FLASH.version}, 1 xla v{xla.version}; 0 "
        f"kernel choices, from {path})")
