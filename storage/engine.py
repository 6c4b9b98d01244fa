"""Engine construction: one place that knows the SQLite and PostgreSQL specifics."""

from __future__ import annotations

import os
import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.pool import StaticPool

from kernel import AutotuneError

SQLITE_BUSY_TIMEOUT_MS = 30_000
WAL_SWITCH_RETRY_S = 0.005
WRITE_OPTIONS = {"autotune_write": True}  # execution option: this transaction will write


class DatabaseUrlError(AutotuneError):
    """A database URL cannot be used; the message says what a valid one looks like."""


class WriteRefusedError(AutotuneError):
    """The database cannot store anything now, and nothing of the write was stored; reads
    still work."""


class ReadOnlyDatabaseError(WriteRefusedError):
    """The database refuses writes (a read-only file, file system, replica or transaction)."""


class DatabaseFullError(WriteRefusedError):
    """The database's disk is full."""


def sqlite_in_memory(url: str | URL) -> bool:
    """A SQLite database that lives in one process's memory (``sqlite://``, ``:memory:``)."""
    url = make_url(url)
    return url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


def sqlite_file(url: str | URL) -> Path | None:
    """The file of a SQLite URL; None for other databases, in-memory ones and ``file:`` URIs."""
    url = make_url(url)
    if url.get_backend_name() != "sqlite" or sqlite_in_memory(url) or url.query.get("uri"):
        return None
    return Path(url.database)


class FullDiskReader(sqlite3.Connection):
    """A connection that reads a WAL database whose disk was full when it was opened: no
    other could open, its shared-memory (``-shm``) file could not grow. Opened read-only and
    immutable, with an empty WAL (so the file holds every commit, and nothing else writes
    there); the engines of :func:`make_engine` refuse its write transactions as a full disk,
    and close it when it is given back, so that the next one opens normally once there is
    room."""


def sqlite_connect(path: Path, **kwargs: object) -> sqlite3.Connection:
    """A connection to the SQLite file ``path``; read-only when the file is not writable, and
    then also immutable on a read-only file system (where a WAL database cannot be read
    otherwise: its shared-memory file cannot be created); a :class:`FullDiskReader` when the
    disk is full."""
    # Exists first: a file another process creates between the two checks is writable.
    if not path.exists() or os.access(path, os.W_OK):
        connection = sqlite3.connect(path, **kwargs)
        try:
            connection.execute("PRAGMA schema_version")  # maps the shared-memory file
        except sqlite3.Error as error:  # another fails again at the first statement
            wal = path.with_name(path.name + "-wal")
            if getattr(error, "sqlite_errorname", "") == "SQLITE_IOERR_SHMSIZE" and \
                    not (wal.exists() and wal.stat().st_size):
                connection.close()
                return _read_only(path, immutable=True, factory=FullDiskReader, **kwargs)
        return connection
    return _read_only(path, immutable=bool(os.statvfs(path).f_flag & os.ST_RDONLY), **kwargs)


def _read_only(path: Path, immutable: bool, **kwargs: object) -> sqlite3.Connection:
    uri = f"file:{quote(str(path.resolve()))}?mode=ro" + ("&immutable=1" if immutable else "")
    return sqlite3.connect(uri, uri=True, **kwargs)


_QUERY_PASSWORD = re.compile(r"([?&][^=&#]*password[^=&#]*=)[^&#]*", re.IGNORECASE)


def shown_url(url: str | URL) -> str:
    """``url`` with its password masked (``***``), for messages, whether it is given as
    ``user:password@`` or in the query (``?password=``, libpq's ``sslpassword=``); one that
    does not parse (a port that is not a number) is masked by these patterns."""
    try:
        shown = make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        shown = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", str(url))
    return _QUERY_PASSWORD.sub(r"\1***", shown)


@contextmanager
def refusing_writes(url: str | URL) -> Iterator[None]:
    """Turns the database's refusal to write (see :func:`write_refusal`) into a
    ``WriteRefusedError`` that says so and what to do."""
    try:
        yield
    except SQLAlchemyError as error:
        refusal = write_refusal(url, error)
        if refusal is None:
            raise
        raise refusal from None


