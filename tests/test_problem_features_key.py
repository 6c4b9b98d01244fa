"""Issue 48: a problem's window, softcap and segment ids are part of its key everywhere it
flows: storage (migration 0007), the nearest-problem rule (tables, store, service), the API.
Issue 73: so is bottom-right alignment (migration 0010, table schema 4)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from alembic import command
from sqlalchemy import MetaData, Table, select
from typer.testing import CliRunner

from api.routers.pages import detail_link
from autotune.problem_options import load_shapes, with_problem_options
from autotune.tune import kernel_space, study_name, warm_seeds
from kernel import FlashConfig, get_kernel

from kernel.errors import ProblemError, TableError
from kernel.problem import FEATURE_FIELDS, SOFTCAP_RANGE, Problem
from kernel.service import ServiceClient, _config_params
from kernel.shapesfile import save_shapes
from kernel.table import (
    TABLE_SCHEMA_VERSION,
    KernelChoice,
    KernelTiming,
    LookupTable,
    TableEntry,
    find_choice,
    find_entry,
)
from storage import Store, TunedResult, upgrade
from storage.choices import choice_columns
from storage.schema import alembic_config
from tests.conftest import Server, problem_flags

DEVICE = "TPU v5 lite"
PROBLEM_FIELDS = tuple(field.name for field in dataclasses.fields(Problem))
PLAIN = Problem(batch=1, q_heads=4, kv_heads=4, q_len=1024, kv_len=1024, head_dim=128,
                causal=True)
WINDOWED = dataclasses.replace(PLAIN, window=(256, 0))
CAPPED = dataclasses.replace(PLAIN, softcap=50.0)
SEGMENTED = dataclasses.replace(PLAIN, segmented=True)
CHUNKED = dataclasses.replace(PLAIN, q_len=256, bottom_right=True)  # a prefill chunk
FEATURED = (WINDOWED, CAPPED, SEGMENTED, CHUNKED)
XLA = get_kernel("xla")


def xla_result(problem: Problem, median_ms: float = 1.0) -> TunedResult:
    return TunedResult(device_kind=DEVICE, problem=problem, config=XLA.default_config(problem),
                       median_ms=median_ms, kernel="xla")


def xla_choice(problem: Problem) -> KernelChoice:
    return KernelChoice(problem, "xla", XLA.default_config(problem),
                        {"xla": KernelTiming(median_ms=1.0)})


def bigger(problem: Problem) -> Problem:
    """The same family, another shape: only a nearest match can answer it."""
    return dataclasses.replace(problem, q_len=2 * problem.q_len, kv_len=2 * problem.kv_len)


# --- the key: a window that covers every key is no window ---


@pytest.mark.parametrize(("window", "causal", "covers"), [
    ((4095, 0), True, True), ((255, 0), True, True), ((254, 0), True, False),
    ((255, 255), False, True), ((4095, 254), False, False), ((254, 4095), False, False)])
def test_a_window_that_covers_every_key_is_the_plain_problem(
        window: tuple[int, int], causal: bool, covers: bool) -> None:
    short = dataclasses.replace(PLAIN, q_len=256, kv_len=256, causal=causal)
    windowed = dataclasses.replace(short, window=window)
    assert (windowed == short) is covers
    assert (windowed.window is None) is covers and ("window" in windowed.label()) is not covers


def test_a_covering_window_is_said_once_and_reaches_the_cli_as_the_plain_problem(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import kernel.problem

    monkeypatch.setattr(kernel.problem, "_said_covering", False)
    caplog.set_level("WARNING", logger="kernel.problem")
    short = dataclasses.replace(PLAIN, q_len=256, kv_len=256)
    done = CliRunner().invoke(_problem_app(), [*problem_flags(short), "--window", "4095,0"])
    assert done.exit_code == 0, done.output
    assert Problem.from_dict(json.loads(done.output)) == short
    assert dataclasses.replace(short, window=(1000, 0)) == short
    [said] = [r.getMessage() for r in caplog.records]
    assert "window=(4095, 0) covers every key at q_len 256, kv_len 256: it is the plain " \
           "causal problem" in said


# --- storage: migration 0007 ---


def test_the_migration_keeps_old_rows_as_plain_problems_and_round_trips(
        empty_db_url: str) -> None:
    """Rows stored at 0006 read back with no window, no softcap, unsegmented; a featured
    problem of the same shape is another key; the downgrade drops only featured rows."""
    upgrade(empty_db_url, "0006")
    old = xla_result(PLAIN, 2.0)
    now = datetime.datetime.now(datetime.UTC)
    with Store(empty_db_url) as store, store.engine.begin() as connection:
        tables = MetaData()
        configs, history, choices = (Table(name, tables, autoload_with=connection) for name in (
            "autotune_configs", "autotune_config_history", "autotune_kernel_choices"))
        row = {name: value for name, value in old.key.columns().items() if name in configs.c}
        connection.execute(configs.insert().values(**row, config={}, median_ms=2.0,
                                                   created_at=now, updated_at=now))
        connection.execute(history.insert().values(**row, config={}, median_ms=3.0,
                                                   created_at=now, updated_at=now,
                                                   reason="rejected", archived_at=now))
        columns = choice_columns(DEVICE, xla_choice(PLAIN))
        connection.execute(choices.insert().values(
            **{name: value for name, value in columns.items() if name in choices.c},
            created_at=now, updated_at=now))
    upgrade(empty_db_url)
    with Store(empty_db_url) as store:
        assert store.get(old.key).result == old
        assert [h.result.median_ms for h in store.history(old.key)] == [3.0]
        [(stored, match)] = store.lookup_choices([(DEVICE, PLAIN)])
        assert (stored.choice.problem, match) == (PLAIN, "exact")
        for problem in FEATURED:
            assert store.publish(xla_result(problem)).status == "inserted"
            assert store.get(xla_result(problem).key).result.problem == problem
            store.publish_choice(DEVICE, xla_choice(problem))
        assert store.publish(xla_result(PLAIN, 1.0)).status == "replaced"
        assert store.list()[1] == store.list_choices()[1] == 1 + len(FEATURED)
    with Store(empty_db_url) as store, store.engine.begin() as connection:
        command.downgrade(alembic_config(connection), "0006")
    with Store(empty_db_url) as store, store.engine.connect() as connection:
        configs = Table("autotune_configs", MetaData(), autoload_with=connection)
        assert "window_left" not in configs.c
        assert connection.execute(select(configs.c.median_ms)).scalars().all() == [1.0]
    upgrade(empty_db_url)
    with Store(empty_db_url) as store:
        assert store.get(old.key).result.median_ms == 1.0


def test_migration_0010_keeps_old_rows_top_left_and_drops_bottom_right_ones_on_downgrade(
        empty_db_url: str) -> None:
    """Issue 73: rows stored at 0009 read back top-left; the bottom-right twin of a shape is
    a key of its own; the downgrade deletes only the bottom-right rows."""
    top_left = dataclasses.replace(CHUNKED, bottom_right=False)
    upgrade(empty_db_url, "0009")
    with Store(empty_db_url) as store, store.engine.begin() as connection:
        configs = Table("autotune_configs", MetaData(), autoload_with=connection)
        assert "bottom_right" not in configs.c
        row = {name: value for name, value in xla_result(top_left).key.columns().items()
               if name in configs.c}
        now = datetime.datetime.now(datetime.UTC)
        connection.execute(configs.insert().values(**row, config={}, median_ms=2.0,
                                                   created_at=now, updated_at=now))
    upgrade(empty_db_url)
    with Store(empty_db_url) as store:
        assert store.get(xla_result(top_left).key).result.median_ms == 2.0
        assert store.get(xla_result(CHUNKED).key) is None
        assert store.publish(xla_result(CHUNKED, 1.0)).status == "inserted"
        store.publish_choice(DEVICE, xla_choice(CHUNKED))
        assert store.get(xla_result(CHUNKED).key).result.problem == CHUNKED
    with Store(empty_db_url) as store, store.engine.begin() as connection:
        command.downgrade(alembic_config(connection), "0009")
    with Store(empty_db_url) as store, store.engine.connect() as connection:
        configs = Table("autotune_configs", MetaData(), autoload_with=connection)
        assert connection.execute(select(configs.c.median_ms)).scalars().all() == [2.0]
        choices = Table("autotune_kernel_choices", MetaData(), autoload_with=connection)
        assert connection.execute(select(choices.c.id)).all() == []


def test_a_featured_problem_is_stored_under_its_own_key(store: Store) -> None:
    """The unique key holds the features: each featured twin of a shape is a row of its own,
    and a softcap's value is part of the exact key."""
    for problem in (PLAIN, *FEATURED, dataclasses.replace(CAPPED, softcap=30.0)):
        assert store.publish(xla_result(problem)).status == "inserted"
    assert store.list({"segmented": True})[1] == 1
    assert store.list()[1] == 6
    store.publish_choice(DEVICE, xla_choice(SEGMENTED))
    exported = store.export_table(DEVICE, "xla")
    with Store("sqlite://") as copy:  # an export imports whole into another database
        copy.import_table(LookupTable.from_dict(json.loads(json.dumps(exported.to_dict()))))
        again = copy.export_table(DEVICE, "xla")  # in the order of the import's writes
    assert set(again.entries) == set(exported.entries) and len(again.entries) == 6
    # the stored choice, and (issue 75 item 3) a choice of xla for each other entry of it
    assert xla_choice(SEGMENTED) in exported.choices
    assert {c.problem for c in again.choices} == {e.problem for e in again.entries}


