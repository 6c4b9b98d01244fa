"""``Store``: publish, look up, list, export and import tuned configs."""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import sqlite3
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, NamedTuple, TypeVar

from sqlalchemy import Select, String, bindparam, cast, event, func, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from kernel import (
    DEFAULT_KERNEL,
    AutotuneError,
    ConfigError,
    LookupTable,
    Problem,
    ServingProblem,
    TableEntry,
    get_kernel,
    kernel_names,
)
from kernel.registry import registered_kernel
from kernel.table import KernelChoice, KernelTiming, ProblemIndex, legal_on, nearest_entry
from storage.choices import (
    CHOICE_PROVENANCE,
    StoredChoice,
    check_choice,
    choice_columns,
    stored_choice,
)
from storage.engine import (
    WRITE_OPTIONS,
    FullDiskReader,
    WriteRefusedError,
    make_engine,
    normalize_url,
    refusing_writes,
    sqlite_connect,
    sqlite_file,
    sqlite_in_memory,
)
from storage.models import (
    CHOICE_FAMILY_COLUMNS,
    CHOICE_KEY_COLUMNS,
    FAMILY_COLUMNS,
    KEY_COLUMNS,
    SERVING_FAMILY_COLUMNS,
    SERVING_KEY_COLUMNS,
    KernelChoiceRow,
    ServingConfigHistoryRow,
    ServingConfigRow,
    TunedConfigHistoryRow,
    TunedConfigRow,
)
from storage.results import (
    MEASUREMENT_FIELDS,
    NO_SOFTCAP,
    PROVENANCE_FIELDS,
    ConfigKey,
    Entry,
    PublishOutcome,
    ResultError,
    SchemaError,
    StorageError,
    TunedResult,
    installed_kernel_version,
    problem_columns,
    problem_from_columns,
)
from storage.schema import schema_problem, upgrade
from storage.settings import StorageSettings
from storage.unreadable import Rows, UnreadableRows

Match = Literal["exact", "nearest"]
_T = TypeVar("_T")
FILTER_FIELDS = (*KEY_COLUMNS, "method", "study")
SERVING_FILTER_FIELDS = (*SERVING_KEY_COLUMNS, "method", "study")
CHOICE_FILTER_FIELDS = (*CHOICE_KEY_COLUMNS, "kernel", "method")
FAMILY_CACHE_SIZE = 64  # families of nearest-match candidates kept (SQLite); full: cleared
PUBLISH_ATTEMPTS = 3  # a concurrent first insert of the same key loses the race once, at most
_TABLE = TunedConfigRow.__table__
_CHOICES = KernelChoiceRow.__table__
_SERVING = ServingConfigRow.__table__


@dataclass(frozen=True)
class _ResultTables:
    """Where the results of one problem type live: the live table, its history, the key and
    the family of nearest-match candidates, and the filters ``list`` takes."""

    row: type
    history: type
    key: tuple[str, ...]
    family: tuple[str, ...]
    filters: tuple[str, ...]


_RESULT_TABLES = {
    Problem: _ResultTables(TunedConfigRow, TunedConfigHistoryRow, KEY_COLUMNS, FAMILY_COLUMNS,
                           FILTER_FIELDS),
    ServingProblem: _ResultTables(ServingConfigRow, ServingConfigHistoryRow, SERVING_KEY_COLUMNS,
                                  SERVING_FAMILY_COLUMNS, SERVING_FILTER_FIELDS),
}


def _tables_of(kernel: str) -> _ResultTables:
    """The tables of kernel ``kernel``'s results (by its problem type)."""
    return _RESULT_TABLES[registered_kernel(kernel).problem_type]


def _select_where(names: Iterable[str], columns: Sequence[Any] = (_TABLE,),
                  table: Any = _TABLE) -> Any:
    """A prepared ``SELECT columns ... WHERE name = :name AND ...`` on ``table`` (compiled
    once, cached)."""
    return select(*columns).where(*(table.c[name] == bindparam(name) for name in names))


_EXACT = _select_where(KEY_COLUMNS[:-1])  # any platform
_EXACT_ON_PLATFORM = _select_where(KEY_COLUMNS)
# A key's row in each live results table (on its platform): what Store.get reads.
_KEY_ROW = {TunedConfigRow: _EXACT_ON_PLATFORM,
            ServingConfigRow: _select_where(SERVING_KEY_COLUMNS, (_SERVING,), _SERVING)}
# A serving key's family, in the order rows were stored (per: on a given platform).
_SERVING_FAMILY = {on_platform: _select_where(
    SERVING_FAMILY_COLUMNS + (("platform",) if on_platform else ()), (_SERVING,), _SERVING)
    .order_by(_SERVING.c.id) for on_platform in (False, True)}
