"""Issue 46, service and storage: database creation, lookups of choices, rows of newer
builds, rendering of hostile data, tokens and readiness (real SQLite, PostgreSQL, uvicorn)."""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from conftest import Server, free_port, run_cli

STARTERS = 8  # tuning jobs started at once on one new database file
ROUNDS = 8


def small_result(batch: int = 1, **fields: object) -> object:
    """A tuned result of ``flash`` for a small float32 problem on ``cpu``."""
    from kernel import FlashConfig
    from kernel.problem import Problem
    from storage import TunedResult

    return TunedResult(**{
        "device_kind": "cpu", "median_ms": 1.0, "config": FlashConfig(block_q=128, block_kv=128),
        "problem": Problem(batch=batch, q_heads=2, kv_heads=2, q_len=256, kv_len=256,
                           head_dim=64, dtype="float32"), **fields})


def _start_a_job(url: str, barrier: multiprocessing.synchronize.Barrier) -> None:
    """What a tuning job does first on its database: create the schema, open the store and
    its first write connection. Exit status 0 when it worked."""
    from autotune.commands.db import ensure_schema, open_store
    from storage import check_writable

    barrier.wait()
    try:
        ensure_schema(url)
        with open_store(url) as store:
            check_writable(store.engine)
    except SystemExit as error:
        os._exit(error.code or 0)
    except BaseException:
        traceback.print_exc()
        os._exit(3)
    os._exit(0)


def _first_write(url: str, barrier: multiprocessing.synchronize.Barrier) -> None:
    """A job's first connection to the database file (as every engine opens one), and a
    write on it."""
    from storage.engine import sqlite_connect, sqlite_file, sqlite_pragmas

    barrier.wait()
    try:
        connection = sqlite_connect(sqlite_file(url), isolation_level=None)
        sqlite_pragmas(connection)
        connection.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
    except BaseException:
        traceback.print_exc()
        os._exit(3)
    os._exit(0)


def _start_together(tmp_path: Path, job: Callable[..., None], rounds: int) -> None:
    """Runs ``job(url, barrier)`` in STARTERS processes at once on a new file, ``rounds``
    times; fails naming the starts that failed."""
    context = multiprocessing.get_context("fork")
    failed = []
    for round_ in range(rounds):
        url = f"sqlite:///{tmp_path / f'round{round_}.db'}"
        barrier = context.Barrier(STARTERS)
        starts = [context.Process(target=job, args=(url, barrier)) for _ in range(STARTERS)]
        for start in starts:
            start.start()
        for start in starts:
            start.join(60)
            if start.exitcode != 0:
                failed.append((round_, start.exitcode))
    assert not failed, f"{len(failed)} of {rounds * STARTERS} starts failed: {failed}"


def test_connections_opened_together_on_a_new_sqlite_file_all_write(tmp_path: Path) -> None:
    """A17: the WAL switch of a new file did not wait for another connection's ("database is
    locked"), and a file created between two checks was opened read-only (a false
    "read-only"): before the fix, one start in 60 to 500 failed, by load."""
    import storage.engine  # noqa: F401  (imported once, before the forks)

    _start_together(tmp_path, _first_write, rounds=40)


def test_tuning_jobs_started_together_on_a_new_sqlite_file_all_succeed(tmp_path: Path) -> None:
    """A17 through the commands' own start (schema creation, then the store)."""
    from autotune.commands.db import ensure_schema

    ensure_schema(f"sqlite:///{tmp_path / 'warm.db'}")  # imports done once, before the forks
    _start_together(tmp_path, _start_a_job, rounds=ROUNDS)


# --- tokens (A15, A16) ---


def _put_config(server: Server, headers: dict[str, bytes | str]) -> httpx.Response:
    from test_api import body

    return httpx.put(f"{server.url}/v1/configs", json=body("cpu-tokens"), headers=headers)


def test_a_non_ascii_token_is_matched_by_its_utf8_bytes(start_server, sqlite_db_url) -> None:
    token = "clé-秘密"
    server = start_server(sqlite_db_url, token=token)
    sent = {"Authorization": b"Bearer " + token.encode("utf-8")}
    assert _put_config(server, sent).status_code == 200
    wrong = {"Authorization": b"Bearer " + "cle-秘密".encode()}
    assert _put_config(server, wrong).status_code == 401