# --- the nearest-problem rule, in each direction ---

# (asked, stored, answered by nearest?)
NEAREST_CASES = [
    (WINDOWED, PLAIN, False), (PLAIN, WINDOWED, False),
    (WINDOWED, dataclasses.replace(PLAIN, window=(512, 0)), False),  # window must match
    (CAPPED, PLAIN, False), (PLAIN, CAPPED, False),
    (CAPPED, dataclasses.replace(PLAIN, softcap=30.0), True),  # any softcap value
    (SEGMENTED, PLAIN, False), (PLAIN, SEGMENTED, False),
    (CHUNKED, dataclasses.replace(CHUNKED, bottom_right=False), False),  # top-left: no answer
    (dataclasses.replace(CHUNKED, bottom_right=False), CHUNKED, False),
    (WINDOWED, WINDOWED, True), (SEGMENTED, SEGMENTED, True), (CHUNKED, CHUNKED, True),
]
CASE_IDS = [f"{asked.label()}<-{stored.label()}" for asked, stored, _ in NEAREST_CASES]


@pytest.mark.parametrize(("asked", "stored", "answered"), NEAREST_CASES, ids=CASE_IDS)
def test_the_table_resolver_keeps_features_apart(asked: Problem, stored: Problem,
                                                 answered: bool) -> None:
    entry = TableEntry(bigger(stored), XLA.default_config(stored))
    found = find_entry(asked, [entry], "xla")
    assert (found == (entry, "nearest")) if answered else found is None
    choice = xla_choice(bigger(stored))
    found_choice = find_choice(asked, [choice])
    assert (found_choice == (choice, "nearest")) if answered else found_choice is None


