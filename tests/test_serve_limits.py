"""``autotune serve`` under connection abuse, on loopback: a bounded slowloris (idle
connections and requests sent a byte at a time) against a real server whose ``ulimit -n`` is
small. ``/healthz`` keeps answering (200, or 503 while the connection limit is reached), the
abusive connections are dropped after ``AUTOTUNE_READ_TIMEOUT_S``, and the log stays small.
Also: bad limit settings are refused at start-up."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx

from conftest import running_server, run_cli

MAX_OPEN_FILES = 400  # the server's: enough for 50 connections and accept batches
ABUSERS = 450
READ_TIMEOUT_S = 2.0


def test_a_slowloris_leaves_healthz_answering_and_the_log_small(sqlite_db_url: str,
                                                                 tmp_path: Path) -> None:
    settings = {"AUTOTUNE_MAX_CONNECTIONS": "50",
                "AUTOTUNE_READ_TIMEOUT_S": str(READ_TIMEOUT_S)}
    with running_server(sqlite_db_url, tmp_path, settings=settings,
                        max_open_files=MAX_OPEN_FILES) as server:
        address = ("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
        abusers = []
        try:
            for index in range(ABUSERS):
                sock = socket.create_connection(address, timeout=5)
                if index % 2:  # half-sent: a request head that never ends
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                abusers.append(sock)
            answers = []
            deadline = time.monotonic() + READ_TIMEOUT_S + 1.5
            while time.monotonic() < deadline:
                for sock in abusers[1::2]:  # one more header byte each, while they last
                    try:
                        sock.send(b"X")
                    except OSError:
                        pass
                answers.append(httpx.get(f"{server.url}/healthz", timeout=3).status_code)
                time.sleep(0.2)
            assert set(answers) <= {200, 503} and answers, answers
            for sock in abusers:  # every abusive connection was dropped by the server
                sock.settimeout(3)
                try:  # closed, or answered 503 (beyond the limit) and closed
                    reply = sock.recv(4096)
                except ConnectionResetError:
                    continue
                assert reply == b"" or reply.startswith(b"HTTP/1.1 503 "), reply
        finally:
            for sock in abusers:
                sock.close()
        assert httpx.get(f"{server.url}/healthz", timeout=3).status_code == 200
        log = server.log.read_text()
    assert len(log) < 5_000 and "Too many open files" not in log, log[-2000:]


def test_bad_limit_settings_are_refused_at_start(sqlite_db_url: str) -> None:
    done = run_cli("serve", "--db", sqlite_db_url, "--port", "1",
                   env={"AUTOTUNE_READ_TIMEOUT_S": "-1", "AUTOTUNE_MAX_CONNECTIONS": "lots"})
    assert done.returncode == 2, done.stderr
    assert "AUTOTUNE_READ_TIMEOUT_S" in done.stderr and "AUTOTUNE_MAX_CONNECTIONS" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_connection_limit_admits_exactly_that_many(sqlite_db_url: str,
                                                       tmp_path: Path) -> None:
    """``AUTOTUNE_MAX_CONNECTIONS=2``: with one idle connection open a request is answered;
    with two, a third connection gets the JSON 503; nothing is logged."""
    with running_server(sqlite_db_url, tmp_path,
                        settings={"AUTOTUNE_MAX_CONNECTIONS": "2"}) as server:
        address = ("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
        with socket.create_connection(address, timeout=5) as idle:
            time.sleep(0.2)  # accepted before the request below
            assert httpx.get(f"{server.url}/healthz", timeout=3).status_code == 200
            with socket.create_connection(address, timeout=5) as second:
                time.sleep(0.2)
                refused = httpx.get(f"{server.url}/healthz", timeout=3)
                assert refused.status_code == 503, refused.text
                assert "too many connections" in refused.json()["detail"]
                second.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert second.recv(4096).startswith(b"HTTP/1.1 200 ")
            idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert idle.recv(4096).startswith(b"HTTP/1.1 200 ")
        log = server.log.read_text()
    assert "concurrency limit" not in log, log[-2000:]


def test_page_views_held_up_leave_the_lookups_their_threads(sqlite_db_url: str,
                                                            monkeypatch) -> None:
    """Issue 75 item 11m: 40 clients on the pages while a tune wrote took every thread of
    the pool (plots are drawn one at a time), and lookups waited behind them, past the
    wrapper's deadline. Pages are now built at most ``AUTOTUNE_MAX_PAGE_RENDERS`` at once; the
    others wait without a thread. Here every page build is held until the end: a lookup still
    answers, and no more than the limit of builds ever started (before: 40)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import uvicorn

    from api.main import create_app
    from api.routers import pages
    from api.settings import ApiSettings
    from conftest import free_port

    release, started = threading.Event(), []
    distinct = pages._distinct

    def held(store, column):  # noqa: ANN001, ANN202 - a page build, kept until released
        started.append(column)
        release.wait(120)
        return distinct(store, column)

    monkeypatch.setattr(pages, "_distinct", held)
    app = create_app(ApiSettings(db_url=sqlite_db_url, max_page_renders=3))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        while not server.started:
            time.sleep(0.05)
        with ThreadPoolExecutor(45) as clients:
            views = [clients.submit(httpx.get, f"{base}/", timeout=180) for _ in range(44)]
            deadline = time.monotonic() + 10  # a window for builds past the limit to start
            while time.monotonic() < deadline and len(started) <= 3:
                time.sleep(0.1)
            lookup = clients.submit(httpx.get, f"{base}/v1/configs/lookup", timeout=60, params={
                "kernel": "flash", "device_kind": "TPU v5 lite", "batch": 1, "q_heads": 2,
                "kv_heads": 2, "q_len": 256, "kv_len": 256, "head_dim": 64,
                "dtype": "float32"})
            answered = lookup.result(timeout=60).status_code
            most = len(started)
            release.set()
            statuses = {view.result(timeout=120).status_code for view in views}
    finally:
        release.set()
        server.should_exit = True
        thread.join(timeout=30)
    assert answered == 404  # answered (nothing stored), while every page build was held
    assert most == 3 and statuses == {200}
