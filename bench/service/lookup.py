"""Lookup latency and throughput of ``autotune serve`` against a bare uvicorn baseline.

Runs both servers in the same run with the same uvicorn settings (one worker, no access log),
each pinned to CPU 0 while the load generator runs on the other CPUs, and drives them over
loopback with keep-alive connections from a minimal raw-socket HTTP/1.1 client (far cheaper
per request than either server, so it is not the bottleneck). Our server answers exact hits on
a SQLite database of 200 entries; the baseline returns the same JSON body as a constant.

Also: server RSS before and after 20k lookups (a busy server keeps flat memory), and the
per-call cost of a cached resolution in ``kernel.resolve.Resolver``.

    python bench/service/lookup.py [--seconds 6] [--rounds 6] [--clients 1,32] [--uncached]

Targets: throughput at 32 clients >= 0.6 of the baseline; p50 < 2 ms with one client;
cached resolution < 5 us.

``--nearest`` instead times nearest-match lookups over HTTP on a database of ``--entries``
tuned configs and as many kernel choices of one family: one choice lookup of a shape none
has, and a batch of 100 such keys, each as a ratio to the same lookup of configs (the
baseline) in the same run.

    python bench/service/lookup.py --nearest [--entries 10000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import httpx

AUTOTUNE = str(Path(sys.executable).with_name("autotune"))
DEVICE = "TPU v5 lite"
SERVER_CPU = 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def problems(count: int) -> list[dict[str, int]]:
    """``count`` distinct problems with legal 128-row blocks."""
    out = []
    for batch in (1, 2, 4, 8, 16):
        for heads in (4, 8, 16, 32, 64):
            for q_len in (128, 256, 512, 1024, 2048, 4096, 8192, 16384):
                out.append({"batch": batch, "q_heads": heads, "q_len": q_len, "head_dim": 128})
    return out[:count]


def seed_database(url: str, count: int) -> list[dict[str, int]]:
    from kernel import FlashConfig, Problem
    from storage import Store, TunedResult, upgrade

    upgrade(url)
    keys = problems(count)
    with Store(url) as store:
        for i, key in enumerate(keys):
            store.publish(TunedResult(device_kind=DEVICE, problem=Problem.from_dict(key),
                                      config=FlashConfig(), median_ms=1.0 + i / 1000,
                                      default_median_ms=2.0, trials=10, method="replay"))
    return keys


def wait_ready(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"server exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    sys.exit(f"server at {url} did not start")


def start(command: list[str], ready_url: str, env: dict[str, str] | None = None
          ) -> subprocess.Popen:
    process = subprocess.Popen(command, env={**os.environ, **(env or {})},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.sched_setaffinity(process.pid, {SERVER_CPU})
    wait_ready(ready_url, process)
    return process


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


class RawClient:
    """A keep-alive HTTP/1.1 client doing only what a benchmark needs (status, body length)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    def request(self, data: bytes) -> int:
        self.sock.sendall(data)
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self._recv()
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head).group(1))
        while len(rest) < length:
            rest += self._recv()
        self.buffer = rest[length:]
        return int(head[9:12])

    def _recv(self) -> bytes:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()