@pytest.mark.parametrize(("asked", "stored", "answered"), NEAREST_CASES, ids=CASE_IDS)
def test_the_store_keeps_features_apart(store: Store, asked: Problem, stored: Problem,
                                        answered: bool) -> None:
    store.publish(xla_result(bigger(stored)))
    store.publish_choice(DEVICE, xla_choice(bigger(stored)))
    found = store.lookup("xla", DEVICE, asked)
    assert (found is not None and found[1] == "nearest") if answered else found is None
    [found_choice] = store.lookup_choices([(DEVICE, asked)])
    assert (found_choice is not None) if answered else found_choice is None
    if answered:
        assert found[0].result.problem == bigger(stored)
        assert found_choice[0].choice.problem == bigger(stored)


# --- CLI flags and shapes files ---


def _problem_app() -> typer.Typer:
    """A command taking the problem flags (``with_problem_options``, as tune and precheck),
    printing the problem it gets."""
    app = typer.Typer()

    @app.command()
    @with_problem_options
    def show(problem: Problem) -> None:
        typer.echo(json.dumps(problem.to_dict()))

    return app


def test_the_problem_flags_set_the_features() -> None:
    done = CliRunner().invoke(_problem_app(), [*problem_flags(WINDOWED), "--softcap", "50",
                                               "--segmented"])
    assert done.exit_code == 0, done.output
    assert Problem.from_dict(json.loads(done.output)) == dataclasses.replace(
        WINDOWED, softcap=50.0, segmented=True)
    plain = CliRunner().invoke(_problem_app(), problem_flags(PLAIN))
    assert Problem.from_dict(json.loads(plain.output)) == PLAIN
    chunked = CliRunner().invoke(_problem_app(), problem_flags(CHUNKED))
    assert Problem.from_dict(json.loads(chunked.output)) == CHUNKED


