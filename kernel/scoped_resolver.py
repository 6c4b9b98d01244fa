"""Resolution inside ``kernel.tables`` blocks: each block's tables first, the innermost block
first, then the process's resolver (pinned tables, service, default).

A block resolves with a resolver of its own over its tables only (no service), whose answers
are final when its tables gave them (a kernel choice, or a config the rules accept here);
what they do not answer goes to the next block out, and last to the process's resolver, as
outside any block. ``resolution_sources()`` names the block that answered. A block's resolver
(its tables and their indexes) lives as long as the block's entry, so a table no block uses
is freed; what its tables answered is kept while they live, for a block entered again.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import logging
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kernel.capture import capturing
from kernel.problem import Problem
from kernel.resolve import Key, KernelPick, Resolution, Resolver, get_resolver, warn_next_best
from kernel.table_scope import Block, ScopedTable, active_blocks, alive
from kernel.targets import Target

_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("autotune_quiet", default=False)


class _QuietFilter(logging.Filter):
    """Drops the resolver's fallback warnings of a block that does not answer a key (the
    next block out, or the process's resolver, answers and warns), and of a capture."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_QUIET.get() or capturing())


logging.getLogger("kernel.resolve").addFilter(_QuietFilter())


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


@dataclass
class _Memory:
    """What a block's tables answered (keys whose kernel its choice picked, resolutions),
    kept while its tables live: a block entered again names them, though JAX reuses its
    traces and asks nothing."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    picked: set[Key] = field(default_factory=set)
    answered: dict[Key, Resolution] = field(default_factory=dict)


class ScopedResolver:
    """The resolver of one block (its tables only), falling back to ``outer``; answers the
    wrapper's ``pick``, ``resolve``, ``platform_kernel`` and ``sources`` as a ``Resolver``.
    ``own`` resolves from the block's tables while the block's entry lasts; ``memory`` keeps
    what they answered. A trace keeps its resolver (JAX caches the trace, and may run its
    backward rule later): it holds ``own`` weakly, so the tables are freed with the entry,
    and answers from ``memory`` after it."""

    def __init__(self, block: Block, outer: Resolver | ScopedResolver, own: Resolver,
                 memory: _Memory) -> None:
        self.outer, self.memory = outer, memory
        self._own = weakref.ref(own)
        self.name = ", ".join(scoped.name for scoped in block)

    def platform_kernel(self, platform: str) -> Any:
        return self.outer.platform_kernel(platform)

    def pick(self, problem: Problem, device_kind: str, platform: str,
             target: Target) -> KernelPick:
        own = self._own()
        if own is None:  # the block's entry is over
            return self.outer.pick(problem, device_kind, platform, target)
        with _quiet():
            pick = own.pick(problem, device_kind, platform, target)
        if pick.choice is None:
            return self.outer.pick(problem, device_kind, platform, target)
        key = (pick.kernel.name, device_kind, problem)
        with self.memory.lock:
            first = key not in self.memory.picked
            self.memory.picked.add(key)
        by = self._named(pick.by)
        if first and pick.kernel.name != pick.choice.kernel:  # its warning was quieted above
            warn_next_best(pick.kernel.name, problem, device_kind, pick.choice.kernel, by)
        return dataclasses.replace(pick, by=by)

    def resolve(self, problem: Problem, device_kind: str, kernel_name: str, target: Target,
                kernel_by: str = "") -> Resolution:
        key = (kernel_name, device_kind, problem)
        resolver = self._own()
        if resolver is None:  # the block's entry is over: what it answered, else the outer's
            with self.memory.lock:
                kept = self.memory.answered.get(key)
            return kept or self.outer.resolve(problem, device_kind, kernel_name, target,
                                              kernel_by)
        with _quiet():
            own = resolver.resolve(problem, device_kind, kernel_name, target, kernel_by)
        answered = own.source != "default" or (
            key in self.memory.picked and not resolver.kernel(kernel_name).space_params(problem))
        if not answered:
            return self.outer.resolve(problem, device_kind, kernel_name, target, kernel_by)
        with self.memory.lock:
            self.memory.answered[key] = own
        return own

    def sources(self) -> dict[Key, str]:
        """The outer sources, with the keys this block answered named by it."""
        with self.memory.lock:
            answered = dict(self.memory.answered)
        return {**self.outer.sources(),
                **{key: self._described(resolution, key) for key, resolution in answered.items()}}

    def _named(self, text: str) -> str:
        return text.replace("in pinned table", f"in scoped table {self.name!r}")

    def _described(self, resolution: Resolution, key: Key) -> str:
        text = self._named(resolution.describe(key[2].mode, key[0]))
        return (f"scoped table {self.name!r}{text[len('table'):]}"
                if resolution.source == "table" else text)


# A block entry's resolver over its tables (and their indexes), by the entry's first table,
# with the base it falls back to and the serials of its tables: it goes with the entry (the
# block's context), so a table no block uses is freed.
_own: weakref.WeakKeyDictionary[ScopedTable, tuple[Resolver, tuple[int, ...], Resolver]] = \
    weakref.WeakKeyDictionary()
_memories: dict[tuple[Any, ...], _Memory] = {}  # by (id(base), the blocks' table serials)
_default_resolvers: dict[int, tuple[Resolver, Resolver]] = {}  # id(base) -> (base, theirs)
_chains_lock = threading.Lock()


def active_resolver() -> Resolver | ScopedResolver:
    """The resolver of a trace here: the innermost block's, or the process's outside any;
    in a capture, one of the default configs only (a capture needs none tuned)."""
    if capturing():
        return _defaults(get_resolver())
    blocks = active_blocks()
    return _chain(get_resolver(), blocks) if blocks else get_resolver()


def _defaults(base: Resolver) -> Resolver:
    """A resolver with the settings of ``base`` but no table and no service, kept per base."""
    with _chains_lock:
        known = _default_resolvers.get(id(base))
        if known is None or known[0] is not base:
            known = _default_resolvers[id(base)] = (base, _tableless(base))
    return known[1]


def _tableless(base: Resolver) -> Resolver:
    """No table, no service, never strict: what it does not answer goes to ``base``."""
    return Resolver(dataclasses.replace(base.settings, table_paths=(), url=None, strict=""))


def _chain(base: Resolver, blocks: tuple[Block, ...]) -> ScopedResolver:
    """The resolver of ``blocks[0]`` over those of the blocks around it."""
    outer = _chain(base, blocks[1:]) if blocks[1:] else base
    return ScopedResolver(blocks[0], outer, _own_resolver(base, blocks[0]),
                          _memory(base, blocks))


def _own_resolver(base: Resolver, block: Block) -> Resolver:
    """The resolver over ``block``'s tables for this entry of the block (one per entry, made
    by one thread: the others use it)."""
    serials = tuple(scoped.serial for scoped in block)
    with _chains_lock:
        known = _own.get(block[0])
        if known is not None and known[0] is base and known[1] == serials:
            return known[2]
        own = _tableless(base)
        for scoped in block:
            own.pin(scoped.table, f"{scoped.name}#{scoped.serial}")
        _own[block[0]] = (base, serials, own)
        return own


def _memory(base: Resolver, blocks: tuple[Block, ...]) -> _Memory:
    """The memory of ``blocks`` (by their tables' serials), made on first use; the memories
    of blocks whose tables were freed are dropped then."""
    key = (id(base), tuple(tuple(scoped.serial for scoped in block) for block in blocks))
    with _chains_lock:
        memory = _memories.get(key)
        if memory is None:
            for gone in [known for known in _memories if not all(
                    map(alive, itertools.chain.from_iterable(known[1])))]:
                del _memories[gone]
            memory = _memories[key] = _Memory()
        return memory


def resolution_sources() -> dict[Key, str]:
    """How each key traced so far in this process was resolved: ``table``, ``service`` or
    ``default``, marked ``(stale: ...)`` when tuned under other jax/jaxlib/libtpu versions or a
    retired timing method, and followed by ``; kernel: ...`` when a kernel choice picked the
    key's kernel (which ran).
    Inside ``kernel.tables`` blocks, the keys a block answered name it (``scoped table
    'path'``)."""
    return active_resolver().sources()
