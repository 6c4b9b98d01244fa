"""Storage against real databases (a SQLite file and PostgreSQL): keep-better publishing with
history, exact and nearest lookup, listing, table export/import (atomic), migrations that
share a database with Optuna, SQLite concurrency settings, and no jax import."""

from __future__ import annotations

import dataclasses
import datetime
import subprocess
import sys
import threading

import pytest
from sqlalchemy import MetaData, Table, text

from kernel import FlashConfig
from kernel.problem import Problem
from kernel.table import LookupTable, TableEntry
from storage import (
    ConfigKey,
    DatabaseUrlError,
    ResultError,
    SchemaError,
    Store,
    StorageError,
    TunedResult,
    schema_is_current,
    schema_problem,
    upgrade,
)
from storage.schema import VERSION_TABLE

DEVICE = "TPU v5 lite"


def problem(q_len: int = 1024, **fields: object) -> Problem:
    return Problem(**{"batch": 1, "q_heads": 8, "kv_heads": 8, "q_len": q_len, "kv_len": q_len,
                      "head_dim": 128, **fields})


def result(median_ms: float | None = 1.0, *, prob: Problem | None = None,
           config: FlashConfig | None = None, **fields: object) -> TunedResult:
    values = {"device_kind": DEVICE, "default_median_ms": 2.0, "trials": 20,
              "method": "device", "jax_version": "0.10.2",
              "speedup": 2.0 / median_ms if median_ms else None, **fields}
    return TunedResult(problem=prob or problem(), median_ms=median_ms,
                       config=config or FlashConfig(block_q=256, block_kv=512), **values)


def test_a_time_no_measurement_gives_is_refused_and_one_stored_is_replaced(
        store: Store) -> None:
    """Issue 75 item 11j: a published median of 5e-324 ms was stored, and kept out every
    real tune of its key ("published: kept"). Under 100 ns is refused; one stored before
    the floor loses to any measured result."""
    for bogus in (result(5e-324, speedup=None), result(1.0, default_median_ms=1e-9)):
        with pytest.raises(ResultError, match=r"below 0.0001 ms \(100 ns\).*no measurement"):
            store.publish(bogus)
    assert store.publish(result(1.0)).status == "inserted"
    with store.engine.begin() as connection:  # as stored before the floor
        connection.execute(text("UPDATE autotune_configs SET median_ms = 5e-324"))
    assert store.publish(result(2.0), beyond_noise=True).status == "replaced"
    assert store.get(result(2.0).key).result.median_ms == 2.0


def test_a_tune_within_the_noise_keeps_the_better_measured_result(store: Store) -> None:
    """Issue 75 item 11o: two tunes of one problem at once; the one of 1 trial and a 5.2 ms
    IQR published first, and the one of 4 trials (within that noise) went to the history."""
    noisy = result(10.0, trials=1, iqr_ms=5.2)
    measured = result(9.5, config=FlashConfig(block_q=128), trials=4, iqr_ms=0.1)
    assert store.publish(noisy, beyond_noise=True).status == "inserted"
    assert store.publish(measured, beyond_noise=True).status == "replaced"
    assert store.publish(noisy, beyond_noise=True).status == "kept"  # either order: this one
    assert store.get(noisy.key).result == measured
    slower = result(12.0, config=FlashConfig(block_q=512), trials=9, iqr_ms=0.05)
    assert store.publish(slower, beyond_noise=True).status == "kept"  # slower beyond noise


def test_publish_keeps_the_faster_result_and_archives_the_loser(store: Store) -> None:
    first = result(1.0)
    assert store.publish(first).status == "inserted"

    slower = result(1.5, config=FlashConfig(block_q=128))
    outcome = store.publish(slower)
    assert (outcome.status, outcome.entry.result, outcome.previous) == ("kept", first, first)

    faster = result(0.5, config=FlashConfig(block_q=512))
    outcome = store.publish(faster)
    assert (outcome.status, outcome.entry.result, outcome.previous) == ("replaced", faster, first)

    forced = result(3.0, config=FlashConfig(block_q=1024))
    outcome = store.publish(forced, force=True)
    assert (outcome.status, outcome.previous) == ("replaced", faster)
    assert store.get(first.key).result == forced
    assert outcome.entry.created_at <= outcome.entry.updated_at

    history = store.history(first.key)
    assert [(h.reason, h.result) for h in history] == [
        ("rejected", slower), ("replaced", first), ("forced", faster)]