def test_an_empty_token_is_the_documented_unset_case(start_server, sqlite_db_url) -> None:
    server = start_server(sqlite_db_url, token=None, settings={"AUTOTUNE_API_TOKEN": ""})
    refused = _put_config(server, {"Authorization": "Bearer x"})
    assert refused.status_code == 403, refused.text
    assert "no API token" in refused.json()["detail"]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_anonymous_writes_with_a_token_set_are_refused_at_start(sqlite_db_url, how) -> None:
    env = {"AUTOTUNE_API_TOKEN": "secret"}
    args = ["serve", "--db", sqlite_db_url, "--port", str(free_port())]
    if how == "flag":
        args.append("--allow-anonymous-writes")
    else:
        env["AUTOTUNE_ALLOW_ANONYMOUS_WRITES"] = "yes"
    done = run_cli(*args, env=env, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "AUTOTUNE_API_TOKEN is set and anonymous writes are allowed" in done.stderr
    assert "Traceback" not in done.stderr


# --- A20: readiness, in-memory URLs, stale's command, device kinds ---


def _publish_many(url: str, count: int, device_kind: str = "cpu") -> None:
    from storage import Store

    with Store(url) as store:
        for batch in range(1, count + 1):
            store.publish(small_result(batch, device_kind=device_kind))


def test_readyz_is_503_on_a_damaged_database_file(sqlite_db_url, tmp_path: Path) -> None:
    import sqlite3
    import subprocess

    from conftest import AUTOTUNE, wait_until_answering

    _publish_many(sqlite_db_url, 300)
    path = sqlite_db_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as connection:
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    with open(path, "r+b") as file:  # a page in the middle of the table overwritten
        file.seek(os.path.getsize(path) // 2)
        file.write(b"\xff" * 8192)
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        process = subprocess.Popen([*AUTOTUNE, "serve", "--db", sqlite_db_url, "--port",
                                    str(port)], stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_until_answering(process, f"http://127.0.0.1:{port}/healthz", "serve",
                             log.read_text)
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz")
    finally:
        process.terminate()
        process.wait(15)
    assert ready.status_code == 503, ready.text
    assert "is damaged" in ready.json()["detail"]


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_in_memory_urls_get_their_schema(url: str) -> None:
    done = run_cli("stale", "--db", url)
    assert done.returncode == 0, done.stderr
    assert "db upgrade" not in done.stdout + done.stderr
    assert "no stale configs" in done.stdout


@pytest.mark.postgres
def test_stale_prints_a_command_that_runs_for_a_url_with_a_password(
        postgres_databases, tmp_path: Path) -> None:
    from sqlalchemy.engine import make_url

    from storage import upgrade

    url = make_url(postgres_databases()).set(password="s3cret")
    url = url.render_as_string(hide_password=False)
    upgrade(url)
    from storage import Store

    with Store(url) as store:
        store.publish(small_result(jax_version="0.0.1"))
    done = run_cli("stale", "--db", url, "--output-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert '--force --db "$AUTOTUNE_DB_URL"' in done.stdout
    assert "***" not in done.stdout.split("re-tune", 1)[1]


@pytest.mark.parametrize("device_kind", ["\u200b", "TPU v5 lite ", " TPU v5 lite", "\u200b\u200b "])
def test_invisible_or_padded_device_kinds_are_refused(server: Server, device_kind) -> None:
    from test_api import body

    refused = httpx.put(f"{server.url}/v1/configs", json=body(device_kind), headers=server.auth)
    assert refused.status_code == 422, refused.text
    assert "device_kind" in refused.json()["detail"]


# --- A2: choices the resolver cannot read are refused at write time ---


def choice_table(device_kind: str, candidates: dict[str, dict[str, float]],
                 **problem: object) -> dict[str, object]:
    """A lookup table holding one kernel choice of ``flash`` for a small problem."""
    from kernel import get_kernel
    from kernel.problem import Problem
    from kernel.table import TABLE_SCHEMA_VERSION

    shape = Problem(**{"batch": 1, "q_heads": 2, "kv_heads": 2, "q_len": 256, "kv_len": 256,
                       "head_dim": 64, "dtype": "float32", **problem})
    flash = get_kernel("flash")
    return {"schema_version": TABLE_SCHEMA_VERSION, "kernel": "flash",
            "kernel_version": flash.version, "device_kind": device_kind, "entries": [],
            "choices": [{"problem": shape.to_dict(), "kernel": "flash",
                         "config": flash.default_config(shape).to_dict(),
                         "candidates": {"flash": {"median_ms": 1.0}, **candidates}}]}


@pytest.mark.parametrize("count", [33, 1501])
def test_a_choice_with_too_many_candidates_is_refused(server: Server, count: int) -> None:
    device_kind = f"a2-{count}"
    candidates = {f"kernel_{i:05d}": {"median_ms": 2.0 + i} for i in range(count)}
    refused = httpx.post(f"{server.url}/v1/tables", json=choice_table(device_kind, candidates),
                         headers=server.auth)
    assert refused.status_code == 422, refused.text
    assert "at most 32 candidate kernels" in refused.json()["detail"]
    listed = httpx.get(f"{server.url}/v1/choices", params={"device_kind": device_kind})
    assert listed.json()["total"] == 0


def test_the_largest_choices_accepted_are_readable_by_the_wrapper(server: Server) -> None:
    """32 candidates of the longest names (64 four-byte characters) and the longest failure
    text, stored for both modes: the wrapper's one batch request for a new shape (both modes'
    choices) gets a reply under its cap."""
    from kernel.service import MAX_REPLY_BYTES

    names = {f"{i:02d}" + "\U0001F600" * 62: {"failure": "\U0001F600" * 64} for i in range(31)}
    for mode in ("fwd", "fwd_bwd"):
        stored = httpx.post(f"{server.url}/v1/tables", headers=server.auth,
                            json=choice_table("a2-bytes", names, mode=mode))
        assert stored.status_code == 200, stored.text
    key = {"device_kind": "a2-bytes", "batch": 1, "q_heads": 2, "q_len": 256, "head_dim": 64,
           "dtype": "float32", "causal": False}
    reply = httpx.post(f"{server.url}/v1/choices/lookup:batch", json={"keys": [
        {**key, "mode": mode} for mode in ("fwd", "fwd_bwd")]})
    assert reply.status_code == 200, reply.text
    assert [r["kernel"] for r in reply.json()["results"]] == ["flash", "flash"], reply.text
    assert len(reply.content) < MAX_REPLY_BYTES


def test_a_new_shape_costs_the_wrapper_one_request(server: Server) -> None:
    """Issue 55 item 3: the trace of a new shape asks once: both modes' choices with the
    configs of the kernel that runs without a choice, and of the kernels a choice names
    (here its next best, as the chosen cudnn has no CPU target)."""
    from kernel import get_kernel, get_target
    from kernel.problem import Problem
    from kernel.resolve import Resolver, ResolverSettings
    from kernel.table import TABLE_SCHEMA_VERSION

    flash, cpu, kind = get_kernel("flash"), get_target("cpu"), "a55-one-request"
    chosen = Problem(1, 2, 2, 256, 256, 64)  # bfloat16: cuDNN's
    unchosen = Problem(1, 2, 2, 512, 512, 64, causal=True)  # no choice near it
    tuned = flash.default_config(chosen).replace(block_q=128, block_kv=128,
                                                 block_kv_compute=128)
    stored = httpx.post(f"{server.url}/v1/tables", headers=server.auth, json={
        "schema_version": TABLE_SCHEMA_VERSION, "kernel": "flash",
        "kernel_version": flash.version, "device_kind": kind,
        "entries": [{"problem": p.to_dict(), "config": tuned.to_dict()}
                    for p in (chosen, unchosen)],
        "choices": [{"problem": chosen.to_dict(), "kernel": "cudnn", "config": {},
                     "candidates": {"cudnn": {"median_ms": 1.0}, "flash": {"median_ms": 2.0}}}]})
    assert stored.status_code == 200, stored.text
    resolver = Resolver(ResolverSettings(url=server.url, timeout_s=10))
    for problem in (chosen, unchosen):
        pick = resolver.pick(problem, kind, "cpu", cpu)
        resolution = resolver.resolve(problem, kind, pick.kernel.name, cpu, pick.by)
        assert (pick.kernel.name, resolution.source, resolution.config) == (
            "flash", "service", tuned), resolution
    assert resolver.service_requests == 2  # one a shape


# --- item 10: interpret-mode figures are marked where shown ---


@pytest.mark.parametrize("method, marked", [("interpret", True), ("device", False)])
def test_report_marks_interpret_mode_speedups(sqlite_db_url: str, method: str,
                                              marked: bool) -> None:
    import re

    from autotune.report import render
    from storage import Store

    with Store(sqlite_db_url) as store:
        store.publish(small_result(default_median_ms=2.94, method=method))
        html = render(store)
    shown = re.findall(r"2\.94×[^<]*", html)
    assert shown, html
    assert all(("(interpret mode, not a device figure)" in text) == marked for text in shown)


# --- A5, A6: hostile but valid data renders; drawing is bounded and drawn once ---


def _choice_of(candidates: dict[str, object]) -> object:
    from kernel import get_kernel
    from kernel.problem import Problem
    from kernel.table import KernelChoice

    problem = Problem(batch=1, q_heads=2, kv_heads=2, q_len=256, kv_len=256, head_dim=64,
                      dtype="float32")
    return KernelChoice(problem, "flash", get_kernel("flash").default_config(problem),
                        candidates)


def test_a_choice_chart_of_hostile_values_is_left_out_saying_why() -> None:
    from kernel.table import KernelTiming
    from present.plots import choice_image

    drawn = choice_image(_choice_of({"flash": KernelTiming(1.0, 0.1),
                                     "$\\frac{a$": KernelTiming(1e308, 1e308),
                                     "x": KernelTiming(failure="$\\bad{$")}))
    assert "choice" not in drawn and drawn["note:choice"]
    drawn = choice_image(_choice_of({"flash": KernelTiming(1.0, 0.1),
                                     "$\\frac{a$": KernelTiming(2.0, 0.1),
                                     "x": KernelTiming(failure="$\\bad{$")}))
    assert drawn["choice"].startswith("data:image/png")  # "$" drawn as typed


def test_a_choice_chart_draws_at_most_the_fastest_twenty() -> None:
    from kernel.table import KernelTiming
    from present.plots import MAX_CHOICE_BARS, choice_figure

    candidates = {"flash": KernelTiming(1.0, 0.1), **{
        f"k{i:04d}": KernelTiming(2.0 + i, 0.1) for i in range(1500)}}
    ax = choice_figure(_choice_of(candidates)).axes[0]
    assert len(ax.get_yticklabels()) == MAX_CHOICE_BARS
    assert "1481 slower or failed candidates not shown" in ax.get_xlabel()


def test_a_report_with_a_foreign_study_and_a_huge_median_is_written(sqlite_db_url,
                                                                     tmp_path: Path) -> None:
    import optuna

    from storage import Store
    from storage.studies import get_storage

    foreign = optuna.create_study(storage=get_storage(sqlite_db_url), study_name="theirs")
    foreign.set_user_attr("confirmation", "not ours")
    foreign.optimize(lambda trial: trial.suggest_float("lr", 0, 1), n_trials=2)
    with Store(sqlite_db_url) as store:
        store.publish(small_result(median_ms=1e308, study="theirs"))
    out = tmp_path / "report.html"
    done = run_cli("report", "--db", sqlite_db_url, "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "is not one autotune" in out.read_text()



def test_simultaneous_views_after_a_write_draw_the_choice_chart_once(
        sqlite_db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 views of one detail page at once, after a write, over HTTP to a real uvicorn in
    this process (so that draws can be counted): the views that waited for the drawing lock
    take the first view's drawing. Without the cache look-up once the lock is held, each
    view drew it again (about 40 draws)."""
    import threading

    import uvicorn

    import present.plots
    from api.main import create_app
    from api.routers.pages import detail_link
    from api.settings import ApiSettings
    from kernel.table import KernelTiming
    from storage import Store

    drawn = []
    draw = present.plots.choice_image

    def counted(choice: object) -> dict[str, str]:
        drawn.append(choice)
        time.sleep(0.5)  # a large chart: every view arrives while the first one draws
        return draw(choice)

    monkeypatch.setattr(present.plots, "choice_image", counted)
    choice = _choice_of({"flash": KernelTiming(1.0, 0.1), "xla": KernelTiming(2.0, 0.1)})
    with Store(sqlite_db_url) as store:
        entry = store.publish(small_result(device_kind="cpu")).entry
        store.publish_choice("cpu", choice)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(ApiSettings(db_url=sqlite_db_url)),
                                           host="127.0.0.1", port=port, log_level="warning"))
    serving = threading.Thread(target=server.run)
    serving.start()
    try:
        while not server.started:
            assert serving.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        page = f"http://127.0.0.1:{port}{detail_link(entry.result.key)}"
        assert httpx.get(page, timeout=60).status_code == 200
        with Store(sqlite_db_url) as store:  # a write: the cached drawing is out of date
            store.publish_choice("cpu", _choice_of({
                "flash": KernelTiming(1.0, 0.1), "xla": KernelTiming(3.0, 0.1)}))
        del drawn[:]
        start = threading.Barrier(40)
        statuses = []

        def view() -> None:
            start.wait()
            statuses.append(httpx.get(page, timeout=120).status_code)

        views = [threading.Thread(target=view) for _ in range(40)]
        for thread in views:
            thread.start()
        for thread in views:
            thread.join()
    finally:
        server.should_exit = True
        serving.join()
    assert statuses == [200] * 40
    assert len(drawn) <= 2, f"drawn {len(drawn)} times"
    assert drawn[0].candidates["xla"].median_ms == 3.0  # the choice as written


# --- A4: rows written by a newer build ---

NEWER = "cpu-newer"  # the device kind of the rows in newer_rows_db


def _copy_row(connection: object, table: str, row_id: int, **changes: str) -> None:
    """Inserts a copy of row ``row_id`` of ``table`` with the columns in ``changes`` set to
    SQL expressions (of the copied row's columns)."""
    columns = [row[1] for row in connection.execute(f"PRAGMA table_info({table})")
               if row[1] != "id"]
    values = [changes.get(name, name) for name in columns]
    connection.execute(f"INSERT INTO {table} ({', '.join(columns)}) SELECT {', '.join(values)} "
                       f"FROM {table} WHERE id = ?", (row_id,))


@pytest.fixture
def newer_rows_db(sqlite_db_url: str) -> str:
    """A database where a newer build wrote, next to one readable config and one readable
    choice (q_len 256), a config and a choice of a kernel this build does not know and a
    config and a choice with a config field it does not know (q_len 512 and 1024)."""
    import sqlite3

    from kernel import LookupTable
    from storage import Store

    with Store(sqlite_db_url) as store:
        store.publish(small_result(device_kind=NEWER))
        store.import_table(LookupTable.from_dict(choice_table(NEWER, {})))
    with sqlite3.connect(sqlite_db_url.removeprefix("sqlite:///")) as connection:
        for table in ("autotune_configs", "autotune_kernel_choices"):
            _copy_row(connection, table, 1, kernel="'newer'", q_len="512", kv_len="512")
            _copy_row(connection, table, 1, config="json_set(config, '$.block_z', 8)",
                      q_len="1024", kv_len="1024")
    return sqlite_db_url


def test_rows_of_a_newer_build_are_skipped_with_one_warning_each(start_server,
                                                                  newer_rows_db: str) -> None:
    """Lists count the unreadable rows, lookups in their family answer from the readable
    ones; before the fix, each of these was a 422."""
    server = start_server(newer_rows_db)
    problem = {"batch": 1, "q_heads": 2, "kv_heads": 2, "head_dim": 64, "dtype": "float32",
               "causal": "false", "mode": "fwd"}
    near = {**problem, "device_kind": NEWER, "q_len": 2048, "kv_len": 2048}
    for _ in range(2):  # warned once per row, not per request
        configs = httpx.get(f"{server.url}/v1/configs", params={"device_kind": NEWER})
        assert configs.status_code == 200, configs.text
        assert [configs.json()[k] for k in ("total", "skipped")] == [3, 2]
        assert [item["key"]["q_len"] for item in configs.json()["items"]] == [256]
        choices = httpx.get(f"{server.url}/v1/choices", params={"device_kind": NEWER})
        assert choices.status_code == 200, choices.text
        assert [choices.json()[k] for k in ("total", "skipped")] == [3, 2]
        index = httpx.get(f"{server.url}/", params={"device_kind": NEWER})
        assert index.status_code == 200, index.text
        assert "skipped 2 rows written by a newer build" in index.text
        table = httpx.get(f"{server.url}/v1/tables/{NEWER}")
        assert table.status_code == 200, table.text
        assert [len(table.json()[k]) for k in ("entries", "choices")] == [1, 1]
        for q_len in (512, 1024, 2048):  # exact keys of unreadable rows, a nearest one
            key = {**near, "q_len": q_len, "kv_len": q_len}
            choice = httpx.get(f"{server.url}/v1/choices/lookup", params=key)
            assert choice.status_code == 200, choice.text
            assert (choice.json()["match"], choice.json()["problem"]["q_len"]) == ("nearest", 256)
            config = httpx.get(f"{server.url}/v1/configs/lookup", params=key)
            assert config.status_code == 200, config.text
            assert (config.json()["match"], config.json()["key"]["q_len"]) == ("nearest", 256)
        batch = httpx.post(f"{server.url}/v1/choices/lookup:batch", json={"keys": [
            {**near, "causal": False}]})
        assert batch.status_code == 200, batch.text
        assert batch.json()["results"][0]["kernel"] == "flash"
    warnings = [line for line in server.log.read_text().splitlines()
                if "written by a newer build" in line]
    assert len(warnings) == 4, warnings
    assert sum("unknown kernel 'newer'" in line for line in warnings) == 2
    assert sum("'block_z'" in line for line in warnings) == 2


@pytest.mark.parametrize("command", [["stale"], ["report", "-o", "report.html"],
                                     ["export", "--device-kind", NEWER, "-o", "table.json"]])
def test_commands_skip_rows_of_a_newer_build_in_one_line(newer_rows_db: str, tmp_path: Path,
                                                         command: list[str]) -> None:
    """Before the fix, each command ended in a traceback."""
    args = [str(tmp_path / arg) if arg.endswith((".html", ".json")) else arg for arg in command]
    done = run_cli(*args, "--db", newer_rows_db, *(
        ["--output-dir", str(tmp_path)] if command == ["stale"] else []))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    skipped = [line for line in done.stderr.splitlines() if "newer build" in line]
    # stale reads the configs; report the configs and choices; export flash's configs (not the
    # unknown kernel's) and the choices
    count = {"stale": 2, "report": 4, "export": 3}[command[0]]
    assert skipped == [f"warning: skipped {count} rows written by a newer build (unknown "
                       "config field(s) ['block_z'] for FlashConfig, unknown kernel 'newer'); "
                       "upgrade flash-autotune to read them"], done.stderr


# --- A1: nearest choice lookups read a few neighbours, not every stored choice ---


def _featured_choices() -> tuple[list[object], list[object]]:
    """Kernel choices of several families and kernels (flash configs of 512-row blocks are
    illegal below 512 tokens), and problems to ask for, most of which none has."""
    import dataclasses

    from kernel import FlashConfig, get_kernel
    from kernel.problem import Problem
    from kernel.table import KernelChoice, KernelTiming

    base = Problem(batch=1, q_heads=4, kv_heads=4, q_len=1024, kv_len=1024, head_dim=128,
                   causal=True)
    features = [{}, {"window": (256, 0)}, {"window": (512, 0)}, {"softcap": 30.0},
                {"segmented": True}]
    choices, asked = [], []
    for fields in features:
        for q_len, batch, blocks in ((256, 1, 128), (512, 2, 512), (1024, 1, 512),
                                     (4096, 4, 128), (4096, 1, 128)):
            problem = dataclasses.replace(base, q_len=q_len, kv_len=q_len, batch=batch,
                                          **fields)
            flash = KernelChoice(problem, "flash", FlashConfig(block_q=blocks, block_kv=blocks),
                                 {"flash": KernelTiming(1.0)})
            xla = KernelChoice(problem, "xla", get_kernel("xla").default_config(problem),
                               {"xla": KernelTiming(1.0)})
            choices.append(xla if q_len == 4096 and batch == 1 else flash)
        for q_len in (128, 256, 384, 2048, 8192):
            asked.append(dataclasses.replace(base, q_len=q_len, kv_len=q_len, **fields))
    asked.append(dataclasses.replace(base, softcap=50.0))  # any softcap value answers
    asked.append(dataclasses.replace(base, window=(128, 0)))  # a family none has
    return choices, asked


def test_nearest_choices_follow_the_table_resolvers_rule(store) -> None:
    """The store answers as ``kernel.table.find_choice`` over the same choices: the same
    family (window exactly, softcap or none, segment ids or none), the closest legal config,
    the oldest of equals."""
    from kernel.table import find_choice

    choices, asked = _featured_choices()
    for choice in choices:
        store.publish_choice("cpu", choice)
    found = store.lookup_choices([("cpu", problem) for problem in asked])
    expected = [find_choice(problem, choices) for problem in asked]
    assert [None if f is None else (f[0].choice, f[1]) for f in found] == expected
    answers = [e for e in expected if e is not None]
    assert {e[1] for e in answers} == {"exact", "nearest"}
    assert {e[0].kernel for e in answers} == {"flash", "xla"}
    assert len(answers) < len(expected)  # some ask a family none has


def test_a_nearest_choice_lookup_decodes_a_few_rows_not_the_family(sqlite_db_url) -> None:
    """With 600 choices in one family, 50 nearest lookups (one request each) decode a few
    rows each; before the fix each decoded the whole family. A write is seen at once."""
    import dataclasses

    from kernel import FlashConfig
    from kernel.problem import Problem
    from kernel.table import KernelChoice, KernelTiming
    from storage import Store
    from storage.unreadable import UnreadableRows

    class CountingRows(UnreadableRows):
        decoded = 0

        def read(self, table: str, row_id: int, decode: Callable[[], object]) -> object:
            CountingRows.decoded += 1
            return super().read(table, row_id, decode)

    config = FlashConfig(block_q=128, block_kv=128)
    base = Problem(batch=1, q_heads=8, kv_heads=8, q_len=128, kv_len=128, head_dim=64)
    with Store(sqlite_db_url) as store:
        for batch in range(1, 7):
            for k in range(1, 101):
                problem = dataclasses.replace(base, batch=batch, q_len=128 * k, kv_len=128 * k)
                store.publish_choice("cpu", KernelChoice(problem, "flash", config,
                                                         {"flash": KernelTiming(1.0)}))
    with Store(sqlite_db_url) as store:
        store.unreadable = CountingRows()
        for k in range(1, 51):
            asked = dataclasses.replace(base, batch=7, q_len=128 * k, kv_len=128 * k)
            [(stored, match)] = store.lookup_choices([("cpu", asked)])
            assert (match, stored.choice.problem.q_len) == ("nearest", 128 * k)
        assert CountingRows.decoded <= 50 * 3, CountingRows.decoded
        closer = dataclasses.replace(base, batch=7, q_len=128 * 60, kv_len=128 * 60)
        store.publish_choice("cpu", KernelChoice(closer, "flash", config,
                                                 {"flash": KernelTiming(2.0)}))
        asked = dataclasses.replace(closer, batch=8)
        [(stored, _)] = store.lookup_choices([("cpu", asked)])
        assert stored.choice.problem == closer
