"""Where ``-o`` writes (``export``, ``export --format maxtext``, ``report``, ``landscape``): a
file whole or not at all, keeping its mode; ``-`` and ``/dev/stdout`` to stdout; through a
FIFO, a character device or a symbolic link, never replacing it; a FIFO nobody reads and a
socket refused. Devices are twins made with mknod in the test's directory, never /dev's own."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from conftest import AUTOTUNE, run_cli
from kernel.table import LookupTable
from storage import Store
from test_database_states import TABLE, fill, seed, small_mount  # noqa: F401 - a fixture


@pytest.fixture
def tabled_db(tmp_path: Path) -> str:
    """A SQLite file holding TABLE."""
    url = f"sqlite:///{tmp_path / 'autotune.db'}"
    seed(url)
    return url


def export(db: str, output: Path | str) -> subprocess.CompletedProcess[str]:
    return run_cli("export", "--db", db, "-o", str(output), timeout=60)


def assert_the_table(text: str) -> None:
    assert json.loads(text)["entries"][0]["problem"]["q_len"] == 256


def test_a_file_is_replaced_keeping_its_mode(tabled_db: str, tmp_path: Path) -> None:
    output = tmp_path / "table.json"
    output.write_text("old")
    output.chmod(0o600)
    done = export(tabled_db, output)
    assert done.returncode == 0, done.stderr
    assert_the_table(output.read_text())
    assert stat.S_IMODE(output.stat().st_mode) == 0o600


def test_a_link_writes_where_it_leads_and_stays_a_link(tabled_db: str, tmp_path: Path) -> None:
    target = tmp_path / "target.json"
    target.write_text("an old and longer text than the table is, " * 100)
    target.chmod(0o600)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    done = export(tabled_db, link)
    assert done.returncode == 0, done.stderr
    assert link.is_symlink()
    assert_the_table(target.read_text())
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


def test_a_fifo_is_written_through(tabled_db: str, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    try:
        done = export(tabled_db, fifo)
        read, _ = reader.communicate(timeout=10)
    finally:
        reader.kill()
    assert done.returncode == 0, done.stderr
    assert_the_table(read)
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


def test_a_fifo_nobody_reads_and_a_socket_are_refused(tabled_db: str, tmp_path: Path) -> None:
    fifo, sock_path = tmp_path / "fifo", tmp_path / "sock"
    os.mkfifo(fifo)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        for path, is_kind in ((fifo, stat.S_ISFIFO), (sock_path, stat.S_ISSOCK)):
            done = export(tabled_db, path)
            assert done.returncode == 1 and "nothing reads it" in done.stderr, done.stderr
            assert "Traceback" not in done.stderr
            assert is_kind(path.lstat().st_mode)


def device_twin(path: Path, minor: int) -> Path:
    """A character device node of memory device ``minor`` (3 null, 7 full) at ``path``."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
    except PermissionError:
        pytest.skip("cannot make a device node here (needs CAP_MKNOD)")
    return path


def test_a_character_device_is_written_through(tabled_db: str, tmp_path: Path) -> None:
    """Root's ``report -o /dev/full`` said "wrote /dev/full" and deleted /dev/full."""
    null, full = device_twin(tmp_path / "null", 3), device_twin(tmp_path / "full", 7)
    assert export(tabled_db, null).returncode == 0
    done = export(tabled_db, full)
    assert done.returncode == 1, done.stderr
    assert f"cannot write {full}: No space left on device" in done.stderr
    for device in (null, full):
        assert stat.S_ISCHR(device.lstat().st_mode)


@pytest.mark.parametrize("output", ["-", "/dev/stdout", "/dev/fd/1"])
def test_stdout_takes_the_output(tabled_db: str, tmp_path: Path, output: str) -> None:
    """``-o -`` wrote a file named ``-``; the status line goes to stderr."""
    done = subprocess.run([*AUTOTUNE, "export", "--db", tabled_db, "-o", output], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert_the_table(done.stdout)
    assert "wrote entries" in done.stderr
    assert not (tmp_path / "-").exists()


def test_report_writes_to_stdout(tabled_db: str, tmp_path: Path) -> None:
    report = subprocess.run([*AUTOTUNE, "report", "--db", tabled_db, "-o", "-"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert report.stdout.startswith("<!doctype html>")
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("command", [["export"], ["report"], ["landscape", "a study"]])
def test_an_empty_output_path_names_no_file(tabled_db: str, command: list[str]) -> None:
    """Issue 75 item 11p: ``-o ''`` was refused as "is a directory"."""
    done = run_cli(*command, "--db", tabled_db, "-o", "", env={"COLUMNS": "200"})
    assert done.returncode == 2 and "'' names no file" in done.stderr, done.stderr


def test_a_read_only_file_is_refused_as_the_shell_refuses_it(tabled_db: str,
                                                             tmp_path: Path) -> None:
    """Issue 75 item 11f: without the capability to override file permissions, a 0444 file
    in a writable directory was replaced (written beside, renamed over it), exit 0."""
    output = tmp_path / "table.json"
    output.write_text("old")
    output.chmod(0o444)
    done = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search",
                           *AUTOTUNE, "export", "--db", tabled_db, "-o", str(output)],
                          capture_output=True, text=True, timeout=60)
    if "setpriv" in done.stderr:
        pytest.skip(f"cannot drop capabilities here: {done.stderr.strip()}")
    assert done.returncode == 1 and "Permission denied" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert output.read_text() == "old" and stat.S_IMODE(output.stat().st_mode) == 0o444


def test_a_link_on_a_full_disk_keeps_what_it_leads_to(small_mount: Path,
                                                      tmp_path: Path) -> None:
    """Issue 75 item 11g: through a symbolic link, the file it leads to was truncated and
    written in place: on a full disk, 4096 bytes of partial JSON were left of it."""
    db = f"sqlite:///{tmp_path / 'autotune.db'}"
    seed(db)
    with Store(db) as store:  # a table of about 10 KiB
        store.import_table(LookupTable.from_dict({**TABLE, "entries": [
            {**TABLE["entries"][0], "problem": {**TABLE["entries"][0]["problem"], "batch": b}}
            for b in range(2, 50)]}))
    target = small_mount / "target.json"
    old = "an old table"  # one page of the file system, freed by a truncation
    target.write_text(old)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    fill(small_mount)
    done = export(db, link)
    assert done.returncode == 1 and "No space left on device" in done.stderr, done.stderr
    assert link.is_symlink() and target.read_text() == old
