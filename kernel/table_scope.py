"""Scoped lookup tables: ``with kernel.tables(table_or_path):`` overlays tables for the code
inside the block only.

The scopes live in a context variable, so they are local to a thread (and an asyncio task)
and nest, the innermost first. A block also keys JAX's tracing caches (a JAX user context), so
a function traced outside the block, or under other tables, is traced again inside it and
resolves its configs from the block's tables. :func:`retracing` gives :mod:`kernel.capture`
the same fresh trace. :func:`retrace_all` keys every trace anew, inside blocks too, when the
process's pinned tables change (``kernel.use_table``). jax loads only when a block is entered.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernel.table import LookupTable


@dataclass(frozen=True)
class ScopedTable:
    """A table of a ``kernel.tables`` block, the name sources give it (its path, or
    ``<kernel> table on <device kind>`` for a table object) and the serial of the table
    object (equal while it is the same object)."""

    table: LookupTable = field(compare=False)
    name: str
    serial: int


Block = tuple[ScopedTable, ...]  # the tables of one block, in the order given
_SCOPES: contextvars.ContextVar[tuple[Block, ...]] = contextvars.ContextVar(
    "autotune_table_scopes", default=())  # innermost block first
_TRACE_KEY: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
    "autotune_trace_key", default=())
_serials = itertools.count(1)
_lock = threading.Lock()
_loaded: dict[str, tuple[tuple[int, int], LookupTable]] = {}  # path -> (mtime, size), table
_table_serials: dict[int, tuple[weakref.ref[LookupTable], int]] = {}  # by id, while alive
_live_serials: set[int] = set()  # the serials of the tables alive
# JAX user contexts, made once: the blocks' keys (set per thread by a block), and the
# generation of the process's pinned tables (set globally: it reaches traces inside blocks).
_jax_contexts: tuple[Any, Any] | None = None
_pinnings = itertools.count(1)


def active_blocks() -> tuple[Block, ...]:
    """The ``kernel.tables`` blocks around the caller, innermost first."""
    return _SCOPES.get()


@contextlib.contextmanager
def tables(*tables_or_paths: LookupTable | str | os.PathLike[str]) -> Iterator[Block]:
    """Overlays lookup tables (``LookupTable`` objects or table files) for the code inside
    the block: traced there, the wrapper resolves kernel choices and configs from them first
    (the first given first; an inner block before an outer one), then from the process's
    pinned tables (``kernel.use_table``), the service and the default. Raises ``TableError``
    naming a malformed file before the block runs."""
    if not tables_or_paths:
        raise TypeError("kernel.tables() needs at least one table or table file")
    block = tuple(_scoped(item) for item in tables_or_paths)
    token = _SCOPES.set((block, *_SCOPES.get()))
    try:
        with retracing(tuple(s.serial for s in block)):
            yield block
    finally:
        _SCOPES.reset(token)


@contextlib.contextmanager
def retracing(key: Any) -> Iterator[None]:
    """Keys JAX's tracing caches by ``key`` (with the keys of the blocks around it) inside the
    block: a function traced under another key is traced again."""
    token = _TRACE_KEY.set(_TRACE_KEY.get() + (key,))
    try:
        with _user_contexts()[0](_TRACE_KEY.get()):
            yield
    finally:
        _TRACE_KEY.reset(token)


def retrace_all() -> None:
    """Keys JAX's tracing caches anew, in every thread and block: a function traced before is
    traced again on its next call, and resolves its configs from the process's tables as they
    are now. Nothing was traced before jax loaded."""
    if "jax" not in sys.modules:
        return
    _user_contexts()[1].set_global(next(_pinnings))


def fresh_key() -> int:
    """A key no block used before (for :func:`retracing`)."""
    return next(_serials)


def _scoped(item: LookupTable | str | os.PathLike[str]) -> ScopedTable:
    if isinstance(item, LookupTable):
        kernels = "+".join(t.kernel for t in item.kernel_tables() if t.entries) or item.kernel
        return ScopedTable(item, f"{kernels} table on {item.device_kind}", _serial(item))
    if isinstance(item, (str, os.PathLike)):
        table = _load(Path(item))
        return ScopedTable(table, str(item), _serial(table))
    raise TypeError(f"kernel.tables takes LookupTable objects or table file paths, got "
                    f"{type(item).__name__}")


def _load(path: Path) -> LookupTable:
    """The table of a file, loaded once per version of the file (so a block entered again
    reuses its traces)."""
    try:
        stat = path.stat()
    except OSError:
        return LookupTable.load(path)  # raises the TableError naming the file
    key, version = str(path.resolve()), (stat.st_mtime_ns, stat.st_size)
    with _lock:
        known = _loaded.get(key)
    if known is not None and known[0] == version:
        return known[1]
    table = LookupTable.load(path)
    with _lock:
        _loaded[key] = (version, table)
    return table


def _serial(table: LookupTable) -> int:
    """A number naming this table object while it lives (an id can be reused after)."""
    with _lock:
        known = _table_serials.get(id(table))
        if known is not None and known[0]() is table:
            return known[1]
        for gone in [key for key, (ref, _) in _table_serials.items() if ref() is None]:
            del _table_serials[gone]
        serial = next(_serials)
        # The callback takes no lock (the collector may run it where one is held): a set's
        # discard is atomic.
        _table_serials[id(table)] = (
            weakref.ref(table, lambda _, serial=serial: _live_serials.discard(serial)), serial)
        _live_serials.add(serial)
        return serial


def alive(serial: int) -> bool:
    """Whether the table a serial names is alive (else no block can use it again)."""
    return serial in _live_serials


def _user_contexts() -> tuple[Any, Any]:
    """The JAX user contexts keying traces by the scopes and by the pinning generation, made
    once (JAX asks that they are not made concurrently with other JAX calls: the first caller
    makes them under a lock)."""
    global _jax_contexts
    with _lock:
        if _jax_contexts is None:
            import jax

            _jax_contexts = (jax.make_user_context(()), jax.make_user_context(0))
    return _jax_contexts
