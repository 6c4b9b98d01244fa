"""Misses: the problems this process ran on a default config, and why; and the problems it
ran on a config borrowed from the nearest tuned problem (a table's or the service's nearest
entry), which have no config of their own either.

The wrappers report each call's resolution per mode (:func:`note`, through
:func:`kernel.capture.observe`; ``kernel.ragged_paged_attention`` its serving step's). A call
that ran differentiated is a ``fwd_bwd`` problem even where its primal was traced first
(``lax.scan``, ``jax.checkpoint``): only the mode a call finally ran counts. :func:`untuned`
lists the misses, :func:`borrowed` the borrowers; ``AUTOTUNE_RECORD_MISSES=path`` appends both
to a shapes file at exit, each borrower's line marked with the problem it borrowed from
(``autotune tune --shapes path`` tunes the attention calls, ``autotune tune --kernel rpa
--shapes path`` the serving steps), safely when several processes write the same file.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, TypeVar

from kernel.problem import Problem
from kernel.serving import ServingProblem
from kernel.shapesfile import append_shapes

log = logging.getLogger(__name__)

RECORD_ENV = "AUTOTUNE_RECORD_MISSES"
NO_ENTRY, STALE, ILLEGAL = "no entry", "stale", "illegal here"


@dataclass(frozen=True)
class Miss:
    """A problem that ran ``kernel`` on its default config: ``reason`` is one of ``no
    entry`` (nothing tuned answered), ``stale`` (tuned for another version of the kernel) or
    ``illegal here`` (the tuned config breaks a rule on this device); ``detail`` is the
    resolver's full account."""

    problem: Problem | ServingProblem
    kernel: str
    reason: str
    detail: str


@dataclass(frozen=True)
class Borrowed:
    """A problem that ran ``kernel`` on the config tuned for another problem, ``origin``: the
    nearest entry ``source`` (``table`` or ``service``) had. Tuning it gives it its own."""

    problem: Problem | ServingProblem
    kernel: str
    source: str
    origin: Problem | ServingProblem

    def note(self) -> str:
        """Its mark in a shapes file."""
        return f"{BORROWED_FROM} {self.origin.label()} (the nearest {self.source} entry)"


BORROWED_FROM = "borrowed from"
Record = TypeVar("Record", Miss, Borrowed)


def miss_reason(detail: str) -> str:
    """The reason class of a default resolution's detail (``Resolution.detail``)."""
    if "illegal here" in detail:
        return ILLEGAL
    if "kernel version" in detail:
        return STALE
    return NO_ENTRY


_lock = threading.Lock()
# call -> mode -> its miss or borrowing (None: tuned for it)
_calls: dict[Any, dict[str, Miss | Borrowed | None]] = {}
_exit_hook = False


def note(call: Any, problem: Problem | ServingProblem, kernel: str, source: str, detail: str,
         tunable: bool, origin: Problem | ServingProblem | None = None) -> None:
    """Records how ``call`` resolved ``problem`` (its mode included) with ``kernel``;
    ``origin``: the tuned problem whose config it borrowed, when its source's entry was the
    nearest, not its own."""
    global _exit_hook
    found: Miss | Borrowed | None = None
    if tunable and source == "default":
        found = Miss(problem, kernel, miss_reason(detail), detail)
    elif tunable and origin is not None:
        found = Borrowed(problem, kernel, source, origin)
    with _lock:
        _calls.setdefault(call, {})[problem.mode] = found
        if not _exit_hook:
            atexit.register(_record_at_exit)
            _exit_hook = True


def untuned() -> list[Miss]:
    """The problems this process ran on a default config, each once, first seen first."""
    return _each_once(Miss)


def borrowed() -> list[Borrowed]:
    """The problems this process ran on a config borrowed from the nearest tuned problem,
    each once, first seen first."""
    return _each_once(Borrowed)


def _each_once(kind: type[Record]) -> list[Record]:
    """The calls' records of ``kind`` in the mode each call ran, each problem once."""
    with _lock:
        calls = [dict(modes) for modes in _calls.values()]
    out: dict[Problem | ServingProblem, Record] = {}
    for modes in calls:
        found = modes.get("fwd_bwd", modes.get("fwd"))
        if isinstance(found, kind):
            out.setdefault(found.problem, found)
    return list(out.values())


def record(path: str | os.PathLike[str]) -> int:
    """Appends the misses' and borrowers' problems to the shapes file ``path`` (each borrower
    marked with what it borrowed from); how many were new there. A serving step's
    (``kernel.ragged_paged_attention``) are recorded as an attention call's are: ``autotune
    tune --kernel rpa --shapes path`` tunes them, ``autotune tune --shapes path`` the
    attention calls."""
    lent = borrowed()
    return append_shapes(path, [miss.problem for miss in untuned()]
                         + [b.problem for b in lent], {b.problem: b.note() for b in lent})


def _record_at_exit() -> None:
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    try:
        record(path)
    except OSError as error:
        log.error("flash-autotune: cannot record the untuned problems in %s=%s: %s",
                  RECORD_ENV, path, error)
