"""A14: threads tracing different problems do not wait on each other's service requests, and a
new problem costs one round trip (its choices and its config asked at once), against a real
HTTP server on loopback that answers slowly."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kernel import Problem, get_target
from kernel.resolve import Resolver, ResolverSettings

DELAY_S = 0.4
PROBLEM = Problem(batch=1, q_heads=2, kv_heads=2, q_len=256, kv_len=256, head_dim=64,
                  dtype="float32")
CPU = get_target("cpu")


class _SlowMisses(BaseHTTPRequestHandler):
    """Answers every lookup, after ``DELAY_S``, that nothing is stored for it."""

    def _miss(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        time.sleep(DELAY_S)
        body = b'{"detail": "not tuned"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _miss

    def log_message(self, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    request_queue_size = 64  # every thread's connection accepted at once
    daemon_threads = True


@pytest.fixture
def slow_service() -> Iterator[str]:
    server = _Server(("127.0.0.1", 0), _SlowMisses)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _trace(resolver: Resolver, problem: Problem) -> None:
    """What ``flash_attention`` asks the resolver when it traces a new problem on a CPU."""
    pick = resolver.pick(problem, "cpu", "cpu", CPU)
    resolver.resolve(problem, "cpu", pick.kernel.name, CPU, pick.by)


def _seconds(threads: int, url: str) -> tuple[float, int]:
    resolver = Resolver(ResolverSettings(url=url, timeout_s=10))
    resolver.kernel("flash")  # the one-off discovery of the installed JAX
    problems = [dataclasses.replace(PROBLEM, batch=batch) for batch in range(1, threads + 1)]
    start = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda p: _trace(resolver, p), problems))
    return time.monotonic() - start, resolver.service_requests


def test_sixteen_threads_tracing_new_problems_take_about_as_long_as_one(slow_service):
    one, requests = _seconds(1, slow_service)
    assert requests == 2  # the choices of both modes in one request, the config beside it
    assert one < 2 * DELAY_S  # one round trip, not one per request
    sixteen, requests = _seconds(16, slow_service)
    assert requests == 32
    assert sixteen < 3 * one, f"16 threads took {sixteen:.2f} s, one {one:.2f} s"


def test_threads_tracing_one_problem_ask_the_service_once(slow_service):
    resolver = Resolver(ResolverSettings(url=slow_service, timeout_s=10))
    resolver.kernel("flash")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: _trace(resolver, PROBLEM), range(8)))
    assert resolver.service_requests == 2
