"""``autotune.tune_model``: tune every attention problem a model's function uses, in one call.

Captures the problems from an abstract trace (:mod:`autotune.traced`), chooses the kernel of
each as ``autotune tune`` does (every candidate tuned in its own study, their winners
confirmed against each other, the choice published), with the CLI's progress display, and
returns the lookup table of exactly those problems. A problem already tuned (its choice
published for this device under the installed versions, among the same candidates, each
candidate's search finished: :func:`autotune.choice.finished_choice`) is not measured again:
a second call only reads; ``TuneOptions(force=True)`` confirms it again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import typer

from autotune.choice import choose_kernel, finished_choice, local_kernels
from autotune.commands.db import open_store, resolve_url
from autotune.commands.tune import _report, ensure_schema, say_finished
from autotune.progress import TuneProgress
from autotune.traced import captured_problems
from autotune.tune import NothingToPublish, TuneOptions
from kernel import ConfigError, LookupTable, Problem, get_kernel
from storage import Store


def tune_model(fn: Callable[..., Any], *abstract_args: Any, db: str | None = None,
               trials: int = 30, kernels: Sequence[str] | str | None = None,
               timing: str = "auto", json_output: bool = False,
               options: TuneOptions | None = None) -> LookupTable:
    """Tunes the attention problems of ``fn(*abstract_args)`` on the local device and returns
    their lookup table (for ``kernel.tables(...)`` or ``table.to_dict()`` as a file).

    ``abstract_args``: arrays, ``jax.ShapeDtypeStruct`` or pytrees of them (their shapes,
    dtypes and shardings). A sharded step (attention inside ``jax.shard_map``, or arguments
    sharded over a mesh's explicit axes) is tuned for the problem each device computes
    (docs/sharded-training.md). ``db``: the database URL (default ``$AUTOTUNE_DB_URL`` or
    ``sqlite:///autotune.db``). ``trials``: measured configs per kernel and problem.
    ``kernels``: the candidates (names, or ``"a,b"``; default: every registered kernel with
    rules for this device). ``options`` overrides the other tuning settings (its ``trials``
    and ``timing`` give way to the arguments). A problem no candidate could run is left out
    of the table, said so on stderr.
    """
    options = dataclasses.replace(options or TuneOptions(), trials=trials, timing=timing)
    candidates = _candidates(kernels)
    db_url, store = _open(db)
    device_kind = jax.devices()[0].device_kind
    try:
        problems = captured_problems(fn, *abstract_args)
        for problem in problems:
            if finished_choice(store, device_kind, problem, candidates, options):
                say_finished(problem, json_output)
                continue
            try:
                summary = choose_kernel(problem, store, db_url, candidates, options,
                                        observer_for=_progress_for(problem, trials,
                                                                   json_output))
            except (NothingToPublish, ConfigError) as error:  # e.g. too large for the device
                typer.echo(f"error: {error}", err=True)
                continue
            _report(summary.to_dict(), json_output)
        return _table_of(store, device_kind, problems)
    finally:
        store.close()


def _open(db: str | None) -> tuple[str, Store]:
    """The database URL and a store on it, its schema created if it has none; a database
    that cannot be used raises ``RuntimeError`` (the CLI's one-line reason is on stderr)."""
    try:
        db_url = resolve_url(db)
        ensure_schema(db_url)
        return db_url, open_store(db_url)
    except typer.Exit:
        raise RuntimeError(f"cannot tune into database {db or '$AUTOTUNE_DB_URL'}: the "
                           "reason is on stderr above") from None


def _candidates(kernels: Sequence[str] | str | None) -> list[str]:
    if kernels is None:
        return local_kernels()
    names = kernels.split(",") if isinstance(kernels, str) else list(kernels)
    return list(dict.fromkeys(get_kernel(name.strip()).name for name in names))


def _progress_for(problem: Problem, trials: int,
                  json_output: bool) -> Callable[[str], TuneProgress]:
    return lambda name: TuneProgress(problem, trials, json_output=json_output, kernel=name)


def _table_of(store: Store, device_kind: str, problems: Sequence[Problem]) -> LookupTable:
    """The device's table cut to ``problems``: their kernel choices, and each kernel's
    entries for them."""
    wanted = set(problems)

    def cut(table: LookupTable) -> LookupTable:
        return dataclasses.replace(table, entries=tuple(
            e for e in table.entries if e.problem in wanted))

    table = store.export_table(device_kind)
    return dataclasses.replace(
        cut(table), choices=tuple(c for c in table.choices if c.problem in wanted),
        others=tuple(cut(other) for other in table.others))