@pytest.mark.parametrize("softcap", [1e300, 3.4e38, 1.01e30, 1e-300, 1e-40, 0.99e-30])
def test_a_softcap_outside_its_float32_range_is_refused(softcap: float) -> None:
    """Issue 62 item 5: a shapes file, table or service key with softcap 1e300 (inf in float32)
    or 1e-300 (0) was taken, and every output of the kernels was NaN; at 3.4e38 (float32's
    largest) xla's gradients are."""
    with pytest.raises(ProblemError, match=r"^softcap must be positive and finite .* the "
                                           r"kernels apply it in float32, where it must lie "
                                           r"from 1e-30 to 1e\+30 "):
        Problem.from_dict({**PLAIN.to_dict(), "softcap": softcap})
    for cap in SOFTCAP_RANGE:
        assert Problem.from_dict({**PLAIN.to_dict(), "softcap": cap}).softcap == cap


def test_softcaps_that_differ_past_six_digits_have_labels_and_studies_of_their_own() -> None:
    """Issue 55 item 12: 50.0000001 and 50.0000002 were both ``softcap50``, one study, and the
    second tune exited 2 naming a --study flag never given; an exact value keeps its short
    label (its study resumes)."""
    capped = [dataclasses.replace(PLAIN, softcap=cap) for cap in (50.0000001, 50.0000002)]
    assert [p.feature_labels() for p in capped] == [["softcap50.0000001"], ["softcap50.0000002"]]
    flash = get_kernel("flash")
    assert len({study_name(p, DEVICE, flash, "profile") for p in capped}) == 2
    assert [dataclasses.replace(PLAIN, softcap=cap).feature_labels()
            for cap in (50.0, 1e20, 1e-05, 0.1)] == [
        ["softcap50"], ["softcap1e+20"], ["softcap1e-05"], ["softcap0.1"]]


@pytest.mark.parametrize(("flags", "message"), [
    (["--window", "512"], "Invalid value for '--window': give the keys visible before and "
                          "after each query as two non-negative integers L,R"),
    (["--window", "-1,0"], "--window 4095,0), got '-1,0'"),
    (["--window", "1,2,3"], "Invalid value for '--window'"),
    (["--softcap", "0"], "Invalid value for '--softcap': give a positive finite number"),
    (["--softcap", "nan"], "Invalid value for '--softcap'"),
    (["--softcap", "-inf"], "Invalid value for '--softcap'"),
    # Issue 62 item 5: float32 holds neither (inf, or 0): tune recorded every config
    # wrong_result, as every output was NaN.
    (["--softcap", "1e300"], "Invalid value for '--softcap': give a positive finite number (e.g. "
                             "--softcap 50) from 1e-30 to 1e+30 (the kernels apply it in "
                             "float32); got 1e+300"),
    (["--softcap", "1e-300"], "from 1e-30 to 1e+30 (the kernels apply it in float32); got "
                              "1e-300"),
])
def test_a_bad_feature_flag_is_named_with_its_fix(flags: list[str], message: str) -> None:
    done = CliRunner().invoke(_problem_app(), flags, env={"COLUMNS": "250"})
    assert done.exit_code == 2 and message in " ".join(done.output.split()), done.output


