"""``autotune export`` / ``autotune import``: lookup tables (kernel.table JSON) to and from the
database."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from autotune.commands.db import (
    DbOption,
    database_errors,
    ensure_schema,
    open_store,
    reading_store,
    resolve_url,
)
from autotune.files import is_stdout, write_output
from autotune.problem_options import (ShapesOption, given_problems, kernel_option, output_file,
                                      problem_flags_given, with_problem_options)
from kernel import AutotuneError, LookupTable, Problem, TableError, kernel_names
from kernel.registry import SERVING_KERNELS, registered_kernel
from kernel.serving import jax_device_key
from present.text import counted

FORMATS = ("table", "maxtext", "jax-rpa")
known_table_kernel = kernel_option(registered_kernel)  # a kernel of either problem type


@with_problem_options
def export_table(
    context: typer.Context,
    problem: Problem,
    output: Annotated[Path | None, typer.Option(
        "-o", "--output", parser=output_file, metavar="<file>", show_default=False,
        help="Where to write the table, - for stdout (with --format maxtext: the flags; "
             "default: print them).")] = None,
    format_: Annotated[str, typer.Option(
        "--format", help="table (a lookup table of every tuned shape), maxtext (MaxText's "
                         "sa_* flags, local_sa_* for a shape with a window, of the splash "
                         "config of the shape the problem flags or --shapes give; of several "
                         "shapes: each layer type's config best for its shapes together) or "
                         "jax-rpa (JAX's TUNED_BLOCK_SIZES of ragged paged attention from the "
                         "tuned serving configs: a Python module, -o, and the same as JSON "
                         "beside it).")] = "table",
    shapes: ShapesOption = None,
    device_kind: Annotated[str | None, typer.Option(
        help="Device kind as JAX reports it, e.g. 'TPU v5 lite' (default: the only one stored).",
        show_default=False)] = None,
    kernel: Annotated[str | None, typer.Option(
        callback=known_table_kernel, show_default=False,
        help="Only this kernel's configs, and a table that runs it wherever it was tuned "
             "(choices of other kernels left out). Default: the default kernel's configs, "
             "those of every kernel a stored choice names, and every choice.")] = None,
    kernel_version: Annotated[str | None, typer.Option(
        help="Kernel version of --kernel (default: the installed kernel's).",
        show_default=False)] = None,
    jax_device_key_too: Annotated[bool, typer.Option(
        "--jax-device-key", help="With --format jax-rpa: the entries under JAX's two-word "
                                 "device key too (e.g. 'TPU v5', which the v5e and the v5p "
                                 "share), besides the full device kind.")] = False,
    db: DbOption = None,
) -> None:
    """Write the tuned configs of one device kind, and its kernel choices, as a lookup table to
    pin in a model build; or, with --format maxtext, MaxText's sa_* (and local_sa_*) flags
    for one shape (or for the shapes of --shapes, each layer type's together)."""
    if format_ == "maxtext":
        _export_maxtext(given_problems(context, problem, shapes), output, device_kind, kernel,
                        kernel_version, db)
        return
    if format_ not in FORMATS:
        raise typer.BadParameter(f"{format_!r}: use {', '.join(FORMATS)}", param_hint="--format")
    given = [*problem_flags_given(context), *(["--shapes"] if shapes else [])]
    if given:
        raise typer.BadParameter(f"a table holds every tuned shape; {', '.join(given)} "
                                 "pick(s) the shape of --format maxtext", param_hint="--format")
    if output is None:
        raise typer.BadParameter("give the file to write the table to (- for stdout)",
                                 param_hint="-o")
    if format_ == "jax-rpa":
        _export_jax_rpa(output, device_kind, kernel, kernel_version, jax_device_key_too, db)
        return
    device_kind = _stored_device_kind(device_kind, kernel, db)
    with reading_store(db) as store:
        table = store.export_table(device_kind, kernel=kernel, kernel_version=kernel_version)
        others = [] if kernel else [name for name in kernel_names() if name != table.kernel
                                    and device_kind in store.device_kinds(name)]
    if not table.entries and not table.choices:
        typer.echo(f"error: no tuned configs of {table.kernel!r} version "
                   f"{table.kernel_version!r} on {device_kind!r}"
                   + (f"; the database holds configs of {', '.join(others)} there: export "
                      f"them with --kernel {others[0]}" if others else ""), err=True)
        raise typer.Exit(1)
    try:
        write_output(output, (json.dumps(table.to_dict(), indent=2) + "\n").encode())
    except OSError as error:
        typer.echo(f"error: cannot write {output}: {error.strerror}", err=True)
        raise typer.Exit(1) from None
    counts = ", ".join(f"{len(t.entries)} {t.kernel}" for t in table.kernel_tables())
    typer.echo(f"wrote entries ({counts}) and {counted(len(table.choices), 'kernel choice')} for "
               f"{device_kind!r} to {output}", err=is_stdout(output))


def _export_jax_rpa(output: Path, device_kind: str | None, kernel: str | None,
                    kernel_version: str | None, jax_device_key_too: bool,
                    db: str | None) -> None:
    """Writes JAX's TUNED_BLOCK_SIZES of the tuned serving configs to ``output`` (a Python
    module) and beside it as JSON (``autotune.jax_rpa``); what JAX's table cannot hold is
    reported on stderr."""
    from autotune.jax_rpa import jax_table

    serving = next(iter(SERVING_KERNELS))
    if kernel not in (None, serving):
        raise typer.BadParameter(f"JAX's ragged paged attention table holds {serving!r} "
                                 f"configs; leave --kernel out or give --kernel {serving}",
                                 param_hint="--kernel")
    if is_stdout(output) or output.suffix != ".py":
        raise typer.BadParameter("give the Python module to write, e.g. "
                                 "tuned_block_sizes_v5e.py (its JSON goes beside it)",
                                 param_hint="-o")
    device_kind = _stored_device_kind(device_kind, serving, db)
    with reading_store(db) as store:
        table = store.export_table(device_kind, kernel=serving, kernel_version=kernel_version)
    converted = jax_table(table)
    if not converted.entries:
        typer.echo(f"error: no tuned {serving!r} config on {device_kind!r} JAX's table can hold"
                   + "".join(f"\n  left out {why}" for why in converted.left_out), err=True)
        raise typer.Exit(1)
    keys = [device_kind, *([jax_device_key(device_kind)] if jax_device_key_too else [])]
    written = output.with_suffix(".json")
    try:
        write_output(output, converted.module(keys).encode())
        write_output(written, converted.json(keys).encode())
    except OSError as error:
        typer.echo(f"error: cannot write {error.filename}: {error.strerror}", err=True)
        raise typer.Exit(1) from None
    for why in converted.left_out:
        typer.echo(f"note: left out {why}", err=True)
    typer.echo(f"wrote {len(converted.entries)} JAX key(s) under {', '.join(map(repr, keys))} "
               f"to {output} and {written}", err=True)


def _stored_device_kind(device_kind: str | None, kernel: str | None, db: str | None) -> str:
    """``--device-kind``, else the only device kind with tuned configs (of ``kernel``)."""
    if device_kind is not None:
        return device_kind
    with reading_store(db) as store:
        kinds = store.device_kinds(kernel)
    if not kinds:
        typer.echo("error: nothing to export: the database holds no tuned configs"
                   + (f" of {kernel!r}" if kernel else ""), err=True)
        raise typer.Exit(1)
    if len(kinds) != 1:
        typer.echo(f"error: pass --device-kind; the database has configs for {kinds}",
                   err=True)
        raise typer.Exit(2)
    return kinds[0]


def _export_maxtext(problems: list[Problem], output: Path | None, device_kind: str | None,
                    kernel: str | None, kernel_version: str | None, db: str | None) -> None:
    """Prints (or writes to ``output``) MaxText's flags of the splash config tuned for the one
    problem, or, of several, sa_* of the config best for the global layers' shapes together
    and local_sa_* of the local sliding-window layers', each confirmed here by measuring it
    (the confirmed figures on stderr)."""
    from autotune.maxtext import KERNEL, maxtext_flags

    if kernel not in (None, KERNEL):
        raise typer.BadParameter(f"MaxText's flags are splash's; leave --kernel out or give "
                                 f"--kernel {KERNEL}", param_hint="--kernel")
    device_kind = _stored_device_kind(device_kind, KERNEL, db)
    with reading_store(db) as store:
        try:
            flags, lines = maxtext_flags(store, device_kind, problems, kernel_version)
        except AutotuneError as error:
            typer.echo(f"error: {error}", err=True)
            raise typer.Exit(1) from None
    if lines:
        typer.echo("\n".join(lines), err=True)
    if output is None:
        typer.echo(flags)
        return
    try:
        write_output(output, (flags + "\n").encode())
    except OSError as error:
        typer.echo(f"error: cannot write {output}: {error.strerror}", err=True)
        raise typer.Exit(1) from None


def import_table(
    path: Annotated[Path, typer.Argument(help="A lookup table JSON file.", dir_okay=False)],
    db: DbOption = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace stored entries even when they are faster.")] = False,
) -> None:
    """Import a lookup table: the whole file is checked first; one bad entry writes nothing.
    A database without our tables gets them first, as `autotune tune` does."""
    from storage import ResultError

    try:
        table = LookupTable.load(path)
    except TableError as error:
        typer.echo(f"error: {path}: {error}; nothing was imported", err=True)
        raise typer.Exit(2) from None
    if table.left_out:
        typer.echo(f"note: {path}: the entries of kernel(s) {', '.join(table.left_out)} are "
                   "left out: this build does not install them (upgrade flash-autotune to "
                   "import them)", err=True)
    url = resolve_url(db)
    ensure_schema(url, refuse_read_only=False)  # importing what is stored changes nothing
    with open_store(url) as store, database_errors(store.url):
        try:
            outcomes = store.import_table(table, force=force)
        except ResultError as error:
            typer.echo(f"error: {path}: {error}; nothing was imported", err=True)
            raise typer.Exit(2) from None
    counts = {status: sum(o.status == status for o in outcomes)
              for status in ("inserted", "replaced", "kept")}
    typer.echo(f"imported {path} into {table.device_kind!r}: " +
               ", ".join(f"{n} {status}" for status, n in counts.items())
               + f", {counted(len(table.choices), 'kernel choice')}")