def test_the_same_rejected_result_is_archived_once(store: Store) -> None:
    """A sync job that publishes (imports) the same slower result again and again adds one
    history row, not one per run; another slower result is archived too."""
    store.publish(result(1.0))
    slower = result(1.5, config=FlashConfig(block_q=128))
    for _ in range(3):
        assert store.publish(slower).status == "kept"
    other = result(1.6, config=FlashConfig(block_q=128))
    store.publish(other)
    assert [(h.reason, h.result) for h in store.history(slower.key)] == [
        ("rejected", slower), ("rejected", other)]


def test_speedup_is_derived_when_not_given(store: Store) -> None:
    stored = store.publish(result(0.5, speedup=None)).entry.result
    assert stored.speedup == pytest.approx(4.0)  # default 2.0 ms / 0.5 ms


def test_unmeasured_result_never_replaces_a_measured_one(store: Store) -> None:
    store.publish(result(1.0))
    assert store.publish(result(None)).status == "kept"


def test_illegal_config_is_refused_naming_the_rule(store: Store) -> None:
    bad = result(config=FlashConfig(block_q=384))  # 384 does not divide q_len 1024
    with pytest.raises(ResultError, match="block_divides"):
        store.publish(bad)
    assert store.list()[1] == 0


def test_result_fields_are_validated() -> None:
    with pytest.raises(ResultError, match="median_ms"):
        result(-1.0)
    with pytest.raises(ResultError, match="method"):
        result(method="guess")
    with pytest.raises(ResultError, match="device_kind"):
        result(device_kind=" ")
    with pytest.raises(ResultError,
                       match="timing must be one of step_profile, loop, wallclock, profile"):
        result(timing="stopwatch")
    with pytest.raises(ResultError, match="roofline_bound must be one of compute, memory"):
        result(roofline_bound="disk")
    with pytest.raises(ResultError, match="roofline_fraction"):
        result(roofline_fraction=float("nan"))


def test_lookup_exact_nearest_and_miss(store: Store) -> None:
    # Closest to q_len 512, but its 1024-row block is illegal for 512.
    exact = result(1.0, config=FlashConfig(block_q=1024))
    legal_far = result(1.0, prob=problem(4096), config=FlashConfig(block_q=512, block_kv=512))
    other_dtype = result(1.0, prob=problem(512, dtype="float32"),
                         config=FlashConfig(block_q=128))
    for r in (exact, legal_far, other_dtype):
        store.publish(r)

    entry, match = store.lookup("flash", DEVICE, exact.problem)
    assert (entry.result, match) == (exact, "exact")

    entry, match = store.lookup("flash", DEVICE, problem(512))
    assert (entry.result, match) == (legal_far, "nearest")

    entry, match = store.lookup("flash", DEVICE, problem(2048))
    assert match == "nearest" and entry.result.problem.q_len in (1024, 4096)

    assert store.lookup("flash", DEVICE, problem(64)) is None  # nothing legal for 64
    assert store.lookup("flash", "TPU v4", exact.problem) is None
    assert store.lookup("flash", DEVICE, exact.problem, kernel_version="0") is None
    assert store.lookup("flash", DEVICE, exact.problem, platform="cpu") is None


def test_lookup_many_answers_in_order(store: Store) -> None:
    from storage import LookupRequest

    store.publish(result(1.0))
    answers = store.lookup_many([LookupRequest(DEVICE, problem(64)),
                                 LookupRequest(DEVICE, problem(1024)),
                                 LookupRequest(DEVICE, problem(2048))])
    assert [a and a[1] for a in answers] == [None, "exact", "nearest"]


