"""Schema migrations (Alembic, shipped in ``storage/migrations``; no alembic.ini needed).

Our version table is ``autotune_alembic_version``, not Alembic's default, because Optuna's
RDBStorage keeps its own Alembic history in ``alembic_version`` in the same database.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import SQLAlchemyError

from storage.engine import WRITE_OPTIONS, make_engine, refusing_writes, shown_url, sqlite_file
from storage.results import SchemaError

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
VERSION_TABLE = "autotune_alembic_version"


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config pointing at the packaged migrations, bound to ``connection``."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def _current_revision(connection: Connection) -> str | None:
    return MigrationContext.configure(
        connection, opts={"version_table": VERSION_TABLE}).get_current_revision()


def _newer_schema(engine: Engine, current: str | None) -> str | None:
    """What to say when the database's revision is one this version does not know: a newer
    version of flash-autotune wrote it; None for a known revision."""
    known = {script.revision for script in
             ScriptDirectory.from_config(alembic_config()).walk_revisions()}
    if current is None or current in known:
        return None
    url = shown_url(engine.url)
    return (f"database {url} was written by a newer version of flash-autotune (schema revision "
            f"{current}; this version knows revisions up to {head_revision()}); upgrade "
            "flash-autotune to use it, or point --db at a database of this version")


def upgrade(url: str | Engine, revision: str = "head") -> None:
    """Creates or migrates our tables to ``revision``; other tables are left alone. Raises
    SchemaError for a schema newer than this version, ReadOnlyDatabaseError when a
    migration is needed but the database refuses writes."""
    engine = make_engine(url) if isinstance(url, str) else url
    try:
        with engine.connect() as connection:
            current = _current_revision(connection)
        newer = _newer_schema(engine, current)
        if newer:
            raise SchemaError(newer)
        if revision == "head" and current == head_revision():
            return  # nothing to do, and nothing written (a read-only database is fine)
        with refusing_writes(engine.url), \
                engine.execution_options(**WRITE_OPTIONS).begin() as connection:
            command.upgrade(alembic_config(connection), revision)
    finally:
        if isinstance(url, str):
            engine.dispose()


def check_writable(engine: Engine) -> None:
    """Raises ``ReadOnlyDatabaseError`` when the database refuses writes (a read-only file,
    file system, replica or transaction), found by a write that changes nothing, rolled back:
    before a long job that must store its result, not after it."""
    with refusing_writes(engine.url), \
            engine.execution_options(**WRITE_OPTIONS).connect() as connection:
        connection.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = version_num"))
        connection.rollback()


def schema_problem(engine: Engine) -> str | None:
    """Why the database cannot be used as is (a missing SQLite file, unreachable, no schema,
    an older or a newer revision), or None when it is reachable and at the head revision.
    Never creates a missing SQLite file."""
    url = shown_url(engine.url)
    path = sqlite_file(engine.url)
    if path is not None and not path.parent.is_dir():
        return (f"the directory of database file {path} does not exist; create it "
                f"(mkdir -p {path.parent}), then run `autotune db upgrade --db {url}`")
    if path is not None and not path.exists():
        return (f"database file {path} does not exist; create it with "
                f"`autotune db upgrade --db {url}`")
    try:
        with engine.connect() as connection:
            current = _current_revision(connection)
    except SQLAlchemyError as error:
        reason = str(getattr(error, "orig", None) or error).strip().splitlines()[0]
        return f"cannot reach the database: {reason}"
    head = head_revision()
    if current == head:
        return None
    newer = _newer_schema(engine, current)
    if newer:
        return newer
    state = "has no autotune schema" if current is None else (
        f"has schema revision {current}, this version needs {head}")
    return f"database {url} {state}; run `autotune db upgrade --db {url}`"


def schema_is_current(url: str | Engine) -> bool:
    """True when the database is reachable and its schema is at the head revision."""
    engine = make_engine(url) if isinstance(url, str) else url
    try:
        return schema_problem(engine) is None
    finally:
        if isinstance(url, str):
            engine.dispose()
