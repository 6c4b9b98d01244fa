"""The Optuna studies that ``autotune tune`` keeps next to the results: the one way to open
their storage, and how a trial is laid out in it (what the tuner writes, and the report, the
service's pages and optuna-dashboard read).

Trial layout: params are the config's real values; the user attr ``status`` is ``ok``, a
failure class, or one of :data:`NOT_MEASURED` (bookkeeping: a config never measured); a
failed measurement is stored PRUNED, bookkeeping trials FAIL.

Imports optuna, never jax; not imported by ``storage`` itself, so the service's lookups do not
load optuna.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import optuna
from optuna.storages import BaseStorage, InMemoryStorage, RDBStorage
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import event, inspect, text
from sqlalchemy.exc import SQLAlchemyError

from storage.engine import close_full_disk_readers, make_engine, refusing_writes, sqlite_connect, \
    sqlite_file, sqlite_in_memory, sqlite_pragmas, write_refusal

OK = "ok"
# Trial statuses that are not measurements (never count against the budget).
NOT_MEASURED = frozenset({"illegal", "repeat", "duplicate", "surplus", "exhausted",
                          "interrupted", "orphan"})
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)

INIT_LOCK = 0x6175746F  # pg_advisory_lock key serialising Optuna's table setup
INIT_ATTEMPTS = 5


def trial_status(trial: FrozenTrial) -> str:
    return trial.user_attrs.get("status", OK if trial.state == TrialState.COMPLETE else "")


def is_measurement(trial: FrozenTrial) -> bool:
    return trial.state in FINISHED and trial_status(trial) not in NOT_MEASURED


@contextmanager
def refusing_study_writes(url: str | None) -> Iterator[None]:
    """``refusing_writes`` for the studies: Optuna wraps a refused commit in its own
    ``StorageInternalError`` ("... e.g. exceeding max length")."""
    try:
        yield
    except optuna.exceptions.StorageInternalError as error:
        refusal = write_refusal(url or "sqlite://", error.__cause__)
        if refusal is None:
            raise
        raise refusal from None


def get_storage(url: str | None, *, create: bool = True, heartbeat_interval: int = 10,
                grace_period: int = 120) -> BaseStorage | None:
    """The Optuna storage on ``url`` (like ``optuna.storages.get_storage``): in memory for
    ``None`` or a SQLite memory URL, else an RDB storage.

    ``create=False`` is for readers (report, pages): None when no study was ever stored there,
    and nothing is created (opening an Optuna storage normally creates its tables).

    Tuning jobs that start together on an empty database would each create Optuna's tables
    (several steps, not one transaction) and all but one fail; on PostgreSQL the opens take
    turns under an advisory lock, on SQLite a loser opens again and then finds the tables.
    SQLite gets a 30 s busy timeout, WAL and ``synchronous = NORMAL`` (as the results tables
    in the same file), so Optuna's many small commits do not each wait for the disk. Trials
    send a heartbeat every ``heartbeat_interval`` s while measured; one silent for
    ``grace_period`` s (its worker was killed) is failed by the next worker.
    """
    if url is None or sqlite_in_memory(url):
        # One process only; a SQLite memory database would also be one per thread, so the
        # heartbeat thread would not see the study's tables.
        return InMemoryStorage() if create else None
    engine = make_engine(url)
    try:
        if not create:
            return _open(url, heartbeat_interval, grace_period, create=False) if inspect(
                engine).has_table("studies") else None
        with refusing_writes(url), engine.connect() as connection:
            if engine.dialect.name == "postgresql":  # released when the connection closes
                connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": INIT_LOCK})
            for _ in range(INIT_ATTEMPTS - 1):
                try:
                    return _open(url, heartbeat_interval, grace_period, create=True)
                except SQLAlchemyError:
                    time.sleep(0.5)
            return _open(url, heartbeat_interval, grace_period, create=True)
    finally:
        engine.dispose()


def _open(url: str, heartbeat_interval: int, grace_period: int, *, create: bool) -> RDBStorage:
    sqlite = url.startswith("sqlite")
    path = sqlite_file(url)
    engine_kwargs: dict[str, Any] = (
        # Opened as the results are (sqlite_connect): a read-only file is read, not refused.
        {"creator": lambda: sqlite_connect(path, timeout=30, check_same_thread=False)}
        if path is not None else
        {"connect_args": {"timeout": 30}} if sqlite else {"pool_pre_ping": True})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = RDBStorage(url, engine_kwargs=engine_kwargs, skip_table_creation=not create,
                             heartbeat_interval=heartbeat_interval, grace_period=grace_period)
    if sqlite:
        # Each Optuna write commits on its own; WAL without a sync per commit makes those cheap.
        event.listen(storage.engine, "connect", sqlite_pragmas)
        close_full_disk_readers(storage.engine)
        storage.engine.dispose()  # the connections that created the tables lack the pragmas
    return storage
