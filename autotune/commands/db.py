"""``autotune db upgrade``: create or migrate the database schema; ``open_store`` for commands."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from storage import Store

app = typer.Typer(help="Manage the database of tuned configs.", no_args_is_help=True)

DbOption = Annotated[str | None, typer.Option(
    "--db", help="SQLAlchemy database URL (default: $AUTOTUNE_DB_URL or sqlite:///autotune.db).",
    show_default=False)]


def resolve_url(db: str | None) -> str:
    """The database URL to use: ``--db``, else the settings (``AUTOTUNE_DB_URL``); exits with
    status 2 and the reason on a malformed one."""
    from storage import DatabaseUrlError, StorageSettings, normalize_url

    try:
        return normalize_url(db or StorageSettings().db_url)
    except DatabaseUrlError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None


def _reason(error: Exception) -> str:
    return str(getattr(error, "orig", None) or error).strip().splitlines()[0]


@contextmanager
def database_errors(url: str) -> Iterator[None]:
    """Turns a database failure (unreachable, read-only, full, rejected statement, a schema
    newer than this version) into a one-line error and exit status 1; a URL no driver takes
    is a usage error (status 2)."""
    from sqlalchemy.exc import SQLAlchemyError

    from storage import DatabaseUrlError, SchemaError, WriteRefusedError, shown_url

    try:
        yield
    except DatabaseUrlError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    except (WriteRefusedError, SchemaError) as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(1) from None
    except SQLAlchemyError as error:
        typer.echo(f"error: database {shown_url(url)}: {_reason(error)}", err=True)
        raise typer.Exit(1) from None


def open_store(db: str | None) -> Store:
    """A store on a reachable database with a current schema, or exit 1 saying the fix."""
    from storage import DatabaseUrlError, Store

    try:
        store = Store(resolve_url(db))
    except DatabaseUrlError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from None
    problem = store.schema_problem()
    if problem:
        store.close()
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(1)
    return store


@contextmanager
def reading_store(db: str | None) -> Iterator[Store]:
    """``open_store`` for a command that reads stored rows, its database errors one line
    each (``database_errors``). Rows this build cannot read (written by a newer build) are
    skipped, and summed up in one warning line at the end rather than one per row."""
    from storage.unreadable import skipped_note

    with open_store(db) as store, database_errors(store.url):
        store.unreadable.log_each = False
        yield store
        note = skipped_note(store.unreadable.reasons())
        if note:
            typer.echo(f"warning: {note}", err=True)


def ensure_schema(db_url: str, *, refuse_read_only: bool = True) -> None:
    """Creates the tables in a database that has none, and refuses one that does not take
    writes (exit 1), unless ``refuse_read_only`` is False (an import that may change nothing
    says read-only itself when it writes); an out-of-date schema is left for ``autotune db
    upgrade`` (``open_store`` then says so)."""
    from sqlalchemy import inspect
    from sqlalchemy.exc import SQLAlchemyError

    from storage import check_writable, make_engine, schema_is_current, upgrade
    from storage.schema import VERSION_TABLE

    with database_errors(db_url):  # no driver, unreachable, a missing directory: one line
        engine = make_engine(db_url)
        try:
            if not inspect(engine).has_table(VERSION_TABLE):
                try:
                    upgrade(engine)
                except SQLAlchemyError:
                    # Jobs started together on an empty database race to create the tables; a
                    # loser is fine if the winner left a current schema.
                    if not schema_is_current(engine):
                        raise
            elif refuse_read_only and schema_is_current(engine):  # (an old schema: open_store
                check_writable(engine)  # names the upgrade) a read-only one: refused up front
        finally:
            engine.dispose()


@app.command()
def upgrade(db: DbOption = None) -> None:
    """Create the tables, or migrate them to this version's schema (other tables, such as
    Optuna's, are left alone)."""
    from storage import make_engine, schema_problem, shown_url
    from storage import upgrade as upgrade_schema
    from storage.schema import head_revision

    url = resolve_url(db)
    with database_errors(url):
        engine = make_engine(url)
        upgrade_schema(engine)
        problem = schema_problem(engine)
    engine.dispose()
    if problem:
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(1)
    typer.echo(f"{shown_url(engine.url)}: schema at revision "
               f"{head_revision()} (current)")
