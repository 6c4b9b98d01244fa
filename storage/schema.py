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
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from storage.engine import WRITE_OPTIONS, make_engine

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


def upgrade(url: str | Engine, revision: str = "head") -> None:
    """Creates or migrates our tables to ``revision``; other tables are left alone."""
    engine = make_engine(url) if isinstance(url, str) else url
    try:
        with engine.execution_options(**WRITE_OPTIONS).begin() as connection:
            command.upgrade(alembic_config(connection), revision)
    finally:
        if isinstance(url, str):
            engine.dispose()


def schema_problem(engine: Engine) -> str | None:
    """Why the database cannot be used as is (unreachable, no schema, other revision), or
    None when it is reachable and at the head revision."""
    try:
        with engine.connect() as connection:
            current = MigrationContext.configure(
                connection, opts={"version_table": VERSION_TABLE}).get_current_revision()
    except SQLAlchemyError as error:
        reason = str(getattr(error, "orig", None) or error).strip().splitlines()[0]
        return f"cannot reach the database: {reason}"
    head = head_revision()
    if current == head:
        return None
    url = engine.url.render_as_string(hide_password=True)
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