_BY_ID = {table.name: _select_where(("id",), (table,), table)
          for table in (_TABLE, _CHOICES, _SERVING)}


def _candidate_columns(table: Any) -> list[Any]:
    """Nearest-match candidates: sizes, the kernel and the config's JSON text, decoded only
    when visited (no full rows; read through the key's index)."""
    return [*(table.c[name] for name in ("id", "batch", "q_heads", "kv_heads", "q_len",
                                         "kv_len", "kernel")),
            cast(table.c.config, String).label("config")]


def _capped(table: Any, capped: bool) -> Any:
    """Rows with a softcap (of any value: the nearest rule ignores it), or without one."""
    return table.c.softcap != NO_SOFTCAP if capped else table.c.softcap == NO_SOFTCAP


# Nearest-match candidates per (on a given platform, capped).
_FAMILY = {(on_platform, capped): _select_where(
    (*FAMILY_COLUMNS, "platform") if on_platform else FAMILY_COLUMNS,
    _candidate_columns(_TABLE), _TABLE)
    .where(_capped(_TABLE, capped)).order_by(_TABLE.c.q_len, _TABLE.c.id)
    for on_platform in (False, True) for capped in (False, True)}
_CHOICE_EXACT = _select_where(CHOICE_KEY_COLUMNS[:-1], (_CHOICES,), _CHOICES)  # any platform
_CHOICE_FAMILY = {capped: _select_where(CHOICE_FAMILY_COLUMNS, _candidate_columns(_CHOICES),
                                        _CHOICES)
                  .where(_capped(_CHOICES, capped)).order_by(_CHOICES.c.q_len, _CHOICES.c.id)
                  for capped in (False, True)}


@dataclass(frozen=True)
class LookupRequest:
    """One key to look up; ``platform`` None matches any platform of the device kind."""

    device_kind: str
    problem: Problem | ServingProblem  # of the kernel's problem type
    kernel: str = DEFAULT_KERNEL
    kernel_version: str | None = None  # None: the installed kernel's version
    platform: str | None = None

    def params(self, names: Sequence[str]) -> dict[str, Any]:
        values = {"kernel": self.kernel,
                  "kernel_version": self.kernel_version or installed_kernel_version(self.kernel),
                  "device_kind": self.device_kind, "platform": self.platform}
        values.update(problem_columns(self.problem))
        return {name: values[name] for name in names}


@dataclass(frozen=True)
class HistoryEntry:
    """A result moved out of the live table, why (``replaced``/``forced``/``rejected``), when."""

    result: TunedResult
    reason: str
    archived_at: datetime


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _columns(result: TunedResult) -> dict[str, Any]:
    columns = {"kernel": result.kernel, "kernel_version": result.kernel_version,
               "device_kind": result.device_kind, "platform": result.platform,
               **problem_columns(result.problem), "config": result.config.to_dict(),
               **result.measurements()}
    if result.speedup is None and result.median_ms and result.default_median_ms is not None:
        speedup = result.default_median_ms / result.median_ms
        columns["speedup"] = speedup if math.isfinite(speedup) else None  # 1 / 1e-310
    return columns


def _lock_order(columns: Mapping[str, Any], key: Sequence[str]) -> str:
    """A total order of rows by their ``key`` columns, the same in every writer."""
    return repr([columns[name] for name in key])


def _getter(row: Any) -> Callable[[str], Any]:
    """Reads a column of a table row (ORM object or Core row mapping) by name."""
    return row.__getitem__ if isinstance(row, Mapping) else row.__getattribute__


def _result(row: Any) -> TunedResult:
    """A result from a table row (ORM object or Core row mapping) of any kernel."""
    get = _getter(row)
    rules = registered_kernel(get("kernel"))
    return TunedResult(
        kernel=get("kernel"), kernel_version=get("kernel_version"),
        device_kind=get("device_kind"), platform=get("platform"),
        problem=problem_from_columns(get, rules.problem_type),
        config=rules.config_from_dict(get("config")),
        **{name: get(name) for name in (*MEASUREMENT_FIELDS, *PROVENANCE_FIELDS)})


