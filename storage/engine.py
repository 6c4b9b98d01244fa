"""Engine construction: one place that knows the SQLite and PostgreSQL specifics."""

from __future__ import annotations

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from kernel import AutotuneError

SQLITE_BUSY_TIMEOUT_MS = 30_000
WRITE_OPTIONS = {"autotune_write": True}  # execution option: this transaction will write


class DatabaseUrlError(AutotuneError):
    """A database URL cannot be used; the message says what a valid one looks like."""


def normalize_url(url: str) -> str:
    """Maps ``postgres://`` and bare ``postgresql://`` to the psycopg 3 driver we ship."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise DatabaseUrlError(
            f"cannot parse database URL {url!r}; use e.g. sqlite:///autotune.db or "
            "postgresql+psycopg://user@host:5432/dbname") from None
    if parsed.drivername in ("postgres", "postgresql"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def make_engine(url: str, *, pool_size: int = 5) -> Engine:
    """An engine for ``url``. SQLite gets WAL, a busy timeout and ``BEGIN IMMEDIATE`` for write
    transactions, so that a tuner and the server can share one file without ``database is
    locked`` errors; PostgreSQL gets pre-ping so a restarted server is survived."""
    url = normalize_url(url)
    backend = make_url(url).get_backend_name()
    if backend == "sqlite":
        in_memory = make_url(url).database in (None, "", ":memory:")
        pool = {} if in_memory else {"pool_size": pool_size, "max_overflow": 2 * pool_size}
        engine = create_engine(url, **pool)
        _configure_sqlite(engine)
        return engine
    try:
        return create_engine(url, pool_size=pool_size, max_overflow=2 * pool_size,
                             pool_pre_ping=True)
    except (ModuleNotFoundError, NoSuchModuleError) as error:
        raise DatabaseUrlError(f"no driver for {url.split(':')[0]!r} ({error}); use "
                               "sqlite:///PATH or postgresql+psycopg://...") from None


def sqlite_pragmas(dbapi_connection, _record: object = None) -> None:  # noqa: ANN001
    """Busy timeout, WAL and ``synchronous = NORMAL`` for a new SQLite connection (also a
    SQLAlchemy ``connect`` listener, for engines built elsewhere: Optuna's storage)."""
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
    cursor.execute("PRAGMA journal_mode = WAL")  # readers never block the writer
    cursor.execute("PRAGMA synchronous = NORMAL")  # durable at checkpoints; safe with WAL
    cursor.close()


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record) -> None:  # noqa: ANN001
        # Take transaction control away from the sqlite3 module so "begin" below decides how a
        # transaction starts (the SQLAlchemy recipe for SQLite transactions).
        dbapi_connection.isolation_level = None
        sqlite_pragmas(dbapi_connection)

    @event.listens_for(engine, "begin")
    def _on_begin(connection) -> None:  # noqa: ANN001
        # A deferred transaction that reads and then writes fails at once with SQLITE_BUSY
        # when another writer committed in between (the busy timeout does not apply), so
        # write transactions take the write lock up front. Reads run in autocommit (each
        # statement its own snapshot): the lookup path saves a BEGIN/ROLLBACK round.
        if connection.get_execution_options().get("autotune_write", False):
            connection.exec_driver_sql("BEGIN IMMEDIATE")
