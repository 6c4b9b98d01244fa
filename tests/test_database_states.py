"""``serve``, ``export``, ``import`` and ``db upgrade`` on databases in awkward states, as a user
runs them: a missing SQLite file (not created by refusing), a schema written by a newer
version (named, no Alembic traceback), and read-only databases (reads work, writes say
read-only): a SQLite file on a tmpfs remounted read-only, and PostgreSQL with read-only
transactions (as on a standby)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from conftest import running_server, run_cli
from storage import Store, upgrade
from storage.schema import VERSION_TABLE

TABLE = {"schema_version": 1, "kernel": "flash", "kernel_version": "1", "device_kind": "cpu",
         "entries": [{"problem": {"batch": 1, "q_heads": 8, "q_len": 256, "head_dim": 128},
                      "config": {"block_q": 256, "block_kv": 256}, "time_ms": 1.0}]}
LOOKUP = {"device_kind": "cpu", "batch": 1, "q_heads": 8, "q_len": 256, "head_dim": 128}
PUBLISH = {"key": LOOKUP, "config": {"block_q": 128, "block_kv": 256}, "median_ms": 0.5}


def assert_clean_failure(done: subprocess.CompletedProcess[str], *phrases: str) -> None:
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stdout + done.stderr
    for phrase in phrases:
        assert phrase in done.stderr, done.stderr


def test_a_missing_sqlite_file_is_refused_without_being_created(tmp_path: Path) -> None:
    path = tmp_path / "missing.db"
    url = f"sqlite:///{path}"
    for args in (("serve", "--port", "1"), ("export", "-o", str(tmp_path / "out.json"))):
        assert_clean_failure(run_cli(*args, "--db", url, timeout=60), "does not exist",
                             f"autotune db upgrade --db {url}")
    assert not path.exists()


def test_a_schema_newer_than_this_version_is_named(sqlite_db_url: str) -> None:
    with Store(sqlite_db_url) as store, store.engine.begin() as connection:
        connection.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = 'f00d0099'"))
    for args in (("serve", "--port", "1"), ("db", "upgrade")):
        assert_clean_failure(run_cli(*args, "--db", sqlite_db_url, timeout=60),
                             "written by a newer version of flash-autotune",
                             "schema revision f00d0099")


@pytest.fixture
def read_only_mount(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs at a new directory (remount it with ``ro`` to make it read-only)."""
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs",
                              str(mount_point)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {mounted.stderr}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def assert_reads_work_and_writes_say_read_only(db_url: str, tmp_path: Path) -> None:
    """``export`` and a served lookup work; ``import`` and a served publish say read-only."""
    table = tmp_path / "table.json"
    table.write_text(json.dumps(TABLE))
    exported = run_cli("export", "--db", db_url, "-o", str(tmp_path / "out.json"))
    assert exported.returncode == 0, exported.stderr
    assert_clean_failure(run_cli("import", str(table), "--db", db_url, "--force"), "read-only")
    with running_server(db_url, tmp_path) as server:
        found = httpx.get(f"{server.url}/v1/configs/lookup", params=LOOKUP)
        assert found.status_code == 200 and found.json()["match"] == "exact"
        refused = httpx.put(f"{server.url}/v1/configs", json=PUBLISH, headers=server.auth)
        assert refused.status_code == 503 and "read-only" in refused.json()["detail"]


def test_a_read_only_sqlite_file_serves_reads_and_refuses_writes(read_only_mount: Path,
                                                                  tmp_path: Path) -> None:
    url = f"sqlite:///{read_only_mount / 'autotune.db'}"
    table = tmp_path / "seed.json"
    table.write_text(json.dumps(TABLE))
    assert run_cli("db", "upgrade", "--db", url).returncode == 0
    assert run_cli("import", str(table), "--db", url).returncode == 0
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_mount)], check=True)
    assert_reads_work_and_writes_say_read_only(url, tmp_path)
    upgraded = run_cli("db", "upgrade", "--db", url)  # current: nothing to write
    assert upgraded.returncode == 0 and "(current)" in upgraded.stdout
    assert sorted(p.name for p in read_only_mount.iterdir()) == ["autotune.db"]


@pytest.mark.postgres
def test_a_read_only_postgresql_serves_reads_and_refuses_writes(postgres_databases,
                                                                tmp_path: Path) -> None:
    url = postgres_databases()
    upgrade(url)
    table = tmp_path / "seed.json"
    table.write_text(json.dumps(TABLE))
    assert run_cli("import", str(table), "--db", url).returncode == 0
    parsed = make_url(url)
    options = parsed.query["options"] + " -cdefault_transaction_read_only=on"
    read_only = parsed.update_query_dict({"options": options})
    assert_reads_work_and_writes_say_read_only(
        read_only.render_as_string(hide_password=False), tmp_path)
