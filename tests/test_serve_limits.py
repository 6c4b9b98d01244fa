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