def test_a_shapes_file_takes_the_features(tmp_path: Path) -> None:
    shapes = tmp_path / "shapes.yaml"
    shapes.write_text("- {batch: 1, q_heads: 4, q_len: 1024, head_dim: 128, causal: true,\n"
                      "   window: [256, 0], softcap: 50, segmented: true}\n"
                      "- {batch: 1, q_heads: 4, q_len: 1024, head_dim: 128, causal: true}\n")
    featured = dataclasses.replace(WINDOWED, softcap=50.0, segmented=True)
    assert load_shapes(shapes) == [featured, PLAIN]
    save_shapes(shapes, [featured, PLAIN])
    assert load_shapes(shapes) == [featured, PLAIN]
    assert "window" not in shapes.read_text().splitlines()[-1]  # a plain line as before
    shapes.write_text("- {batch: 1, q_heads: 4, q_len: 1024, head_dim: 128, window: [-1, 0]}\n")
    with pytest.raises(typer.BadParameter, match="problem 0: window left side must be between"):
        load_shapes(shapes)


# --- the service: request models, lookups, batches, lists, and the resolver's client ---


def _params(device_kind: str, problem: Problem) -> list[tuple[str, Any]]:
    """A lookup's query: the window as two ``window`` parameters, features in use only."""
    return _config_params(device_kind, problem, XLA)


def _body(device_kind: str, problem: Problem) -> dict[str, Any]:
    """A choice key's JSON (a config key's adds ``kernel``)."""
    return {"device_kind": device_kind,
            **{name: value for name, value in problem.to_dict().items() if value is not None}}


@pytest.mark.parametrize(("asked", "stored", "answered"), NEAREST_CASES, ids=CASE_IDS)
def test_the_service_keeps_features_apart(server: Server, asked: Problem, stored: Problem,
                                          answered: bool) -> None:
    """Every lookup endpoint (config and choice, one and batch) and the resolver's client."""
    kind = f"TPU test {uuid.uuid4().hex[:8]}"
    with Store(server.db_url) as store:
        store.publish(dataclasses.replace(xla_result(bigger(stored)), device_kind=kind))
        store.publish_choice(kind, xla_choice(bigger(stored)))
    config = httpx.get(f"{server.url}/v1/configs/lookup", params=_params(kind, asked))
    choice = httpx.get(f"{server.url}/v1/choices/lookup", params=_params(kind, asked)[2:])
    batches = [httpx.post(f"{server.url}/v1/{what}/lookup:batch",
                          json={"keys": [{**_body(kind, asked), **extra}]}).json()["results"][0]
               for what, extra in (("configs", {"kernel": "xla"}), ("choices", {}))]
    assert [config.status_code, choice.status_code] == [200, 200] if answered else [404, 404]
    assert [batch["found"] for batch in batches] == [answered, answered]
    if answered:
        for found in (config.json(), choice.json(), *batches):
            assert found["match"] == "nearest"
        assert Problem.from_dict({name: config.json()["key"][name] for name in PROBLEM_FIELDS}) \
            == bigger(stored)
        assert Problem.from_dict(choice.json()["problem"]) == bigger(stored)
    else:
        assert "window, segment ids or none, alignment, and softcap (any value) or none" in \
            config.json()["detail"]
    client = ServiceClient(server.url, timeout_s=10, breaker_s=1)
    answer = client.config(kind, asked, XLA)
    assert (answer.value is not None and answer.value.origin == bigger(stored)) \
        if answered else answer.value is None, answer.why
    assert (client.choice(kind, asked).value is not None) == answered


def test_the_list_endpoints_show_and_filter_the_features(server: Server) -> None:
    kind = f"TPU test {uuid.uuid4().hex[:8]}"
    featured = dataclasses.replace(WINDOWED, softcap=50.0, segmented=True)
    with Store(server.db_url) as store:
        for problem in (PLAIN, featured):
            store.publish(dataclasses.replace(xla_result(problem), device_kind=kind))
            store.publish_choice(kind, xla_choice(problem))
    for path, problem_of in (("configs", lambda item: item["key"]),
                             ("choices", lambda item: item["problem"])):
        listed = httpx.get(f"{server.url}/v1/{path}", params={"device_kind": kind}).json()
        assert [Problem.from_dict({name: problem_of(item)[name] for name in PROBLEM_FIELDS})
                for item in listed["items"]] == [PLAIN, featured]
        only = httpx.get(f"{server.url}/v1/{path}",
                         params={"device_kind": kind, "segmented": "true"}).json()
        assert [problem_of(item)["window"] for item in only["items"]] == [[256, 0]]