def test_nearest_lookup_agrees_with_the_table_rule(store: Store) -> None:
    """The store's bounded nearest-first search finds an entry as close as
    ``kernel.table.nearest_entry`` over the whole family, also after a write (the SQLite
    candidate cache follows the data version)."""
    import random

    from kernel.registry import get_kernel

    rng = random.Random(7)
    entries = {}
    for _ in range(150):
        q_len, kv_len = (512 * rng.randint(1, 16) for _ in range(2))
        heads = rng.choice((8, 16, 32))
        tuned = problem(q_len, kv_len=kv_len, q_heads=heads,
                        kv_heads=heads // rng.choice((1, 2, 4)), batch=rng.choice((1, 2, 4)))
        config = FlashConfig(block_q=rng.choice((128, 256, 512)),
                             block_kv=rng.choice((128, 256, 512)))
        entries[tuned] = TableEntry(tuned, config, time_ms=1.0)
    table = LookupTable("flash", "1", DEVICE, tuple(entries.values()))
    store.import_table(table)
    found_nearest = 0
    for round_ in range(2):
        for _ in range(40):
            heads = rng.choice((4, 8, 64))
            asked = problem(64 * rng.randint(1, 80), kv_len=64 * rng.randint(1, 80),
                            q_heads=heads, kv_heads=heads, batch=rng.choice((1, 3, 8)))
            expected = table.lookup(asked)
            found = store.lookup("flash", DEVICE, asked)
            if expected is None:
                assert found is None, asked
                continue
            assert found is not None and found[1] == expected[1], asked
            found_nearest += found[1] == "nearest"
            assert asked.distance(found[0].result.problem) == pytest.approx(
                asked.distance(expected[0].problem)), asked
            assert not get_kernel("flash").stored_violations(asked, found[0].result.config)
        if round_ == 0:  # a write between rounds: the next lookups see it
            newcomer = TableEntry(problem(1152, kv_len=1152), FlashConfig(block_q=128,
                                                                           block_kv=128), 1.0)
            table = dataclasses.replace(table, entries=(*table.entries, newcomer))
            store.import_table(dataclasses.replace(table, entries=(newcomer,)))
    assert found_nearest > 20


def test_list_filters_and_pages(store: Store) -> None:
    for q_len in (256, 512, 1024):
        store.publish(result(prob=problem(q_len), config=FlashConfig(block_q=256, block_kv=256)))
    store.publish(result(prob=problem(256, dtype="float32"), config=FlashConfig()))
    entries, total = store.list({"dtype": "bfloat16"}, offset=1, limit=1)
    assert total == 3 and [e.result.problem.q_len for e in entries] == [512]
    assert store.list({"device_kind": "nope"}) == ([], 0)
    with pytest.raises(StorageError, match="unknown filter"):
        store.list({"colour": "red"})


def test_export_and_import_round_trip(store: Store, tmp_path) -> None:
    for q_len in (256, 512):
        store.publish(result(prob=problem(q_len), config=FlashConfig(block_q=256,
                                                                      block_kv=256)))
    store.publish(result(prob=problem(512), device_kind="cpu", config=FlashConfig()))
    table = store.export_table(DEVICE)
    assert (table.kernel, table.device_kind, len(table.entries)) == ("flash", DEVICE, 2)
    assert table.jax_version == "0.10.2"

    url = f"sqlite:///{tmp_path / 'other.db'}"
    upgrade(url)
    with Store(url) as other:
        outcomes = other.import_table(LookupTable.from_dict(table.to_dict()))
        assert [o.status for o in outcomes] == ["inserted", "inserted"]
        assert other.export_table(DEVICE).to_dict() == table.to_dict()
        assert [o.status for o in other.import_table(table)] == ["kept", "kept"]


def test_re_importing_the_same_table_changes_nothing(store: Store) -> None:
    """Identical entries are no-ops, even forced: no history row per re-import."""
    entries = tuple(TableEntry(problem(q_len), FlashConfig(block_q=256, block_kv=256),
                               time_ms=1.0, provenance={"trials": 4})
                    for q_len in (256, 512))
    table = LookupTable("flash", "1", DEVICE, entries)
    assert [o.status for o in store.import_table(table)] == ["inserted", "inserted"]
    before = store.list()[0]
    for force in (False, True):
        assert [o.status for o in store.import_table(table, force=force)] == ["kept", "kept"]
    assert store.list()[0] == before
    key = ConfigKey("flash", "1", DEVICE, "tpu", problem(256))
    assert store.history(key) == []


def test_import_is_all_or_nothing(store: Store) -> None:
    good = TableEntry(problem(512), FlashConfig(block_q=256, block_kv=256), time_ms=1.0)
    bad = TableEntry(problem(512), FlashConfig(block_q=384), time_ms=1.0)
    table = LookupTable("flash", "1", DEVICE, (good, good, bad))
    with pytest.raises(ResultError, match=r"entry 2 .*block_divides"):
        store.import_table(table)
    assert store.list() == ([], 0)


@pytest.mark.parametrize("field, value", [
    ("device_kind", "TPU " + "v" * 200), ("device_kind", "TPU\x00v5"),
    ("device_kind", "TPU \ud800"), ("study", "s" * 300), ("platform", 5),
    ("trials", 2**31), ("trials", 2**64)])
def test_values_that_a_column_cannot_hold_are_refused(store: Store, field: str,
                                                     value: object) -> None:
    """Text too long or not encodable, integers beyond a 32-bit column: a ResultError naming
    the field, before the database sees it (SQLite and PostgreSQL alike)."""
    with pytest.raises(ResultError, match=field):
        result(**{field: value})
    provenance = {field: value} if field != "device_kind" else {}
    entry = TableEntry(problem(512), FlashConfig(block_q=256, block_kv=256), time_ms=1.0,
                       provenance=provenance)
    table = LookupTable("flash", "1", value if field == "device_kind" else DEVICE, (entry,))
    with pytest.raises(ResultError, match=f"entry 0 .*{field}"):
        store.import_table(table)
    assert store.list() == ([], 0)


def test_concurrent_publishers_of_one_key_lose_nothing(store: Store) -> None:
    medians = [1.0 + i / 10 for i in range(8)]
    errors: list[BaseException] = []

    def publish(median: float) -> None:
        try:
            store.publish(result(median))
        except BaseException as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=publish, args=(m,)) for m in medians]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    key = result().key
    assert store.get(key).result.median_ms == min(medians)
    archived = sorted(h.result.median_ms for h in store.history(key))
    assert archived == sorted(medians)[1:]


