"""``serve``, ``export``, ``import`` and ``db upgrade`` on databases in awkward states, as a user
runs them: a missing SQLite file (not created by refusing), a schema written by a newer
version (named, no Alembic traceback), read-only databases (reads work, writes say
read-only): a SQLite file on a tmpfs remounted read-only, and PostgreSQL with read-only
transactions (as on a standby), and a full disk while publishing (nothing half-written)."""

from __future__ import annotations

import errno
import html
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from sqlalchemy import text
from sqlalchemy.engine import make_url

from conftest import running_server, run_cli
from kernel import FlashConfig, Problem
from kernel.table import KernelChoice, KernelTiming, LookupTable
from storage import Store, upgrade
from storage.schema import VERSION_TABLE
from storage.studies import get_storage

TABLE = {"schema_version": 1, "kernel": "flash", "kernel_version": "1", "device_kind": "cpu",
         "entries": [{"problem": {"batch": 1, "q_heads": 8, "q_len": 256, "head_dim": 128},
                      "config": {"block_q": 256, "block_kv": 256}, "time_ms": 1.0}]}
LOOKUP = {"device_kind": "cpu", "batch": 1, "q_heads": 8, "q_len": 256, "head_dim": 128}
PUBLISH = {"key": LOOKUP, "config": {"block_q": 128, "block_kv": 256}, "median_ms": 0.5}


def seed(url: str) -> None:
    """The schema and TABLE, written in-process (cheaper than two `autotune` runs)."""
    upgrade(url)
    with Store(url) as store:
        store.import_table(LookupTable.from_dict(TABLE))


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


def test_a_missing_directory_is_named_with_its_fix(tmp_path: Path) -> None:
    """A database file in a directory that does not exist: the error says to create the
    directory (``db upgrade`` alone fails there too: "unable to open database file")."""
    path = tmp_path / "no-such-dir" / "autotune.db"
    url = f"sqlite:///{path}"
    assert_clean_failure(run_cli("export", "-o", str(tmp_path / "out.json"), "--db", url,
                                 timeout=60),
                         f"the directory of database file {path} does not exist",
                         f"mkdir -p {path.parent}")
    assert not path.parent.exists()


def test_a_schema_newer_than_this_version_is_named(sqlite_db_url: str) -> None:
    with Store(sqlite_db_url) as store, store.engine.begin() as connection:
        connection.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = 'f00d0099'"))
    for args in (("serve", "--port", "1"), ("db", "upgrade")):
        assert_clean_failure(run_cli(*args, "--db", sqlite_db_url, timeout=60),
                             "written by a newer version of flash-autotune",
                             "schema revision f00d0099")


@pytest.fixture
def small_mount(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs at a new directory (remount it ``ro`` to make it read-only)."""
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


def seed_with_a_study(url: str) -> None:
    """TABLE with a kernel choice, and an Optuna study of one trial (so that readers open
    Optuna's tables)."""
    seed(url)
    problem = Problem.from_dict(TABLE["entries"][0]["problem"])
    with Store(url) as store:
        store.publish_choice("cpu", KernelChoice(
            problem, "flash", FlashConfig(block_q=256, block_kv=256),
            {"flash": KernelTiming(1.0, 0.1), "xla": KernelTiming(2.0, 0.1)},
            {"kernel_version": "1"}))
    storage = get_storage(url)
    study = optuna.create_study(study_name="a study", storage=storage)
    study.add_trial(optuna.trial.create_trial(
        params={"block_q": 128}, distributions={"block_q": CategoricalDistribution([128, 256])},
        value=1.0, user_attrs={"status": "ok"}))
    storage.engine.dispose()  # SQLite: its WAL checkpointed into the file


def assert_reads_work_and_writes_say_read_only(db_url: str, tmp_path: Path) -> None:
    """``export``, ``report``, the import of what is stored (a no-op), a served lookup and a
    config's page work; ``import``, a served publish and ``tune`` (before it searches: no
    trial line) say read-only. Issue 62 item 3: ``report`` was a traceback from Optuna's
    storage, the config's page a 500, the no-op import "read-only"."""
    table, same = tmp_path / "faster.json", tmp_path / "same.json"
    faster = {**TABLE, "entries": [{**TABLE["entries"][0], "time_ms": 0.5}]}
    table.write_text(json.dumps(faster))
    exported = run_cli("export", "--db", db_url, "-o", str(same))
    assert exported.returncode == 0, exported.stderr
    reported = run_cli("report", "--db", db_url, "-o", str(tmp_path / "report.html"))
    assert reported.returncode == 0, reported.stderr
    imported = run_cli("import", str(same), "--db", db_url)  # what is stored: a no-op
    assert imported.returncode == 0, imported.stderr
    assert "1 kept, 1 kernel choice" in imported.stdout
    assert_clean_failure(run_cli("import", str(table), "--db", db_url), "read-only")
    tuned = run_cli("tune", "--kernel", "flash", "--q-len", "128", "--head-dim", "128",
                    "--q-heads", "1", "--trials", "1", "--db", db_url, "--json", timeout=300)
    assert_clean_failure(tuned, "read-only", "make it writable")
    assert not tuned.stdout.strip()
    with running_server(db_url, tmp_path) as server:
        found = httpx.get(f"{server.url}/v1/configs/lookup", params=LOOKUP)
        assert found.status_code == 200 and found.json()["match"] == "exact"
        listed = httpx.get(f"{server.url}/")
        [link] = re.findall(r'href="(/configs/detail\?[^"]+)"', listed.text)
        page = httpx.get(f"{server.url}{html.unescape(link)}")
        assert page.status_code == 200, page.text
        refused = httpx.put(f"{server.url}/v1/configs", json=PUBLISH, headers=server.auth)
        assert refused.status_code == 503 and "read-only" in refused.json()["detail"]


def test_a_read_only_sqlite_file_serves_reads_and_refuses_writes(small_mount: Path,
                                                                  tmp_path: Path) -> None:
    url = f"sqlite:///{small_mount / 'autotune.db'}"
    seed_with_a_study(url)
    subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], check=True)
    assert_reads_work_and_writes_say_read_only(url, tmp_path)
    upgraded = run_cli("db", "upgrade", "--db", url)  # current: nothing to write
    assert upgraded.returncode == 0 and "(current)" in upgraded.stdout
    assert sorted(p.name for p in small_mount.iterdir()) == ["autotune.db"]


