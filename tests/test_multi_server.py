"""Two ``autotune serve`` processes (one of them with two uvicorn workers) on one PostgreSQL
database, as behind a load balancer, with concurrent writers on both: every publish answers
200, and no write is lost (each published result is either the live one or in the history,
and the live one is the fastest)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from conftest import running_server
from storage import ConfigKey, Store, upgrade
from kernel.problem import Problem

KEYS = 3  # q_len 256, 512, 768: every writer publishes to every key
WRITERS = 8
PUBLISHES = 4  # per writer and key


def payload(device_kind: str, q_len: int, median_ms: float) -> dict[str, object]:
    return {"key": {"device_kind": device_kind, "batch": 1, "q_heads": 8, "q_len": q_len,
                    "head_dim": 128},
            "config": {"block_q": 256, "block_kv": 256}, "median_ms": median_ms}


@pytest.mark.postgres
def test_two_servers_on_one_postgres_lose_no_concurrent_write(postgres_databases,
                                                              tmp_path: Path) -> None:
    url = postgres_databases()
    upgrade(url)
    kind = "TPU shared"
    failures: list[str] = []
    with running_server(url, tmp_path, args=("--workers", "2")) as first, \
            running_server(url, tmp_path) as second:

        def writer(index: int) -> None:
            server = (first, second)[index % 2]
            with server.client(headers=server.auth) as client:
                for round_ in range(PUBLISHES):
                    for key in range(KEYS):
                        # Distinct timings, so every result is identifiable afterwards.
                        median = 1 + index / 100 + round_ / 10_000 + key / 1_000_000
                        response = client.put("/v1/configs", json=payload(
                            kind, 256 * (key + 1), median))
                        if response.status_code != 200:
                            failures.append(f"{response.status_code} {response.text}")

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(WRITERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert failures == []
    with Store(url) as store:
        for key in range(KEYS):
            q_len = 256 * (key + 1)
            stored = ConfigKey("flash", "1", kind, "tpu", Problem(
                batch=1, q_heads=8, kv_heads=8, q_len=q_len, kv_len=q_len, head_dim=128))
            live = store.get(stored).result.median_ms
            history = [h.result.median_ms for h in store.history(stored)]
            published = {1 + i / 100 + r / 10_000 + key / 1_000_000
                         for i in range(WRITERS) for r in range(PUBLISHES)}
            assert sorted([live, *history]) == sorted(published)
            assert live == min(published)
