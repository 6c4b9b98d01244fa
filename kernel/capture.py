"""Capture: the attention problems a function uses, from an abstract trace.

``with kernel.capture() as problems: jax.jit(step).lower(*abstract_args)`` (or
``jax.eval_shape``) records each problem the wrapper resolves inside the block, in the mode
it runs: ``fwd_bwd`` for a call that is differentiated, ``fwd`` for one that is not. Nothing
is compiled or tuned, and no device or data is needed.

The mode is settled per call, not per resolution: the wrapper resolves a call's mode lazily,
when JAX traces it (``kernel.contract.by_mode``), and where JAX traces a primal before
differentiating it (``lax.scan``, ``jax.checkpoint``) one call resolves ``fwd`` and then
``fwd_bwd``. Only the last runs, so a call that resolved ``fwd_bwd`` is a ``fwd_bwd``
problem. Traces cached before the block are not reused inside it
(:func:`kernel.table_scope.retracing`), so a function traced earlier is captured all the same.
Inside the block the wrapper traces each call with its default config, quietly
(:mod:`kernel.scoped_resolver`): a capture asks no table or service and leaves the process's
resolutions as they were.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator, Mapping

from kernel.misses import note as note_miss
from kernel.problem import Problem
from kernel.table_scope import fresh_key, retracing
from kernel.shapesfile import save_shapes


class Call:
    """One ``flash_attention`` call: what its resolutions are grouped by."""

    __slots__ = ()


class Capture:
    """The problems of the calls traced inside a ``kernel.capture()`` block, each once, in
    the order first traced. Iterable; ``save`` writes them as a shapes file."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._modes: dict[Call, dict[str, Problem]] = {}
        self._refused: dict[Problem, dict[str, str]] = {}
        # A call whose per-device problem is known only when its program is lowered (plain
        # jit on several devices: kernel.sharded.unplaced): lower the function to check it.
        self.unplaced = False

    def _note(self, call: Call, problem: Problem, refused: Mapping[str, str]) -> None:
        with self._lock:
            self._modes.setdefault(call, {})[problem.mode] = problem
            self._refused.setdefault(problem, {}).update(refused)

    def refused(self, problem: Problem) -> dict[str, str]:
        """The registered kernels that cannot run ``problem`` where a call traced it (inside
        ``jax.shard_map`` with ``check_vma``, say), each with why."""
        with self._lock:
            return dict(self._refused.get(problem, {}))

    @property
    def problems(self) -> list[Problem]:
        with self._lock:
            calls = [dict(modes) for modes in self._modes.values()]
        return list(dict.fromkeys(modes.get("fwd_bwd") or modes["fwd"] for modes in calls))

    def __iter__(self) -> Iterator[Problem]:
        return iter(self.problems)

    def __len__(self) -> int:
        return len(self.problems)

    def __repr__(self) -> str:
        return f"Capture({[p.label() for p in self.problems]})"

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the problems to ``path`` as a shapes file for ``autotune tune --shapes``."""
        save_shapes(path, self.problems)


_CAPTURES: contextvars.ContextVar[tuple[Capture, ...]] = contextvars.ContextVar(
    "autotune_captures", default=())


def capturing() -> bool:
    """Whether the caller is inside a ``kernel.capture()`` block."""
    return bool(_CAPTURES.get())


@contextlib.contextmanager
def capture() -> Iterator[Capture]:
    """Records the attention problems traced inside the block (see the module docstring)."""
    captured = Capture()
    token = _CAPTURES.set(_CAPTURES.get() + (captured,))
    try:
        with retracing(("capture", fresh_key())):
            yield captured
    finally:
        _CAPTURES.reset(token)


def note_unplaced() -> None:
    """Tells the captures around the caller that a call's per-device problem is checked only
    when its program is lowered (:attr:`Capture.unplaced`)."""
    for captured in _CAPTURES.get():
        captured.unplaced = True


def observe(call: Call, problem: Problem, kernel: str, source: str, detail: str,
            tunable: bool, origin: Problem | None = None,
            refusals: Callable[[], Mapping[str, str]] = dict) -> None:
    """What the wrapper tells of each mode a call resolves: ``problem`` (in that mode) runs
    ``kernel`` with a config from ``source`` (``detail``: why); ``tunable``: the kernel has
    fields to tune for it; ``origin``: the tuned problem the config was borrowed from (the
    nearest entry); ``refusals()``: the kernels that cannot run it there, asked only by a
    capture. Feeds the captures around the caller, else the misses (:mod:`kernel.misses`: an
    abstract trace for a capture runs nothing)."""
    captures = _CAPTURES.get()
    refused = refusals() if captures else {}
    for captured in captures:
        captured._note(call, problem, refused)
    if not captures:
        note_miss(call, problem, kernel, source, detail, tunable, origin)