def test_imports_of_the_same_keys_in_opposite_orders_both_land(store: Store) -> None:
    """Each import locks its rows in key order: in table order, two imports of the same
    keys, one reversed, deadlocked on PostgreSQL and one was refused."""
    def table(median: float, order: list[int]) -> LookupTable:
        return LookupTable("flash", "1", DEVICE, tuple(
            TableEntry(problem(128 * (1 + i // 20), batch=1 + i % 20), FlashConfig(
                block_q=128, block_kv=128), time_ms=median) for i in order))

    keys = list(range(200))
    store.import_table(table(5.0, keys))
    errors: list[BaseException] = []

    def force(median: float, order: list[int]) -> None:
        try:
            outcomes = store.import_table(table(median, order), force=True)
            assert [o.entry.result.problem for o in outcomes] == [
                e.problem for e in table(median, order).entries]  # in the table's order
        except BaseException as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    for attempt in range(3):
        threads = [threading.Thread(target=force, args=(1.0 + attempt, keys)),
                   threading.Thread(target=force, args=(2.0 + attempt, keys[::-1]))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == []


def test_a_speedup_too_large_for_a_float_is_left_out(store: Store) -> None:
    """Derived as default / median (1e306 / 1e-3 is inf): stored as unknown, not refused."""
    outcome = store.publish(result(1e-3, default_median_ms=1e306, speedup=None))
    assert outcome.status == "inserted" and outcome.entry.result.speedup is None


def test_get_by_key(store: Store) -> None:
    stored = result()
    store.publish(stored)
    assert store.get(stored.key).result == stored
    assert store.get(dataclasses.replace(stored.key, platform="cpu")) is None
    assert store.get(ConfigKey("flash", "1", DEVICE, "tpu", problem(2048))) is None


def test_migrations_share_the_database_with_optuna(empty_db_url: str) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=empty_db_url, study_name="shared")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)

    assert not schema_is_current(empty_db_url)
    with Store(empty_db_url) as store:
        with pytest.raises(SchemaError, match="autotune db upgrade --db"):
            store.require_current_schema()
    upgrade(empty_db_url)
    upgrade(empty_db_url)  # idempotent
    assert schema_is_current(empty_db_url)

    with Store(empty_db_url) as store:
        with store.engine.connect() as connection:
            ours = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).all()
            optunas = connection.execute(text("SELECT version_num FROM alembic_version")).all()
        assert len(ours) == 1 and len(optunas) == 1 and ours != optunas
        store.publish(result())
    reloaded = optuna.load_study(storage=empty_db_url, study_name="shared")
    assert len(reloaded.trials) == 2