@pytest.mark.postgres
def test_a_read_only_postgresql_serves_reads_and_refuses_writes(postgres_databases,
                                                                tmp_path: Path) -> None:
    url = postgres_databases()
    seed_with_a_study(url)
    parsed = make_url(url)
    options = parsed.query["options"] + " -cdefault_transaction_read_only=on"
    read_only = parsed.update_query_dict({"options": options})
    assert_reads_work_and_writes_say_read_only(
        read_only.render_as_string(hide_password=False), tmp_path)


def fill(directory: Path, leave: int = 0) -> Path:
    """Fills the file system of ``directory`` to the last byte, or to its last ``leave``
    bytes; returns the filler file."""
    filler = directory / "filler"
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while (free := os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize) > leave \
                and os.write(descriptor, b"\0" * min(4096, free - leave)):
            pass
    except OSError as error:
        assert error.errno == errno.ENOSPC, error
    finally:
        os.close(descriptor)
    return filler


def test_a_full_disk_while_publishing_leaves_nothing_half_written(small_mount: Path,
                                                                  tmp_path: Path) -> None:
    url = f"sqlite:///{small_mount / 'autotune.db'}"
    seed(url)
    big = {**TABLE, "device_kind": "TPU full", "entries": [
        {"problem": {"batch": b, "q_heads": h, "q_len": 128 * n, "head_dim": 128},
         "config": {"block_q": 128, "block_kv": 128}, "time_ms": 1.0,
         "provenance": {"study": "s" * 200}}
        for b in (1, 2) for h in (8, 16) for n in range(1, 17)]}
    table = tmp_path / "big.json"
    table.write_text(json.dumps(big))
    with running_server(url, tmp_path) as server:  # the disk fills while it runs
        filler = fill(small_mount)
        response = httpx.post(f"{server.url}/v1/tables", json=big, headers=server.auth,
                              timeout=60)
        assert response.status_code == 507, response.text
        assert "full" in response.json()["detail"]
        assert httpx.get(f"{server.url}/v1/configs/lookup", params=LOOKUP).status_code == 200
        assert_clean_failure(run_cli("import", str(table), "--db", url), "full")
        filler.unlink()
        with Store(url) as store, store.engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
            assert [e.result.device_kind for e in store.list()[0]] == ["cpu"]
        response = httpx.post(f"{server.url}/v1/tables", json=big, headers=server.auth,
                              timeout=60)
        assert response.json()["inserted"] == len(big["entries"])  # with room again, all in


def test_a_disk_full_before_the_first_open_serves_reads_and_says_full_to_writes(
        small_mount: Path, tmp_path: Path) -> None:
    """Issue 62 item 4: on a disk full before the service first opened the file (no ``-shm``
    yet, and none could grow) every read and /readyz answered 503 "disk I/O error" (here
    ``serve`` did not start); reads work, a write is a 507, and with room again it is stored
    and read back (no reader stays on the file as it was)."""
    url = f"sqlite:///{small_mount / 'autotune.db'}"
    seed(url)
    filler = fill(small_mount)
    assert not (small_mount / "autotune.db-shm").exists()
    with running_server(url, tmp_path) as server:
        assert httpx.get(f"{server.url}/readyz").status_code == 200
        found = httpx.get(f"{server.url}/v1/configs/lookup", params=LOOKUP)
        assert found.status_code == 200 and found.json()["config"]["block_q"] == 256
        refused = httpx.put(f"{server.url}/v1/configs", json=PUBLISH, headers=server.auth)
        assert refused.status_code == 507 and "full" in refused.json()["detail"], refused.text
        filler.unlink()
        stored = httpx.put(f"{server.url}/v1/configs", json=PUBLISH, headers=server.auth)
        assert stored.status_code == 200 and stored.json()["status"] == "replaced"
        found = httpx.get(f"{server.url}/v1/configs/lookup", params=LOOKUP)
        assert found.json()["config"]["block_q"] == 128


@pytest.mark.parametrize("free_kib", [64, 512], ids=["creating-the-study", "mid-search"])
def test_a_tune_on_a_disk_that_fills_up_says_full_in_one_line(small_mount: Path,
                                                              free_kib: int) -> None:
    """Issue 75 item 11c: with 64-512 KiB free, ``tune`` ended in a traceback (SQLAlchemy's
    "database or disk is full" creating Optuna's tables; Optuna's "exceeding max length" once
    its trials filled the rest); now the one line of a full database, and nothing stored is
    lost."""
    url = f"sqlite:///{small_mount / 'autotune.db'}"
    seed(url)
    filler = fill(small_mount, leave=free_kib << 10)
    tuned = run_cli("tune", "--kernel", "flash", "--q-len", "128", "--head-dim", "128",
                    "--q-heads", "1", "--trials", "3", "--db", url, timeout=300)
    assert_clean_failure(tuned, "is full", "free disk space and retry")
    assert "exceeding max length" not in tuned.stdout + tuned.stderr
    filler.unlink()
    with Store(url) as store, store.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
        assert [e.result.device_kind for e in store.list()[0]] == ["cpu"]
