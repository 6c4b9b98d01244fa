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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import typer

from autotune.choice import choose_kernel, finished_choice, local_kernels
from autotune.commands.db import open_store, resolve_url
from autotune.commands.tune import _report, ensure_schema, say_finished
from autotune.progress import TuneProgress
from autotune.step_choice import confirm_step_choice, confirmed_before, publish_step_choice
from autotune.failures import Status
from autotune.traced import captured_calls
from autotune.tune import NothingToPublish, TuneOptions
from kernel import Capture, ConfigError, LookupTable, Problem, get_kernel
from kernel.table import KernelChoice, KernelTiming
from storage import Store, shown_url

RESTRICTED = "restricted_to"  # a returned choice's provenance: the candidates it was cut to
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
        sites = _call_sites(captured_calls(fn, *abstract_args), candidates)
        with jax.set_mesh(None):  # each problem is measured on one device, not the step's mesh
            tuned_now = _tune_each(sites, store, db_url, device_kind, options, json_output)
        table = _table_of(store, device_kind, sites)
        if not (confirm_step and table.choices):
            return table
        # A rerun only reads, as the tune does.
        if not tuned_now and confirmed_before(fn, abstract_args, table):
            typer.echo(CONFIRMED_BEFORE, err=True)
            return table
        step = confirm_step_choice(fn, concrete_args(abstract_args), table, candidates,
                                   options.confirm_rounds, options.timing)
        publish_step_choice(store, device_kind, dataclasses.replace(table, choices=tuple(
            c for c in table.choices if RESTRICTED not in c.provenance)), step)
        if step.changed:
            typer.echo(step.line(), err=True)
        return _table_of(store, device_kind, sites)
    finally:
        store.close()


@dataclass(frozen=True)
class Site:
    """The candidates that can run a problem where the step calls it, and those that cannot
    there (inside ``jax.shard_map`` with ``check_vma``, say), each with why."""

    runnable: tuple[str, ...]
    refused: Mapping[str, str]


def _call_sites(calls: Capture, candidates: Sequence[str]) -> dict[Problem, Site]:
    """The site of each captured problem some candidate can run there; the candidates refused
    there are said on stderr, and a problem none can run there is left out (said so)."""
    sites = {}
    for problem in calls.problems:
        refused = {name: why for name, why in calls.refused(problem).items()
                   if name in candidates}
        runnable = tuple(name for name in candidates if name not in refused)
        for name, why in refused.items():
            typer.echo(f"{problem.label()}: {name} is not tuned: it cannot run where the "
                       f"step calls it ({why})", err=True)
        if runnable:
            sites[problem] = Site(runnable, refused)
        else:
            typer.echo(f"error: no candidate kernel ({', '.join(candidates)}) can run "
                       f"{problem.label()} where the step calls it; left out of the table",
                       err=True)
    return sites


def _tune_each(sites: Mapping[Problem, Site], store: Store, db_url: str, device_kind: str,
               options: TuneOptions, json_output: bool) -> bool:
    """Chooses the kernel of each problem among the candidates that run at its site, unless
    finished before (a line on stderr for one no candidate runs); whether any was tuned now."""
    tuned_now = False
    for problem, site in sites.items():
        candidates = site.runnable
        if finished_choice(store, device_kind, problem, candidates, options):
            say_finished(problem, json_output)
            continue
        tuned_now = True
        try:
            summary = choose_kernel(problem, store, db_url, candidates, options,
                                    observer_for=_progress_for(problem, options.trials,
                                                               json_output))
        except (NothingToPublish, ConfigError) as error:  # e.g. too large for the device
            typer.echo(f"error: {error}", err=True)
            continue
        _report(summary.to_dict(), json_output)
    return tuned_now


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


def _table_of(store: Store, device_kind: str, sites: Mapping[Problem, Site]) -> LookupTable:
    """The device's table cut to the problems of ``sites``: each kernel's entries for them,
    and their kernel choices among the candidates that run at their site
    (:func:`_restricted`)."""
    wanted = set(sites)

    def cut(table: LookupTable) -> LookupTable:
        return dataclasses.replace(table, entries=tuple(
            e for e in table.entries if e.problem in wanted))

    exported = store.export_table(device_kind)
    table = dataclasses.replace(cut(exported), others=tuple(cut(t) for t in exported.others))
    choices = (_restricted(c, sites[c.problem], table) for c in exported.choices
               if c.problem in wanted)
    return dataclasses.replace(table, choices=tuple(c for c in choices if c is not None))


def _restricted(choice: KernelChoice, site: Site, table: LookupTable) -> KernelChoice | None:
    """``choice`` among the candidates of ``site`` only (``kernels=``, less those refused at
    the call site): itself when made among them, else the fastest of them it measured at its
    tuned config in ``table``, the refused recorded as ``illegal`` and the cut in its
    provenance (``restricted_to``); None when it measured none of them."""
    allowed = set(site.runnable)
    if set(choice.candidates) <= allowed and not site.refused:
        return choice
    timings = choice.candidates
    kernel = next((name for name in choice.ranked() if name in allowed
                   and timings.get(name, KernelTiming()).median_ms is not None), None)
    if kernel == choice.kernel:
        config, provenance = choice.config, choice.provenance
    else:  # another kernel: its tuned entry, of its table's version
        found = next(((e.config, t.kernel_version) for t in table.kernel_tables()
                      if t.kernel == kernel for e in t.entries if e.problem == choice.problem),
                     None)
        if found is None:
            return None
        config, provenance = found[0], {**choice.provenance, "kernel_version": found[1]}
    candidates = {**{name: t for name, t in timings.items() if name in allowed},
                  **{name: KernelTiming(failure=Status.ILLEGAL) for name in site.refused}}
    return dataclasses.replace(choice, kernel=kernel, config=config, candidates=candidates,
                               provenance={**provenance, RESTRICTED: site.runnable})