def _choosing(table: LookupTable, stored: Sequence[StoredChoice]) -> tuple[KernelChoice, ...]:
    """Choices of ``table``'s kernel alone: its stored choices, and for every other problem it
    has an entry for, a choice of it at that entry's config and time (the tune's provenance).
    A stored choice of another kernel is left out: pinned, it would run that kernel."""
    own = tuple(item.choice for item in stored if item.choice.kernel == table.kernel)
    chosen = {choice.problem for choice in own}
    return own + tuple(
        KernelChoice(entry.problem, table.kernel, entry.config,
                     {table.kernel: KernelTiming(entry.time_ms)},
                     {name: entry.provenance[name] for name in CHOICE_PROVENANCE
                      if name in entry.provenance} | {"kernel_version": table.kernel_version})
        for entry in table.entries if entry.problem not in chosen)


def _entry(row: Any) -> Entry:
    get = _getter(row)
    return Entry(_result(row), _utc(get("created_at")), _utc(get("updated_at")))


def _choice(row: Any) -> StoredChoice:
    """A stored kernel choice from a table row (ORM object or Core row mapping)."""
    return stored_choice(_getter(row), _utc)


_READ_ONLY = "autotune_read_only"  # Session.info key: a pass that locks no row


def _for_update(session: Session, statement: Select[Any]) -> Select[Any]:
    """``statement``, locking the rows it reads, but in a read-only pass
    (``Store._answer_without_writing``)."""
    return statement if session.info.get(_READ_ONLY) else statement.with_for_update()


class _WouldWrite(Exception):
    """A read-only pass met a change to flush."""


def _stop_before_a_write(*_: object) -> None:
    raise _WouldWrite


def _best(entries: Sequence[Entry]) -> Entry | None:
    """The fastest of several platforms' entries for one key (usually there is one)."""
    best = None
    for entry in entries:
        if best is None or entry.result.beats(best.result):
            best = entry
    return best


class _Shape(NamedTuple):
    """A candidate's sizes: what ``Problem.distance`` reads, without building a
    validated Problem for every row of a family."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int

    @property
    def group_size(self) -> int:
        return self.q_heads // self.kv_heads


class _Family:
    """The nearest-match candidates of one family (configs: same kernel, device, dtype,
    head_dim, causal, mode, window, segment ids, softcap or none; kernel choices: the same
    but any kernel), sorted by q_len. ``nearest`` visits them in order of the q_len term of
    ``Problem.distance`` (a lower bound of the whole distance) and stops once that bound exceeds
    the best legal distance found, so a lookup reads a few q_len neighbourhoods, not the
    family; legality is checked once per distinct kernel and config."""

    def __init__(self, rows: Sequence[Any], table: str, unreadable: UnreadableRows) -> None:
        # (id, batch, q_heads, kv_heads, q_len, kv_len, kernel, config JSON), by q_len, id
        self.rows = rows
        self.q_lens = [row[4] for row in rows]
        self.table = table
        self.unreadable = unreadable  # a kernel or config this build cannot read: no candidate

    def nearest(self, problem: Problem) -> tuple[int, str, str] | None:
        """The id, kernel and config JSON of the closest candidate whose kernel is registered
        and whose config ``kernel.table.nearest_entry`` takes for ``problem`` (ties: the
        oldest), or None."""
        legal: dict[tuple[str, str], bool] = {}
        best: tuple[float, int, str, str] | None = None
        right = bisect.bisect_left(self.q_lens, problem.q_len)
        left = right - 1

        def bound(index: int) -> float:
            return abs(math.log2(problem.q_len / self.q_lens[index]))

        while left >= 0 or right < len(self.rows):
            if right == len(self.rows) or (left >= 0 and bound(left) <= bound(right)):
                index, left = left, left - 1
            else:
                index, right = right, right + 1
            if best is not None and bound(index) > best[0]:
                break  # every row not yet visited is at least this far
            row_id, *sizes, kernel, config = self.rows[index]
            shape = _Shape(*sizes)
            distance = problem.distance(shape)
            if best is not None and (distance, row_id) >= best[:2]:
                continue
            if (kernel, config) not in legal:
                legal[kernel, config] = self._legal(problem, row_id, shape, kernel, config)
            if legal[kernel, config]:
                best = (distance, row_id, kernel, config)
        return None if best is None else best[1:]

    def _legal(self, problem: Problem, row_id: int, shape: _Shape, kernel: str,
               config: str) -> bool:
        """Whether the candidate's config, decoded, passes ``kernel.table.nearest_entry``."""
        decoded = self.unreadable.read(self.table, row_id, lambda: get_kernel(
            kernel).config_from_dict(json.loads(config)))
        candidate = TableEntry(dataclasses.replace(problem, **shape._asdict()), decoded)
        return decoded is not None and nearest_entry(problem, [candidate], kernel) is not None


