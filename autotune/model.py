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
import jax.numpy as jnp
import typer

from autotune.choice import choose_kernel, finished_choice, local_kernels
from autotune.commands.db import open_store, resolve_url
from autotune.commands.tune import _report, ensure_schema, say_finished
from autotune.progress import TuneProgress
from autotune.step_choice import confirm_step_choice, confirmed_before, publish_step_choice
from autotune.traced import captured_problems
from autotune.tune import NothingToPublish, TuneOptions
from kernel import ConfigError, LookupTable, Problem, get_kernel
from storage import Store, shown_url

CONFIRMED_BEFORE = ("step confirmation: kept from an earlier call for this step, nothing tuned "
                    "since (TuneOptions(force=True) tunes and confirms it again)")


def tune_model(fn: Callable[..., Any], *abstract_args: Any, db: str | None = None,
               trials: int = 30, kernels: Sequence[str] | str | None = None,
               timing: str = "auto", json_output: bool = False,
               options: TuneOptions | None = None, confirm_step: bool = False) -> LookupTable:
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

    ``confirm_step``: after tuning, time the whole step ``fn(*abstract_args)`` under the
    tuned table and under each candidate's own tuned table (that kernel at its tuned config
    for every problem), ``options.confirm_rounds`` interleaved rounds, and return another
    table only where it is faster beyond the noise (:mod:`autotune.step_choice`,
    docs/step-choice.md): the kernels' isolated times miss how the compiler schedules the
    rest of the step around them. The outcome is stored on each choice (the lookup service
    and ``autotune export`` answer the returned table) and a changed choice is said in one
    line on stderr. Arguments given as ``jax.ShapeDtypeStruct`` are synthesized for it
    (floats random normal, other types zeros, on the struct's sharding); it costs a compile
    and ``3 * confirm_rounds`` runs of the step per distinct table. A call that tunes nothing
    again, on a step whose choices all carry a confirmation of this step (its jaxpr under
    the stored table, ``autotune.step_choice.step_digest``), keeps it (a rerun only reads;
    one line on stderr).
    """
    options = dataclasses.replace(options or TuneOptions(), trials=trials, timing=timing)
    candidates = _candidates(kernels)
    db_url, store = _open(db)
    device_kind = jax.devices()[0].device_kind
    try:
        problems = captured_problems(fn, *abstract_args)
        tuned_now = False
        for problem in problems:
            if finished_choice(store, device_kind, problem, candidates, options):
                say_finished(problem, json_output)
                continue
            tuned_now = True
            try:
                summary = choose_kernel(problem, store, db_url, candidates, options,
                                        observer_for=_progress_for(problem, trials,
                                                                   json_output))
            except (NothingToPublish, ConfigError) as error:  # e.g. too large for the device
                typer.echo(f"error: {error}", err=True)
                continue
            _report(summary.to_dict(), json_output)
        table = _table_of(store, device_kind, problems)
        if not (confirm_step and table.choices):
            return table
        # A rerun only reads, as the tune does.
        if not tuned_now and confirmed_before(fn, abstract_args, table):
            typer.echo(CONFIRMED_BEFORE, err=True)
            return table
        step = confirm_step_choice(fn, concrete_args(abstract_args), table, candidates,
                                   options.confirm_rounds, options.timing)
        publish_step_choice(store, device_kind, table, step)
        if step.changed:
            typer.echo(step.line(), err=True)
        return _table_of(store, device_kind, problems)
    finally:
        store.close()


def concrete_args(args: Sequence[Any]) -> tuple[Any, ...]:
    """``args`` with each ``jax.ShapeDtypeStruct`` leaf made an array to run the step on:
    floats random normal, other types zeros, on the struct's sharding where it has one."""
    leaves, tree = jax.tree.flatten(tuple(args))
    keys = iter(jax.random.split(jax.random.key(0), max(len(leaves), 1)))
    return jax.tree.unflatten(tree, [_array_for(leaf, next(keys)) for leaf in leaves])


def _array_for(leaf: Any, key: Any) -> Any:
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if jnp.issubdtype(leaf.dtype, jnp.floating):
        array = jax.random.normal(key, leaf.shape, jnp.float32).astype(leaf.dtype)
    else:
        array = jnp.zeros(leaf.shape, leaf.dtype)
    return jax.device_put(array, leaf.sharding) if leaf.sharding is not None else array


def _open(db: str | None) -> tuple[str, Store]:
    """The database URL and a store on it, its schema created if it has none; a database
    that cannot be used raises ``RuntimeError`` (the CLI's one-line reason is on stderr)."""
    try:
        db_url = resolve_url(db)
        ensure_schema(db_url)
        return db_url, open_store(db_url)
    except typer.Exit:
        raise RuntimeError(f"cannot tune into database {shown_url(db or '$AUTOTUNE_DB_URL')}: the "
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
