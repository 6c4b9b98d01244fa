"""Resolution inside ``kernel.tables`` blocks: each block's tables first, the innermost block
first, then the process's resolver (pinned tables, service, default).

A block resolves with a resolver of its own over its tables only (no service), whose answers
are final when its tables gave them (a kernel choice, or a config the rules accept here);
what they do not answer goes to the next block out, and last to the process's resolver, as
outside any block. ``resolution_sources()`` names the block that answered. One chain of
resolvers per set of blocks (and tables) is kept for the process: the blocks entered again
reuse their answers.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import threading
from collections.abc import Iterator
from typing import Any

from kernel.capture import capturing
from kernel.problem import Problem
from kernel.resolve import Key, KernelPick, Resolution, Resolver, get_resolver
from kernel.table_scope import Block, active_blocks
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


class ScopedResolver:
    """The resolver of one block (its tables only), falling back to ``outer``; answers the
    wrapper's ``pick``, ``resolve``, ``platform_kernel`` and ``sources`` as a ``Resolver``."""

    def __init__(self, block: Block, outer: Resolver | ScopedResolver,
                 base: Resolver) -> None:
        self.outer, self.base = outer, base
        self.name = ", ".join(scoped.name for scoped in block)
        self.own = Resolver(dataclasses.replace(base.settings, table_paths=(), url=None))
        for scoped in block:
            self.own.pin(scoped.table, f"{scoped.name}#{scoped.serial}")
        self._lock = threading.Lock()
        self._picked: set[Key] = set()  # keys whose kernel this block's choice picked
        self._answered: dict[Key, Resolution] = {}

    def platform_kernel(self, platform: str) -> Any:
        return self.outer.platform_kernel(platform)

    def pick(self, problem: Problem, device_kind: str, platform: str,
             target: Target) -> KernelPick:
        with _quiet():
            pick = self.own.pick(problem, device_kind, platform, target)
        if pick.choice is None:
            return self.outer.pick(problem, device_kind, platform, target)
        with self._lock:
            self._picked.add((pick.kernel.name, device_kind, problem))
        return dataclasses.replace(pick, by=self._named(pick.by))

    def resolve(self, problem: Problem, device_kind: str, kernel_name: str, target: Target,
                kernel_by: str = "") -> Resolution:
        key = (kernel_name, device_kind, problem)
        with _quiet():
            own = self.own.resolve(problem, device_kind, kernel_name, target, kernel_by)
        answered = own.source != "default" or (
            key in self._picked and not self.own.kernel(kernel_name).space_params(problem))
        if not answered:
            return self.outer.resolve(problem, device_kind, kernel_name, target, kernel_by)
        with self._lock:
            self._answered[key] = own
        return own

    def sources(self) -> dict[Key, str]:
        """The outer sources, with the keys this block answered named by it."""
        with self._lock:
            answered = dict(self._answered)
        return {**self.outer.sources(),
                **{key: self._described(resolution, key) for key, resolution in answered.items()}}

    def _named(self, text: str) -> str:
        return text.replace("in pinned table", f"in scoped table {self.name!r}")

    def _described(self, resolution: Resolution, key: Key) -> str:
        text = self._named(resolution.describe(key[2].mode, key[0]))
        return (f"scoped table {self.name!r}{text[len('table'):]}"
                if resolution.source == "table" else text)


_chains: dict[tuple[Any, ...], ScopedResolver] = {}
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
            known = _default_resolvers[id(base)] = (base, Resolver(dataclasses.replace(
                base.settings, table_paths=(), url=None)))
    return known[1]


def _chain(base: Resolver, blocks: tuple[Block, ...]) -> ScopedResolver:
    """The resolver of ``blocks[0]`` over those of the blocks around it, kept per blocks."""
    key = (id(base), blocks)
    with _chains_lock:
        chain = _chains.get(key)
    if chain is not None and chain.base is base:
        return chain
    made = ScopedResolver(blocks[0], _chain(base, blocks[1:]) if blocks[1:] else base, base)
    with _chains_lock:  # another thread may have made it meanwhile: one chain per key
        chain = _chains.get(key)
        if chain is None or chain.base is not base:
            chain = _chains[key] = made
    return chain


def resolution_sources() -> dict[Key, str]:
    """How each key traced so far in this process was resolved: ``table``, ``service`` or
    ``default``, marked ``(stale: ...)`` when tuned under other jax/jaxlib/libtpu versions and
    followed by ``; kernel: ...`` when a kernel choice picked the key's kernel (which ran).
    Inside ``kernel.tables`` blocks, the keys a block answered name it (``scoped table
    'path'``)."""
    return active_resolver().sources()