@pytest.mark.parametrize(("fields", "location", "messages"), [
    ({"window": [-1, 0]}, ["window", 0], "greater than or equal to 0"),
    ({"window": [256]}, ["window"], "at least 2 items"),
    ({"window": [1, 2, 3]}, ["window"], "at most 2 items"),
    ({"softcap": 0}, ["softcap"], "greater than 0"),
    ({"softcap": -5.0}, ["softcap"], "greater than 0"),
    # Issue 62 item 5: beyond float32 (every output NaN) it was looked up.
    ({"softcap": 1e308}, ["softcap"], "less than or equal to 1" + "0" * 30),
    ({"softcap": "nan"}, ["softcap"], ("give a decimal number, got 'nan'", "valid number")),
    ({"segmented": "sometimes"}, ["segmented"], ("give true or false", "valid boolean")),
    # Issue 55 item 14: values of another type were coerced (true stored as softcap 1.0,
    # [true, false] as the window [1, 0], "yes" as true, 64.0 as 64).
    ({"softcap": True}, ["softcap"], ("give a decimal number, got 'true'", "valid number")),
    ({"window": [64.0, 0]}, ["window", 0], ("give an integer, got '64.0'", "valid integer")),
    ({"window": [True, 0]}, ["window", 0], ("give an integer, got 'true'", "valid integer")),
    ({"segmented": "yes"}, ["segmented"], ("give true or false, got 'yes'", "valid boolean")),
    ({"causal": 1}, ["causal"], ("give true or false, got '1'", "valid boolean")),
])
def test_a_bad_feature_is_a_422_naming_it(server: Server, fields: dict[str, Any],
                                          location: list[Any],
                                          messages: str | tuple[str, str]) -> None:
    """In a lookup's query and in a batch's body alike (the query's text in its type's plain
    form, the body's JSON of its type); nothing else is refused."""
    body = {**_body("TPU v5 lite", PLAIN), **fields}
    params = [(name, str(side).lower() if isinstance(side, bool) else side)
              for name, value in body.items()
              for side in (value if isinstance(value, list) else [value])]
    query_message, body_message = (messages, messages) if isinstance(messages, str) else messages
    for response, prefix, message in (
            (httpx.get(f"{server.url}/v1/configs/lookup", params=params), ["query"],
             query_message),
            (httpx.post(f"{server.url}/v1/configs/lookup:batch", json={"keys": [body]}),
             ["body", "keys", 0], body_message)):
        assert response.status_code == 422, response.text
        [error] = response.json()["detail"]
        where = location[:1] if error["type"] == "plain_text" else location  # the field's text
        assert error["loc"] == [*prefix, *where] and message in error["msg"], error


# --- lookup tables: schema 3 ---


