"""A14: threads tracing different problems do not wait on each other's service requests, and a
new problem costs one request (its choices and its configs asked together; against a service
older than that, two at once), against a real HTTP server on loopback that answers slowly."""

from __future__ import annotations

import dataclasses
import json
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


MISS = {"found": False, "detail": "not tuned"}


class _SlowMisses(BaseHTTPRequestHandler):
    """Answers every lookup, after ``DELAY_S``, that nothing is stored for it: a batch of
    choices with the configs it was asked (``older``: refuses them, as before they were)."""

    older = False

    def _reply(self, status: int, body: object) -> None:
        time.sleep(DELAY_S)
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self._reply(404, {"detail": "not tuned"})

    def do_POST(self) -> None:  # noqa: N802
        asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "configs" in asked and self.older:
            return self._reply(422, {"detail": [{"loc": ["body", "configs"],
                                                 "msg": "Extra inputs are not permitted"}]})
        configs = {"configs": {asked["configs"]["kernel"]: MISS}} if "configs" in asked else {}
        self._reply(200, {"results": [{**MISS, **configs} for _ in asked["keys"]]})

    def log_message(self, *args: object) -> None:
        pass


class _OlderSlowMisses(_SlowMisses):
    older = True


class _Server(ThreadingHTTPServer):
    request_queue_size = 64  # every thread's connection accepted at once
    daemon_threads = True


def _serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def slow_service() -> Iterator[str]:
    yield from _serve(_SlowMisses)


@pytest.fixture
def older_slow_service() -> Iterator[str]:
    yield from _serve(_OlderSlowMisses)


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
    assert requests == 1  # the choices of both modes and the config in one request
    assert one < 2 * DELAY_S  # one round trip
    sixteen, requests = _seconds(16, slow_service)
    assert requests == 16
    # Round trips in series would take 16 * DELAY_S (6.4 s); the traces themselves share the
    # CPU (2 cores in CI: 2.15 s for all 16 once, under load), so the bound is half of that.
    assert sixteen < 8 * DELAY_S, f"16 threads took {sixteen:.2f} s, one {one:.2f} s"


def test_a_service_older_than_the_configs_field_is_asked_as_before(older_slow_service):
    """It refuses ``configs`` (422): the client asks the choices and the config apart, at once,
    from then on, and never fails a trace over it."""
    one, requests = _seconds(1, older_slow_service)
    assert requests == 3  # the refused request, then the two it understands
    assert one < 3 * DELAY_S  # the two at once
    resolver = Resolver(ResolverSettings(url=older_slow_service, timeout_s=10))
    _trace(resolver, PROBLEM)
    _trace(resolver, dataclasses.replace(PROBLEM, batch=2))
    assert resolver.service_requests == 5 and not resolver.service.answers_configs


def test_threads_tracing_one_problem_ask_the_service_once(slow_service):
    resolver = Resolver(ResolverSettings(url=slow_service, timeout_s=10))
    resolver.kernel("flash")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: _trace(resolver, PROBLEM), range(8)))
    assert resolver.service_requests == 1