class _ServingFamily:
    """The stored entries of one serving family (``SERVING_FAMILY_COLUMNS``), decoded once:
    a grid's worth of rows, indexed as a pinned table's are."""

    def __init__(self, entries: Sequence[Entry]) -> None:
        self.entries = entries
        self.index = ProblemIndex([entry.result for entry in entries],
                                  lambda result: result.kernel)
        self.by_problem: dict[ServingProblem, list[Entry]] = {}
        for entry in entries:
            self.by_problem.setdefault(entry.result.problem, []).append(entry)

    def find(self, request: LookupRequest) -> tuple[Entry, Match] | None:
        """``request``'s entry (the fastest platform's), else the nearest legal for it, on its
        device kind's chip where that is a known target."""
        exact = _best(self.by_problem.get(request.problem, []))
        if exact is not None:
            return exact, "exact"
        rules = registered_kernel(request.kernel)
        try:
            legal = legal_on(rules, request.problem, rules.target(request.device_kind))
        except ConfigError:  # a device kind no target of the kernel: its portable rules
            legal = None
        found = self.index.nearest(request.problem, legal)
        return None if found is None else (
            next(entry for entry in self.entries if entry.result is found), "nearest")


class Store:
    """Tuned configs in a SQL database (SQLite file or PostgreSQL), one live row per key.

    Thread-safe: each call uses its own connection from the engine's pool.
    """

    def __init__(self, url: str | None = None, *, pool_size: int = 5) -> None:
        self.url = normalize_url(url or StorageSettings().db_url)
        self.engine = make_engine(self.url, pool_size=pool_size)
        self._writer = self.engine.execution_options(**WRITE_OPTIONS)
        if sqlite_in_memory(self.url):  # lives only as long as this store: nothing to migrate
            upgrade(self.engine)
        self._watcher: sqlite3.Connection | None = None
        self._watcher_lock = threading.Lock()
        # family key -> (data version, nearest-match candidates); see lookup_many
        self._families: dict[tuple[Any, ...], tuple[int, _Family | _ServingFamily]] = {}
        self._checked_version: tuple[Any, ...] | None = None  # what passed quick_check
        self.unreadable = UnreadableRows()  # rows met that this build cannot read

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        self.engine.dispose()

    def data_version(self) -> int | None:
        """A number that changes whenever any process commits to the database, so that
        answers cached under one value are current while it holds; None where there is no
        cheap signal (PostgreSQL, in-memory SQLite), and then nothing may be cached.

        SQLite's ``PRAGMA data_version`` on a connection that never writes (a few
        microseconds, no query of our tables). None too while the file cannot be read: the
        query that follows meets the same error as a database error (a 503, not a 500); and
        while a full disk lets it be read only as it was (``FullDiskReader``).
        """
        path = sqlite_file(self.engine.url)
        if path is None:
            return None
        with self._watcher_lock:
            try:
                if self._watcher is None:
                    self._watcher = sqlite_connect(path, check_same_thread=False,
                                                   isolation_level=None)
                if isinstance(self._watcher, FullDiskReader):  # sees no commit: no signal
                    raise sqlite3.OperationalError("the disk was full when it was opened")
                return self._watcher.execute("PRAGMA data_version").fetchone()[0]
            except sqlite3.Error:
                if self._watcher is not None:
                    self._watcher.close()
                    self._watcher = None
                return None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def schema_problem(self) -> str | None:
        """Why the database is unusable (with the fix), or None. See ``storage.schema``."""
        return schema_problem(self.engine)

    def readiness_problem(self) -> str | None:
        """``schema_problem``, else a damaged SQLite file (``PRAGMA quick_check``, run again
        only after a commit or a change to the file), or None when the database can serve."""
        problem = self.schema_problem()
        path = sqlite_file(self.engine.url)
        if problem or path is None:
            return problem
        stat = path.stat()
        version = (self.data_version(), stat.st_mtime_ns, stat.st_size)
        if self._checked_version != version:
            with self.engine.connect() as connection:
                found = connection.exec_driver_sql("PRAGMA quick_check(1)").scalar()
            if found != "ok":
                found = " ".join(found.replace("***", "").split())
                return (f"database file {path} is damaged ({found}); "
                        "restore it from a backup or export what still reads")
            self._checked_version = version
        return None

    def require_current_schema(self) -> None:
        """Raises SchemaError (saying ``autotune db upgrade --db URL`` fixes it) if needed."""
        problem = self.schema_problem()
        if problem:
            raise SchemaError(problem)

    # --- writes ---

    def publish(self, result: TunedResult, force: bool = False,
                beyond_noise: bool = False) -> PublishOutcome:
        """Stores ``result`` unless the stored one is at least as fast (``beyond_noise``:
        unless ``result`` is faster beyond the noise of both, as a re-confirmation must be;
        ``force`` overrides).

        Whichever result loses goes to the history table. Raises ResultError if the config
        breaks a static rule for its problem.
        """
        result.check_legal()
        return self._write(lambda session: self._publish(session, result, force, beyond_noise))

    def publish_choice(self, device_kind: str, choice: KernelChoice) -> StoredChoice:
        """Stores the kernel choice for ``choice.problem`` on ``device_kind``, replacing the
        stored one (a choice is the latest comparison of the candidates). Raises ResultError
        naming what is wrong (``storage.choices.check_choice``)."""
        check_choice(device_kind, choice)
        return self._write(lambda session: self._publish_choice(session, device_kind, choice))

    @staticmethod
    def _publish_choice(session: Session, device_kind: str,
                        choice: KernelChoice) -> StoredChoice:
        now = datetime.now(UTC)
        columns = choice_columns(device_kind, choice)
        key = {name: columns[name] for name in CHOICE_KEY_COLUMNS}
        row = session.scalars(_for_update(session, select(KernelChoiceRow).filter_by(**key))) \
            .one_or_none()
        if row is None:
            row = KernelChoiceRow(**columns, created_at=now, updated_at=now)
            session.add(row)
        elif all(getattr(row, name) == value for name, value in columns.items()):
            return _choice(row)  # the same choice: a no-op
        else:
            for name, value in columns.items():
                setattr(row, name, value)
            row.updated_at = now
        session.flush()
        return _choice(row)

    def import_table(self, table: LookupTable, force: bool = False) -> list[PublishOutcome]:
        """Publishes every entry of ``table``, and its kernel choices, in one transaction:
        all or nothing. Every entry and choice is checked before anything is written;
        ResultError names the first bad one. The outcomes are the entries'.
        """
        results = []
        for kernel_table in table.kernel_tables():
            for index, table_entry in enumerate(kernel_table.entries):
                try:
                    result = TunedResult.from_table_entry(
                        table_entry, kernel=kernel_table.kernel,
                        kernel_version=kernel_table.kernel_version,
                        device_kind=table.device_kind)
                    result.check_legal()
                except (ResultError, TypeError) as error:
                    raise ResultError(f"{kernel_table.kernel} entry {index} "
                                      f"({table_entry.problem.label()}): {error}") from None
                results.append(result)
        for index, choice in enumerate(table.choices):
            try:
                check_choice(table.device_kind, choice)
            except AutotuneError as error:
                raise ResultError(f"choice {index} ({choice.problem.label()}): {error}") \
                    from None

        def write(session: Session) -> list[PublishOutcome]:
            # Rows are locked in the order of their keys, not the table's: two imports of
            # the same keys in opposite orders deadlocked on PostgreSQL.
            for choice in sorted(table.choices, key=lambda c: _lock_order(
                    choice_columns(table.device_kind, c), CHOICE_KEY_COLUMNS)):
                self._publish_choice(session, table.device_kind, choice)
            order = sorted(range(len(results)), key=lambda i: _lock_order(
                _columns(results[i]), _tables_of(results[i].kernel).key))
            outcomes = {i: self._publish(session, results[i], force) for i in order}
            return [outcomes[i] for i in range(len(results))]

        return self._write(write)

    def _write(self, work: Callable[[Session], _T]) -> _T:
        """Runs ``work`` in one write transaction. Where writes are refused (read-only, full),
        the answer of a ``work`` that changes nothing (importing what is stored), else the
        refusal (``WriteRefusedError``)."""
        for attempt in range(PUBLISH_ATTEMPTS):
            try:
                with refusing_writes(self.engine.url), \
                        Session(self._writer, expire_on_commit=False) as session, \
                        session.begin():
                    return work(session)
            except IntegrityError:
                # PostgreSQL: another writer inserted the same new key first; retrying finds it.
                if attempt == PUBLISH_ATTEMPTS - 1:
                    raise
            except WriteRefusedError:
                answer = self._answer_without_writing(work)
                if answer is None:
                    raise
                return answer
        raise AssertionError("unreachable")

    def _answer_without_writing(self, work: Callable[[Session], _T]) -> _T | None:
        """``work``'s answer, run without a write transaction or row locks (a read-only
        transaction refuses both), stopped before it writes anything (on SQLite, outside a
        write transaction, each statement would commit alone); None if it would change
        something, or cannot read."""
        with Session(self.engine, info={_READ_ONLY: True}) as session:
            event.listen(session, "before_flush", _stop_before_a_write)
            try:
                answer = work(session)
            except (_WouldWrite, SQLAlchemyError):
                return None
            return None if session.new or session.dirty or session.deleted else answer

    @staticmethod
    def _publish(session: Session, result: TunedResult, force: bool,
                 beyond_noise: bool = False) -> PublishOutcome:
        now = datetime.now(UTC)
        tables = _tables_of(result.kernel)
        key = LookupRequest(result.device_kind, result.problem, result.kernel,
                            result.kernel_version, result.platform).params(tables.key)
        row = session.scalars(_for_update(session, select(tables.row).filter_by(**key))) \
            .one_or_none()
        if row is None:
            row = tables.row(**_columns(result), created_at=now, updated_at=now)
            session.add(row)
            session.flush()
            return PublishOutcome("inserted", _entry(row))
        previous = _result(row)
        if _columns(result) == _columns(previous):
            return PublishOutcome("kept", _entry(row), previous)  # the same result: a no-op
        wins = result.beats(previous, beyond_noise)
        if wins or force:
            session.add(tables.history(
                **_columns(previous), created_at=row.created_at, updated_at=row.updated_at,
                reason="replaced" if wins else "forced", archived_at=now))
            for name, value in _columns(result).items():
                setattr(row, name, value)
            row.updated_at = now
            session.flush()
            return PublishOutcome("replaced", _entry(row), previous)
        rejected = session.scalars(select(tables.history).filter_by(**key, reason="rejected"))
        if all(_columns(_result(old)) != _columns(result) for old in rejected):
            # once: a sync job importing the same slower table again adds nothing
            session.add(tables.history(**_columns(result), created_at=now,
                                              updated_at=now, reason="rejected", archived_at=now))
        return PublishOutcome("kept", _entry(row), previous)

    # --- reads ---

    def get(self, key: ConfigKey) -> Entry | None:
        request = LookupRequest(key.device_kind, key.problem, key.kernel, key.kernel_version,
                                key.platform)
        tables = _tables_of(key.kernel)
        with self.engine.connect() as connection:
            row = connection.execute(_KEY_ROW[tables.row],
                                     request.params(tables.key)).mappings().one_or_none()
        return self._read_entry(row, tables.row.__table__.name) if row else None

    def _read_entry(self, row: Mapping[str, Any], table: str = _TABLE.name) -> Entry | None:
        """The entry of a row, or None if this build cannot read it (``storage.unreadable``)."""
        return self.unreadable.read(table, row["id"], lambda: _entry(row))

    def _read_choice(self, row: Mapping[str, Any]) -> StoredChoice | None:
        """As ``_read_entry``, for a kernel choice's row."""
        return self.unreadable.read(_CHOICES.name, row["id"], lambda: _choice(row))

    def lookup(self, kernel: str, device_kind: str, problem: Problem, *,
               kernel_version: str | None = None,
               platform: str | None = None) -> tuple[Entry, Match] | None:
        """The entry stored for exactly ``problem``, else the nearest tuned problem whose config
        is legal for it (``kernel.table.nearest_entry``); None when nothing fits."""
        return self.lookup_many([LookupRequest(device_kind, problem, kernel, kernel_version,
                                               platform)])[0]

    def lookup_many(self, requests: Sequence[LookupRequest]) -> list[tuple[Entry, Match] | None]:
        """``lookup`` for many keys on one connection; each family of candidates (``_Family``)
        is read at most once, and on SQLite kept until
        the next commit to the database (``data_version``)."""
        out: list[tuple[Entry, Match] | None] = []
        version = self.data_version()  # before reading, so a later write is not masked
        families: dict[tuple[Any, ...], _Family] = {}
        with self.engine.connect() as connection:
            for request in requests:
                if isinstance(request.problem, ServingProblem):
                    out.append(self._lookup_serving(connection, request, version))
                    continue
                on_platform = request.platform is not None
                exact_query = _EXACT_ON_PLATFORM if on_platform else _EXACT
                names = KEY_COLUMNS if on_platform else KEY_COLUMNS[:-1]
                rows = connection.execute(exact_query, request.params(names)).mappings()
                exact = _best([entry for row in rows if (entry := self._read_entry(row))])
                if exact is not None:
                    out.append((exact, "exact"))
                    continue
                family_names = (*FAMILY_COLUMNS, "platform") if on_platform else FAMILY_COLUMNS
                capped = request.problem.softcap is not None
                row = self._nearest_row(connection, _TABLE, _FAMILY[on_platform, capped],
                                        request.params(family_names), request.problem,
                                        version, families)
                entry = None if row is None else self._read_entry(row)
                out.append(None if entry is None else (entry, "nearest"))
        return out

    def _lookup_serving(self, connection: Any, request: LookupRequest,
                        version: int | None) -> tuple[Entry, Match] | None:
        """A serving key's entry: its own, else the nearest of its family whose config passes
        the kernel's rules for it (``kernel.table.ProblemIndex``, over the family's rows:
        serving tables hold a grid, not a model's every shape), on the device kind's chip where
        it is a known one (its VMEM: a config over it would not compile there). The family is
        read once and on SQLite kept until the next commit (``version``), as ``_nearest_row``
        keeps an attention family."""
        on_platform = request.platform is not None
        names = SERVING_FAMILY_COLUMNS + (("platform",) if on_platform else ())
        params = request.params(names)
        key = (_SERVING.name, *params.values())
        family = self._cached_family(key, version)
        if family is None:
            rows = connection.execute(_SERVING_FAMILY[on_platform], params).mappings()
            family = _ServingFamily([entry for row in rows
                                     if (entry := self._read_entry(row, _SERVING.name))])
            self._cache_family(key, version, family)
        return family.find(request)

    def _nearest_row(self, connection: Any, table: Any, query: Any, params: dict[str, Any],
                     problem: Problem, version: int | None,
                     families: dict[tuple[Any, ...], _Family]) -> Mapping[str, Any] | None:
        """The row of ``table`` nearest ``problem`` whose config is legal for it
        (``_Family.nearest``), or None. The family (``query`` with ``params``) is read once
        per call (``families``) and on SQLite kept until the next commit (``version``)."""
        key = (table.name, *params.values(), problem.softcap is not None)
        family = families.get(key) or self._cached_family(key, version)
        if family is None:
            family = _Family(connection.execute(query, params).all(), table.name,
                             self.unreadable)
            self._cache_family(key, version, family)
        families[key] = family
        nearest = family.nearest(problem)
        if nearest is None:
            return None
        row_id, kernel, config = nearest
        row = connection.execute(_BY_ID[table.name], {"id": row_id}).mappings().one()
        if (row["kernel"], row["config"]) != (kernel, json.loads(config)):
            # Replaced since the family was read: read it again, uncached.
            self._families.clear()
            families.pop(key)
            return self._nearest_row(connection, table, query, params, problem, None,
                                     families)
        return row

    def _cached_family(self, key: tuple[Any, ...], version: int | None) -> _Family | None:
        cached = self._families.get(key)
        return cached[1] if cached and version is not None and cached[0] == version else None

    def _cache_family(self, key: tuple[Any, ...], version: int | None, family: _Family) -> None:
        if version is None:
            return
        if len(self._families) >= FAMILY_CACHE_SIZE:
            self._families.clear()
        self._families[key] = (version, family)

    def history(self, key: ConfigKey) -> list[HistoryEntry]:
        """Results archived under ``key``, oldest first."""
        request = LookupRequest(key.device_kind, key.problem, key.kernel, key.kernel_version,
                                key.platform)
        tables = _tables_of(key.kernel)
        query = select(tables.history).filter_by(**request.params(tables.key)) \
            .order_by(tables.history.id)
        with Session(self.engine) as session:
            return [HistoryEntry(_result(row), row.reason, _utc(row.archived_at))
                    for row in session.scalars(query)]

    def device_kinds(self, kernel: str | None = DEFAULT_KERNEL) -> list[str]:
        """The device kinds with tuned configs of ``kernel`` (None: of any attention kernel)."""
        row = TunedConfigRow if kernel is None else _tables_of(kernel).row
        query = select(row.device_kind).distinct().order_by(row.device_kind)
        if kernel is not None:
            query = query.where(row.kernel == kernel)
        with self.engine.connect() as connection:
            return list(connection.scalars(query))

    def export_table(self, device_kind: str, kernel: str | None = None,
                     kernel_version: str | None = None) -> LookupTable:
        """The tuned entries on one device kind and its kernel choices, as a lookup table: of
        ``kernel`` (at ``kernel_version``, default the installed one) alone, choosing it for
        every problem it was tuned for (:func:`_choosing`), or, for None, of the default
        kernel with every choice there and (``others``) the entries of every other kernel a
        choice names, at their installed versions, so that a pinned table runs each choice it
        holds. ConfigError for a kernel not in this build (its table could not be imported)."""
        choices, _ = self.list_choices({"device_kind": device_kind}, limit=None)
        table = self._kernel_table(device_kind, kernel or DEFAULT_KERNEL, kernel_version)
        if kernel is not None and _tables_of(kernel).row is not TunedConfigRow:
            return table  # a serving kernel's: kernel choices are of attention problems
        if kernel is not None:
            return dataclasses.replace(table, choices=_choosing(table, choices))
        table = dataclasses.replace(table, choices=tuple(stored.choice for stored in choices))
        named = {name for stored in choices for name in stored.choice.ranked()}
        others = (self._kernel_table(device_kind, name, None)
                  for name in sorted(named & set(kernel_names()) - {table.kernel}))
        return dataclasses.replace(table, others=tuple(t for t in others if t.entries))

    def _kernel_table(self, device_kind: str, kernel: str,
                      kernel_version: str | None) -> LookupTable:
        """The entries of one kernel (version) on one device kind, as a table without choices."""
        kernel = registered_kernel(kernel).name
        version = kernel_version or installed_kernel_version(kernel)
        entries, _ = self.list({"kernel": kernel, "kernel_version": version,
                                "device_kind": device_kind}, limit=None,
                               problem_type=registered_kernel(kernel).problem_type)
        jax_versions = {entry.result.jax_version for entry in entries}
        return LookupTable(kernel=kernel, kernel_version=version, device_kind=device_kind,
                           entries=tuple(entry.result.to_table_entry() for entry in entries),
                           jax_version=jax_versions.pop() if len(jax_versions) == 1 else None)

    def list(self, filters: Mapping[str, Any] | None = None, offset: int = 0,
             limit: int | None = 100,
             problem_type: type = Problem) -> tuple[Rows[Entry], int]:
        """Entries of ``problem_type`` matching ``filters`` (column = value; see FILTER_FIELDS,
        SERVING_FILTER_FIELDS) in insertion order, a page of them, and how many rows match in
        all. The page leaves out the rows this build cannot read (``Rows.skipped`` says why;
        see ``storage.unreadable``)."""
        tables = _RESULT_TABLES[problem_type]
        return self._page(tables.row.__table__, tables.filters, _entry, filters, offset, limit)

    def list_choices(self, filters: Mapping[str, Any] | None = None, offset: int = 0,
                     limit: int | None = 100) -> tuple[Rows[StoredChoice], int]:
        """Kernel choices matching ``filters`` (see CHOICE_FILTER_FIELDS), as ``list``."""
        return self._page(_CHOICES, CHOICE_FILTER_FIELDS, _choice, filters, offset, limit)

    def _page(self, table: Any, known: Sequence[str], convert: Callable[[Any], _T],
              filters: Mapping[str, Any] | None, offset: int,
              limit: int | None) -> tuple[Rows[_T], int]:
        filters = dict(filters or {})
        unknown = sorted(set(filters) - set(known))
        if unknown:
            raise StorageError(f"unknown filter(s) {unknown}; known: {list(known)}")
        if offset < 0 or (limit is not None and limit < 0):
            raise StorageError("offset and limit must be non-negative")
        where = [table.c[name] == value for name, value in filters.items()]
        page = select(table).where(*where).order_by(table.c.id).offset(offset).limit(limit)
        count = select(func.count()).select_from(table).where(*where)
        with self.engine.connect() as connection:
            total = connection.scalar(count) or 0
            items = self.unreadable.read_all(table.name, connection.execute(page).mappings(),
                                             convert)
        return items, total

    def lookup_choices(self, requests: Sequence[tuple[str, Problem]]
                       ) -> list[tuple[StoredChoice, Match] | None]:
        """The kernel choice per ``(device_kind, problem)``: the one stored for exactly the
        problem, else the nearest whose kernel is registered and whose config is legal for it
        (the rule of ``kernel.table.ProblemIndex.nearest``); None when nothing fits. Families are
        read and kept as by ``lookup_many``."""
        out: list[tuple[StoredChoice, Match] | None] = []
        version = self.data_version()  # before reading, so a later write is not masked
        families: dict[tuple[Any, ...], _Family] = {}
        with self.engine.connect() as connection:
            for device_kind, problem in requests:
                values = {"device_kind": device_kind, **problem_columns(problem)}
                exact_rows = connection.execute(
                    _CHOICE_EXACT, {name: values[name] for name in CHOICE_KEY_COLUMNS[:-1]}
                ).mappings()
                exact = next(filter(None, map(self._read_choice, exact_rows)), None)
                if exact is not None:
                    out.append((exact, "exact"))
                    continue
                params = {name: values[name] for name in CHOICE_FAMILY_COLUMNS}
                row = self._nearest_row(connection, _CHOICES,
                                        _CHOICE_FAMILY[problem.softcap is not None], params,
                                        problem, version, families)
                stored = None if row is None else self._read_choice(row)
                out.append(None if stored is None else (stored, "nearest"))
        return out