def test_a_table_carries_the_features_and_older_schemas_still_load() -> None:
    featured = dataclasses.replace(WINDOWED, softcap=50.0, segmented=True)
    table = LookupTable(kernel="xla", kernel_version="1", device_kind=DEVICE,
                        entries=(TableEntry(featured, XLA.default_config(featured)),
                                 TableEntry(PLAIN, XLA.default_config(PLAIN))),
                        choices=(xla_choice(featured),))
    exported = json.loads(json.dumps(table.to_dict()))
    assert exported["schema_version"] == TABLE_SCHEMA_VERSION == 5
    assert exported["problem_type"] == "attention"
    assert LookupTable.from_dict(exported) == table
    for version in (1, 2):  # written before the features: every problem is a plain one
        old = {**exported, "schema_version": version, "choices": [],
               "entries": [{**exported["entries"][1], "problem": {
                   name: value for name, value in PLAIN.to_dict().items()
                   if name not in FEATURE_FIELDS}}]}
        [entry] = LookupTable.from_dict(old).entries
        assert entry.problem == PLAIN
        # Issue 55 item 15: a featured problem in an older schema loaded.
        with pytest.raises(TableError, match=f"entry 0: problem field.s. window, softcap, "
                                             f"segmented came with schema_version 3; a schema "
                                             f"{version} table has none"):
            LookupTable.from_dict({**old, "entries": exported["entries"]})
    with pytest.raises(TableError, match="choice 0: problem field"):
        LookupTable.from_dict({**exported, "schema_version": 2, "entries": []})
    aligned = LookupTable(kernel="xla", kernel_version="1", device_kind=DEVICE,
                          entries=(TableEntry(CHUNKED, XLA.default_config(CHUNKED)),))
    schema_3 = {**aligned.to_dict(), "schema_version": 3}
    with pytest.raises(TableError, match="entry 0: problem field.s. bottom_right came with "
                                         "schema_version 4; a schema 3 table has none"):
        LookupTable.from_dict(schema_3)
    with pytest.raises(TableError, match="schema_version 6 is newer than this build"):
        LookupTable.from_dict({**exported, "schema_version": 6})


# --- pages ---


def test_the_pages_show_and_link_featured_problems(server: Server) -> None:
    """The list's features column, and each row's detail link opens its own config (the
    plain twin of the same shape is another page)."""
    kind = f"TPU test {uuid.uuid4().hex[:8]}"
    featured = dataclasses.replace(WINDOWED, softcap=50.0, segmented=True)
    results = [dataclasses.replace(xla_result(problem, ms), device_kind=kind)
               for problem, ms in ((PLAIN, 1.0), (featured, 3.0))]
    with Store(server.db_url) as store:
        for result in results:
            store.publish(result)
    listed = httpx.get(f"{server.url}/", params={"device_kind": kind}).text
    assert "<td>window256,0 softcap50 segmented</td>" in listed
    for result in results:
        page = httpx.get(f"{server.url}{detail_link(result.key)}", timeout=60)
        assert page.status_code == 200, page.text
        assert f"<h1>{result.problem.label()} " in page.text


def test_the_tuner_seeds_only_from_its_problems_family(store: Store) -> None:
    """A local layer's winner is no warm seed for a global layer of the same shape (nor the
    other way round): the window decides which blocks run."""
    flash, target = get_kernel("flash"), get_kernel("flash").target("v5e")
    space, base = kernel_space(flash, PLAIN, target)
    seed = FlashConfig(block_q=256, block_kv=256)
    params = {name: getattr(seed, name) for name in space.names}
    assert seed != base and space.is_legal(params)
    store.publish(TunedResult(device_kind=DEVICE, problem=bigger(WINDOWED), config=seed,
                              median_ms=1.0))
    assert params not in warm_seeds(store, PLAIN, DEVICE, space, base, flash, target)
    store.publish(TunedResult(device_kind=DEVICE, problem=bigger(PLAIN), config=seed,
                              median_ms=1.0))
    assert warm_seeds(store, PLAIN, DEVICE, space, base, flash, target)[1] == params


def test_a_problem_prints_as_its_label() -> None:
    """Issue 75 item 7: docs/models.md shows a ``kernel.resolution_sources()`` key printed as
    ``Problem(b4 h8/2 q2048 ...)``; a problem printed every field by name. Two problems still
    print apart where their fields differ."""
    problem = Problem(4, 8, 2, 2048, 2048, 128, "bfloat16", True, "fwd_bwd")
    printed = "Problem(b4 h8/2 q2048 kv2048 d128 bfloat16 causal fwd_bwd)"
    assert str(("flash", "TPU v5 lite", problem)) == f"('flash', 'TPU v5 lite', {printed})"
    windowed = dataclasses.replace(problem, window=(63, 0), softcap=50.0000001)
    assert repr(windowed) == "Problem(b4 h8/2 q2048 kv2048 d128 bfloat16 causal window63,0 " \
                             "softcap50.0000001 fwd_bwd)"
    assert repr(dataclasses.replace(windowed, softcap=50.0)) != repr(windowed)