def test_upgrade_keeps_rows_and_adds_timing_and_roofline(empty_db_url: str) -> None:
    """A row stored at revision 0001 survives the upgrade with no timing or roofline (never
    recorded); a result with them round-trips, also through a lookup table."""
    upgrade(empty_db_url, "0001")
    old = result(2.0)
    with Store(empty_db_url) as store:
        configs = Table("autotune_configs", MetaData(), autoload_with=store.engine)
        now = datetime.datetime.now(datetime.UTC)
        with store.engine.begin() as connection:
            columns = {name: v for name, v in old.key.columns().items() if name in configs.c}
            connection.execute(configs.insert().values(
                **columns, config=old.config.to_dict(), median_ms=2.0,
                method="device", created_at=now, updated_at=now))
    upgrade(empty_db_url)
    with Store(empty_db_url) as store:
        kept = store.get(old.key).result
        assert (kept.median_ms, kept.method) == (2.0, "device")
        assert (kept.timing, kept.achieved_tflops, kept.roofline_fraction,
                kept.roofline_bound) == (None, None, None, None)
        new = result(1.0, timing="step_profile", achieved_tflops=151.5,
                     roofline_fraction=0.77, roofline_bound="compute", kernel_median_ms=0.8)
        assert store.publish(new).status == "replaced"
        assert store.get(new.key).result == new
        [entry] = store.export_table(DEVICE).entries
        assert TunedResult.from_table_entry(entry, kernel="flash", kernel_version="1",
                                            device_kind=DEVICE) == new


def test_a_database_at_another_revision_is_reported(db_url: str) -> None:
    """No revision recorded: run `autotune db upgrade`; a revision this version does not know:
    a newer version wrote it (upgrading the schema cannot help)."""
    with Store(db_url) as store:
        with store.engine.begin() as connection:
            connection.execute(text(f"DELETE FROM {VERSION_TABLE}"))
        assert "has no autotune schema" in store.schema_problem()
        assert "autotune db upgrade" in store.schema_problem()
        with store.engine.begin() as connection:
            connection.execute(text(f"INSERT INTO {VERSION_TABLE} VALUES ('f00d0099')"))
        assert "newer version of flash-autotune (schema revision f00d0099" in \
            store.schema_problem()
        with pytest.raises(SchemaError, match="newer version"):
            upgrade(store.engine)


def test_unreachable_database_is_reported() -> None:
    with Store("postgresql://nobody@127.0.0.1:1/none") as store:
        assert store.url.startswith("postgresql+psycopg://")
        assert store.schema_problem().startswith("cannot reach the database")


def test_sqlite_uses_wal_and_a_busy_timeout(sqlite_db_url: str) -> None:
    with Store(sqlite_db_url) as store, store.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000


def test_schema_problem_is_none_when_current(db_url: str) -> None:
    with Store(db_url) as store:
        assert schema_problem(store.engine) is None


def test_storage_and_api_do_not_import_jax() -> None:
    code = ("import sys, storage, api; api.create_app; "
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr


def test_data_version_is_none_while_the_file_is_not_a_database(tmp_path) -> None:
    """The service caches nothing then, and its query meets the error as a 503 (not a 500)."""
    path = tmp_path / "autotune.db"
    path.write_bytes(b"this is not a SQLite database " * 200)
    with Store(f"sqlite:///{path}") as store:
        assert store.data_version() is None
        path.unlink()
        upgrade(f"sqlite:///{path}")
        assert isinstance(store.data_version(), int)  # readable again: a fresh watcher


def test_an_unknown_sqlite_driver_is_a_database_url_error() -> None:
    with pytest.raises(DatabaseUrlError, match="no driver for 'sqlite\\+nope'"):
        Store("sqlite+nope:///autotune.db")


@pytest.mark.parametrize("url, message", [
    ("postgresql://tuner:s3cret@host:notaport/db", "cannot parse database URL 'postgresql://"
                                                   "tuner:\\*\\*\\*@host:notaport/db'"),
    ("sqlite:///autotune.db?timeout=abc", "a bad argument in database URL"),
])
def test_a_malformed_part_of_a_url_is_a_database_url_error(url: str, message: str) -> None:
    """A port or query argument SQLAlchemy cannot convert (a ValueError, once a traceback)."""
    with pytest.raises(DatabaseUrlError, match=message) as raised:
        Store(url)
    assert "s3cret" not in str(raised.value)