def request_bytes(port: int, key: dict[str, int]) -> bytes:
    query = urllib.parse.urlencode({"kernel": "flash", "device_kind": DEVICE, **key})
    return (f"GET /v1/configs/lookup?{query} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            "Accept: application/json\r\n\r\n").encode()


def load(port: int, requests: list[bytes], clients: int, seconds: float,
         server_pid: int) -> tuple[list[float], float, float]:
    """``clients`` connections each sending requests back to back for ``seconds``: the
    latencies, the elapsed time and the server's CPU time."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    bad: list[int] = []
    start_at = threading.Barrier(clients + 1)
    stop = threading.Event()

    def run(index: int) -> None:
        client = RawClient(port)
        mine, i = latencies[index], index
        start_at.wait()
        while not stop.is_set():
            began = time.perf_counter()
            status = client.request(requests[i % len(requests)])
            mine.append(time.perf_counter() - began)
            if status != 200:
                bad.append(status)
            i += clients
        client.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    start_at.wait()
    began, cpu_began = time.perf_counter(), cpu_seconds(server_pid)
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    elapsed, cpu = time.perf_counter() - began, cpu_seconds(server_pid) - cpu_began
    if bad:
        sys.exit(f"{len(bad)} requests failed, e.g. HTTP {bad[0]}")
    return [x for per_client in latencies for x in per_client], elapsed, cpu


def compare(servers: dict[str, tuple[int, int, list[bytes]]], clients: int, seconds: float,
            rounds: int) -> dict[str, dict[str, float]]:
    """Runs the servers in alternating short rounds (so that drifting load from other
    processes on the machine hits both alike) and pools each server's rounds. Also reports the
    server's CPU time per request, which other load disturbs less than throughput."""
    pooled = {name: ([], 0.0, 0.0) for name in servers}
    for name, (pid, port, requests) in servers.items():
        load(port, requests, clients, 0.5, pid)  # warm up: connections, caches
    for _ in range(rounds):
        for name, (pid, port, requests) in servers.items():
            latencies, elapsed, cpu = load(port, requests, clients, seconds / rounds, pid)
            all_latencies, all_elapsed, all_cpu = pooled[name]
            pooled[name] = (all_latencies + latencies, all_elapsed + elapsed, all_cpu + cpu)
    out = {}
    for name, (latencies, elapsed, cpu) in pooled.items():
        latencies.sort()
        out[name] = {"rps": len(latencies) / elapsed,
                     "p50_ms": 1000 * latencies[len(latencies) // 2],
                     "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)],
                     "n": len(latencies), "cpu_us": 1e6 * cpu / len(latencies)}
    return out


def resolver_cost_us() -> float:
    from kernel import DEFAULT_KERNEL, Problem, device_target
    from kernel.resolve import Resolver, ResolverSettings

    resolver = Resolver(ResolverSettings())
    target = device_target("tpu", DEVICE)
    problem = Problem(batch=1, q_heads=8, kv_heads=8, q_len=1024, kv_len=1024, head_dim=128)
    resolver.resolve(problem, DEVICE, DEFAULT_KERNEL, target)  # first call resolves (default) and caches
    calls, runs = 200_000, []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(calls):
            resolver.resolve(problem, DEVICE, DEFAULT_KERNEL, target)
        runs.append((time.perf_counter() - began) / calls * 1e6)
    return min(runs)


def serve_bare(port: int, body_path: str) -> None:
    """The baseline: a plain ASGI app returning a constant JSON body, under uvicorn."""
    import uvicorn

    body = Path(body_path).read_bytes()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    uvicorn.run(app, host="127.0.0.1", port=port, access_log=False, log_level="info")


def seed_family(url: str, count: int) -> None:
    """``count`` tuned configs and as many kernel choices (flash, 128-row blocks) of one
    family (bf16, head_dim 128, not causal, fwd): batch, heads, groups and lengths vary."""
    from kernel import FlashConfig, LookupTable, Problem, get_kernel
    from kernel.table import KernelChoice, KernelTiming, TableEntry
    from storage import Store, upgrade

    upgrade(url)
    shapes = itertools.islice(itertools.product(
        (1, 2, 4, 8, 16, 32, 64, 128), (8, 16, 32, 64, 128), (1, 2, 4, 8),
        [128 * k for k in range(1, 65)]), count)
    problems = [Problem(batch=batch, q_heads=heads, kv_heads=heads // group, q_len=q_len,
                        kv_len=q_len, head_dim=128) for batch, heads, group, q_len in shapes]
    config = FlashConfig(block_q=128, block_kv=128)
    table = LookupTable("flash", get_kernel("flash").version, DEVICE, entries=tuple(
        TableEntry(problem, config, time_ms=1.0) for problem in problems), choices=tuple(
        KernelChoice(problem, "flash", config, {"flash": KernelTiming(1.0, 0.1)})
        for problem in problems))
    with Store(url) as store:
        store.import_table(table)


def nearest_keys(count: int) -> list[dict[str, object]]:
    """``count`` problems of the seeded family that none stored has (batch 3)."""
    from kernel import Problem

    return [Problem(batch=3, q_heads=16, kv_heads=8, q_len=128 * k, kv_len=128 * k,
                    head_dim=128).to_dict() for k in range(1, count + 1)]


def median_s(call: Callable[[int], httpx.Response], rounds: int) -> float:
    """The median seconds of ``call(round)`` over ``rounds``; each must answer 200 nearest."""
    times = []
    for round_ in range(rounds):
        began = time.perf_counter()
        response = call(round_)
        times.append(time.perf_counter() - began)
        assert response.status_code == 200, response.text
        assert "nearest" in response.text, response.text[:200]
    return statistics.median(times)


def bench_nearest(entries: int, rounds: int) -> None:
    """Nearest choice lookups against nearest config lookups, over HTTP, in one run."""
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.db"
        seed_family(url, entries)
        port = free_port()
        server = start([AUTOTUNE, "serve", "--db", url, "--port", str(port)],
                       f"http://127.0.0.1:{port}/readyz", env={"AUTOTUNE_API_TOKEN": "x"})
        keys = [{"device_kind": DEVICE, **key} for key in nearest_keys(100)]
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
                def one(path: str) -> Callable[[int], httpx.Response]:
                    # a new key each round: the configs' response cache never answers
                    return lambda round_: client.get(path, params={
                        name: value for name, value in keys[round_ % len(keys)].items()
                        if value is not None})

                def batch(path: str) -> Callable[[int], httpx.Response]:
                    return lambda _: client.post(path, json={"keys": keys})

                times = {"one config": median_s(one("/v1/configs/lookup"), rounds),
                         "one choice": median_s(one("/v1/choices/lookup"), rounds),
                         "batch of 100 configs": median_s(
                             batch("/v1/configs/lookup:batch"), rounds),
                         "batch of 100 choices": median_s(
                             batch("/v1/choices/lookup:batch"), rounds)}
        finally:
            server.terminate()
            server.wait()
    print(f"nearest lookups over HTTP, {entries} configs and {entries} choices in one family, "
          f"median of {rounds} rounds")
    for name, seconds in times.items():
        print(f"{name:>21}: {seconds:8.4f} s")
    ratios = {"one": times["one choice"] / times["one config"],
              "batch": times["batch of 100 choices"] / times["batch of 100 configs"]}
    print(f"choices / configs: one lookup {ratios['one']:.2f}, batch of 100 "
          f"{ratios['batch']:.2f}")
    print(json.dumps({"seconds": times, "choice_over_config": ratios}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="per server and load")
    parser.add_argument("--rounds", type=int, default=6, help="alternations per load")
    parser.add_argument("--clients", default="1,32")
    parser.add_argument("--entries", type=int, default=None,
                        help="stored entries (default 200; with --nearest 10000)")
    parser.add_argument("--nearest", action="store_true",
                        help="time nearest choice lookups against nearest config lookups")
    parser.add_argument("--uncached", action="store_true",
                        help="also run a server with the lookup cache off")
    parser.add_argument("--serve-bare", nargs=2, metavar=("PORT", "BODY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        serve_bare(int(args.serve_bare[0]), args.serve_bare[1])
        return
    if args.nearest:
        bench_nearest(args.entries or 10_000, args.rounds)
        return
    args.entries = args.entries or 200
    cpus = os.sched_getaffinity(0)
    if len(cpus) > 1:  # keep the load generator off the servers' CPU
        os.sched_setaffinity(0, cpus - {SERVER_CPU})
    client_counts = [int(c) for c in args.clients.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.db"
        keys = seed_database(url, args.entries)
        ours_port, bare_port = free_port(), free_port()
        ours = start([AUTOTUNE, "serve", "--db", url, "--port", str(ours_port)],
                     f"http://127.0.0.1:{ours_port}/readyz", env={"AUTOTUNE_API_TOKEN": "x"})
        try:
            ours_requests = [request_bytes(ours_port, key) for key in keys]
            sample = httpx.get(f"http://127.0.0.1:{ours_port}/v1/configs/lookup", params={
                "kernel": "flash", "device_kind": DEVICE, **keys[0]})
            assert sample.status_code == 200 and sample.json()["match"] == "exact"
            body_path = Path(tmp) / "body.json"
            body_path.write_bytes(sample.content)
            bare = start([sys.executable, __file__, "--serve-bare", str(bare_port),
                          str(body_path)], f"http://127.0.0.1:{bare_port}/")
            try:
                bare_requests = [request_bytes(bare_port, key) for key in keys]
                servers = {"bare": (bare.pid, bare_port, bare_requests),
                           "ours": (ours.pid, ours_port, ours_requests)}
                if args.uncached:  # every lookup parsed and read from the database
                    port = free_port()
                    uncached = start([AUTOTUNE, "serve", "--db", url, "--port", str(port)],
                                     f"http://127.0.0.1:{port}/readyz",
                                     env={"AUTOTUNE_LOOKUP_CACHE_SIZE": "0"})
                    servers["nocache"] = (uncached.pid, port,
                                          [request_bytes(port, key) for key in keys])
                results = {}
                for clients in client_counts:
                    for name, result in compare(servers, clients, args.seconds,
                                                args.rounds).items():
                        results[name, clients] = result
            finally:
                bare.terminate()
                bare.wait()
                if args.uncached:
                    uncached.terminate()
                    uncached.wait()

            rss_before = rss_mib(ours.pid)
            client, served = RawClient(ours_port), 0
            while served < 20_000:
                assert client.request(ours_requests[served % len(ours_requests)]) == 200
                served += 1
            client.close()
            rss_after = rss_mib(ours.pid)
        finally:
            ours.terminate()
            ours.wait()

    print(f"lookup service vs bare uvicorn (server on CPU {SERVER_CPU}, "
          f"{args.entries} entries, exact hits, {args.seconds:.0f} s per server and load in "
          f"{args.rounds} alternating rounds)")
    print(f"{'clients':>7} {'server':>6} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'n':>8} "
          f"{'server CPU us/req':>18}")
    for (name, clients), r in results.items():
        print(f"{clients:>7} {name:>6} {r['rps']:>9.0f} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} "
              f"{r['n']:>8} {r['cpu_us']:>18.0f}")
    summary = {}
    for clients in client_counts:
        summary[f"ratio_{clients}"] = results["ours", clients]["rps"] / \
            results["bare", clients]["rps"]
        summary[f"cpu_ratio_{clients}"] = results["bare", clients]["cpu_us"] / \
            results["ours", clients]["cpu_us"]
        print(f"throughput ratio ours/bare at {clients} clients: "
              f"{summary[f'ratio_{clients}']:.2f} (server CPU per request, bare/ours: "
              f"{summary[f'cpu_ratio_{clients}']:.2f})")
    if 1 in client_counts:
        print(f"p50 with one client: {results['ours', 1]['p50_ms']:.3f} ms (target < 2 ms)")
    print(f"server RSS: {rss_before:.1f} MiB before, {rss_after:.1f} MiB after 20000 lookups "
          f"({rss_after - rss_before:+.1f} MiB)")
    cost = resolver_cost_us()
    print(f"cached Resolver.resolve: {cost:.2f} us per call (target < 5 us)")
    print(json.dumps({**summary, "rss_delta_mib": rss_after - rss_before,
                      "resolve_us": cost}))


if __name__ == "__main__":
    main()
