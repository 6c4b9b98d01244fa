"""Misses: the problems this process ran on a default config, and why.

The wrapper reports each call's resolution per mode (:func:`note`, through
:func:`kernel.capture.observe`). A call that ran differentiated is a ``fwd_bwd`` problem even
where its primal was traced first (``lax.scan``, ``jax.checkpoint``): only the mode a call
finally ran counts. :func:`untuned` lists the misses; ``AUTOTUNE_RECORD_MISSES=path`` appends
them to a shapes file at exit (``autotune tune --shapes path`` tunes them), safely when
several processes write the same file.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from kernel.problem import Problem
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

    problem: Problem
    kernel: str
    reason: str
    detail: str


def miss_reason(detail: str) -> str:
    """The reason class of a default resolution's detail (``Resolution.detail``)."""
    if "illegal here" in detail:
        return ILLEGAL
    if "kernel version" in detail:
        return STALE
    return NO_ENTRY


_lock = threading.Lock()
_calls: dict[Any, dict[str, Miss | None]] = {}  # call -> mode -> its miss (None: tuned)
_exit_hook = False


def note(call: Any, problem: Problem, kernel: str, source: str, detail: str,
         tunable: bool) -> None:
    """Records how ``call`` resolved ``problem`` (its mode included) with ``kernel``."""
    global _exit_hook
    miss = (Miss(problem, kernel, miss_reason(detail), detail)
            if tunable and source == "default" else None)
    with _lock:
        _calls.setdefault(call, {})[problem.mode] = miss
        if not _exit_hook:
            atexit.register(_record_at_exit)
            _exit_hook = True


def untuned() -> list[Miss]:
    """The problems this process ran on a default config, each once, first seen first."""
    with _lock:
        calls = [dict(modes) for modes in _calls.values()]
    out: dict[Problem, Miss] = {}
    for modes in calls:
        miss = modes.get("fwd_bwd", modes.get("fwd"))
        if miss is not None:
            out.setdefault(miss.problem, miss)
    return list(out.values())


def record(path: str | os.PathLike[str]) -> int:
    """Appends the misses' problems to the shapes file ``path``; how many were new there."""
    return append_shapes(path, [miss.problem for miss in untuned()])


def _record_at_exit() -> None:
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    try:
        record(path)
    except OSError as error:
        log.error("flash-autotune: cannot record the untuned problems in %s=%s: %s",
                  RECORD_ENV, path, error)
