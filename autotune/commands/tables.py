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
from autotune.files import write_atomically
from autotune.problem_options import known_kernel
from kernel import LookupTable, TableError, kernel_names


def export_table(
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the table.",
                                         dir_okay=False)],
    device_kind: Annotated[str | None, typer.Option(
        help="Device kind as JAX reports it, e.g. 'TPU v5 lite' (default: the only one stored).",
        show_default=False)] = None,
    kernel: Annotated[str | None, typer.Option(
        callback=known_kernel, show_default=False,
        help="Only this kernel's configs (default: the default kernel's, and those of every "
             "kernel a stored choice names, so that the table runs each choice).")] = None,
    kernel_version: Annotated[str | None, typer.Option(
        help="Kernel version of --kernel (default: the installed kernel's).",
        show_default=False)] = None,
    db: DbOption = None,
) -> None:
    """Write the tuned configs of one device kind, and its kernel choices, as a lookup table to
    pin in a model build."""
    with reading_store(db) as store:
        if device_kind is None:
            kinds = store.device_kinds(kernel)
            if not kinds:
                typer.echo("error: nothing to export: the database holds no tuned configs"
                           + (f" of {kernel!r}" if kernel else ""), err=True)
                raise typer.Exit(1)
            if len(kinds) != 1:
                typer.echo(f"error: pass --device-kind; the database has configs for {kinds}",
                           err=True)
                raise typer.Exit(2)
            device_kind = kinds[0]
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
        write_atomically(output, (json.dumps(table.to_dict(), indent=2) + "\n").encode())
    except OSError as error:
        typer.echo(f"error: cannot write {output}: {error.strerror}", err=True)
        raise typer.Exit(1) from None
    counts = ", ".join(f"{len(t.entries)} {t.kernel}" for t in table.kernel_tables())
    typer.echo(f"wrote entries ({counts}) and {len(table.choices)} kernel choices for "
               f"{device_kind!r} to {output}")


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
    url = resolve_url(db)
    ensure_schema(url)
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
               + f", {len(table.choices)} kernel choices")