def write_refusal(url: str | URL, error: BaseException | None) -> WriteRefusedError | None:
    """The ``WriteRefusedError`` of a database's refusal to write (SQLite
    ``SQLITE_READONLY``/``SQLITE_FULL``, PostgreSQL ``read_only_sql_transaction``/
    ``disk_full``) as ``error``; None for any other error."""
    orig = getattr(error, "orig", None)
    code = getattr(orig, "sqlite_errorname", None) or getattr(orig, "sqlstate", None) or ""
    reason = str(orig).strip().splitlines()[0] if orig else ""
    if code.startswith("SQLITE_READONLY") or code == "25006":
        return ReadOnlyDatabaseError(
            f"the database {shown_url(url)} is read-only ({reason}): lookups and exports work, "
            "but nothing can be stored; make it writable or use a writable database")
    if code == "SQLITE_FULL" or code == "53100":
        return database_full(url, reason)
    return None


def database_full(url: str | URL, reason: str) -> DatabaseFullError:
    return DatabaseFullError(f"the database {shown_url(url)} is full ({reason}): nothing of "
                             "this write was stored; free disk space and retry")


def normalize_url(url: str) -> str:
    """Maps ``postgres://`` and bare ``postgresql://`` to the psycopg 3 driver we ship."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as error:  # ValueError: a port that is not a number
        raise DatabaseUrlError(
            f"cannot parse database URL {shown_url(url)!r} ({error}); use e.g. "
            "sqlite:///autotune.db or postgresql+psycopg://user@host:5432/dbname") from None
    if parsed.drivername in ("postgres", "postgresql"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def make_engine(url: str, *, pool_size: int = 5) -> Engine:
    """An engine for ``url``. SQLite gets WAL, a busy timeout and ``BEGIN IMMEDIATE`` for write
    transactions, so that a tuner and the server can share one file without ``database is
    locked`` errors; PostgreSQL gets pre-ping so a restarted server is survived."""
    url = normalize_url(url)
    try:
        if make_url(url).get_backend_name() != "sqlite":
            return create_engine(url, pool_size=pool_size, max_overflow=2 * pool_size,
                                 pool_pre_ping=True)
        path = sqlite_file(url)
        # In memory: one connection shared by every thread, or each would see its own database.
        pool = ({"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
                if sqlite_in_memory(url) else
                {"pool_size": pool_size, "max_overflow": 2 * pool_size})
        if path is not None:
            # Opened by sqlite_connect: a read-only file is read (no WAL switch, no -shm).
            pool["creator"] = lambda: sqlite_connect(path, check_same_thread=False)
        engine = create_engine(url, **pool)
        _configure_sqlite(engine)
        return engine
    except (ModuleNotFoundError, NoSuchModuleError) as error:
        raise DatabaseUrlError(f"no driver for {url.split(':')[0]!r} ({error}); use "
                               "sqlite:///PATH or postgresql+psycopg://...") from None
    except ValueError as error:  # a query argument of the wrong type: ?timeout=abc
        raise DatabaseUrlError(f"a bad argument in database URL {shown_url(url)!r} ({error}); "
                               "fix or remove it") from None


def sqlite_pragmas(dbapi_connection, _record: object = None) -> None:  # noqa: ANN001
    """Busy timeout, WAL and ``synchronous = NORMAL`` for a new SQLite connection (also a
    SQLAlchemy ``connect`` listener, for engines built elsewhere: Optuna's storage)."""
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
    _switch_to_wal(cursor)  # readers never block the writer
    cursor.execute("PRAGMA synchronous = NORMAL")  # durable at checkpoints; safe with WAL
    cursor.close()


def _switch_to_wal(cursor: sqlite3.Cursor) -> None:
    """``PRAGMA journal_mode = WAL``, retried while another connection holds the new file: the
    switch does not wait out the busy timeout, so jobs started together on a new file failed
    with ``database is locked``. A read-only database keeps its journal mode (it is only read)."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as error:
            if error.sqlite_errorname.startswith("SQLITE_READONLY"):
                return
            if error.sqlite_errorname != "SQLITE_BUSY" or time.monotonic() > deadline:
                raise
            time.sleep(WAL_SWITCH_RETRY_S)


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
            if isinstance(connection.connection.dbapi_connection, FullDiskReader):
                raise database_full(engine.url, "no room for its shared-memory file")
            connection.exec_driver_sql("BEGIN IMMEDIATE")

    close_full_disk_readers(engine)


def close_full_disk_readers(engine: Engine) -> None:
    """Closes each :class:`FullDiskReader` as it is given back to ``engine``'s pool: the next
    checkout opens anew, normally once there is room."""
    @event.listens_for(engine, "checkin")
    def _on_checkin(dbapi_connection, record) -> None:  # noqa: ANN001
        if isinstance(dbapi_connection, FullDiskReader):
            record.invalidate()
