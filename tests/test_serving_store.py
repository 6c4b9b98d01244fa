"""Serving configs in storage and the service (docs/serving.md): their own tables (migration
0011), publish with keep-better and history, exact and nearest-legal lookups, a table's import
and export at schema 5, ``/v1/serving/configs/lookup`` (+ ``:batch``) on the real service, and
the wrapper's resolver asking it."""

from __future__ import annotations

import dataclasses
import re
import uuid
from typing import Any

import httpx
import pytest

from conftest import Server
from kernel import LookupTable, ServingProblem, TableEntry
from kernel.backends.rpa import RpaConfig
from kernel.registry import SERVING_KERNELS
from kernel.resolve import Resolver, ResolverSettings
from kernel.targets import get_target
from storage import ResultError, Store, TunedResult
from storage.results import problem_columns, problem_from_columns

RPA = SERVING_KERNELS["rpa"]
LLAMA = ServingProblem(32, 8, 128, page_size=16, pages_per_seq=128, max_num_batched_tokens=512,
                       max_num_seqs=64)
WINDOWED = ServingProblem(32, 8, 128, page_size=16, pages_per_seq=128,
                          max_num_batched_tokens=512, max_num_seqs=64, window=4096, softcap=50.0)


def _device() -> str:
    """A device kind of its own, so tests sharing the session server do not interact."""
    return f"TPU test {uuid.uuid4().hex[:8]}"


def _result(device_kind: str, problem: ServingProblem, config: RpaConfig,
            median_ms: float) -> TunedResult:
    return TunedResult(device_kind=device_kind, problem=problem, config=config,
                       median_ms=median_ms, kernel=RPA.name, trials=4, method="device")


def test_a_serving_problem_round_trips_through_its_columns():
    for problem in (LLAMA, WINDOWED):
        columns = problem_columns(problem)
        assert problem_from_columns(columns.__getitem__, ServingProblem) == problem
    assert problem_columns(LLAMA)["window"] == -1 and problem_columns(WINDOWED)["window"] == 4096


def test_publish_keeps_the_better_and_lookups_find_exact_then_nearest_legal(sqlite_db_url):
    kind = "TPU v5 lite"
    with Store(sqlite_db_url) as store:
        assert store.publish(_result(kind, LLAMA, RpaConfig(8, 32), 2.0)).status == "inserted"
        assert store.publish(_result(kind, LLAMA, RpaConfig(4, 32), 3.0)).status == "kept"
        assert store.publish(_result(kind, LLAMA, RpaConfig(16, 32), 1.0)).status == "replaced"
        assert [h.reason for h in store.history(_result(kind, LLAMA, RpaConfig(), 1).key)] == [
            "rejected", "replaced"]
        found, match = store.lookup(RPA.name, kind, LLAMA)
        assert (match, found.result.config) == ("exact", RpaConfig(16, 32))
        # 64 pages a sequence: the 512-token entry's 16 pages fit; nearer in sequences, 8192
        # tokens with 128 pages does not (stored rules: pages within pages_per_seq)
        store.publish(_result(kind, dataclasses.replace(LLAMA, max_num_seqs=128,
                                                        pages_per_seq=32), RpaConfig(32, 32), 1))
        asked = dataclasses.replace(LLAMA, pages_per_seq=16, max_num_seqs=128)
        found, match = store.lookup(RPA.name, kind, asked)
        assert (match, found.result.config) == ("nearest", RpaConfig(16, 32))
        assert store.lookup(RPA.name, kind, WINDOWED) is None  # another family
        assert store.lookup(RPA.name, "TPU v6 lite", LLAMA) is None
        assert store.device_kinds(RPA.name) == [kind]


def test_a_serving_kernel_takes_serving_problems_only():
    from kernel import Problem

    with pytest.raises(ResultError, match="kernel 'rpa' takes a ServingProblem"):
        TunedResult(device_kind="cpu", problem=Problem(1, 8, 8, 128, 128, 128),
                    config=RpaConfig(), median_ms=1.0, kernel=RPA.name)


def test_a_table_imports_and_exports_at_schema_5(sqlite_db_url):
    kind = "TPU v5 lite"
    table = LookupTable(RPA.name, RPA.version, kind,
                        (TableEntry(LLAMA, RpaConfig(8, 32), time_ms=1.0),
                         TableEntry(WINDOWED, RpaConfig(4, 16, vmem_limit_mib=32), time_ms=2.0)))
    gemma = dataclasses.replace(WINDOWED, q_heads=16, head_dim=256)
    with Store(sqlite_db_url) as store:
        with pytest.raises(ResultError, match=r"rpa entry 0 .*\[head_dim\]"):
            store.import_table(dataclasses.replace(table, entries=(
                TableEntry(gemma, RpaConfig(4, 16), time_ms=1.0),)))
        assert [o.status for o in store.import_table(table)] == ["inserted", "inserted"]
        exported = store.export_table(kind, kernel=RPA.name)
    assert exported.to_dict()["problem_type"] == "serving"
    assert {(e.problem, e.config) for e in exported.entries} == {
        (e.problem, e.config) for e in table.entries}


def _lookup(server: Server, kind: str, problem: ServingProblem, **extra: Any) -> httpx.Response:
    return httpx.get(f"{server.url}/v1/serving/configs/lookup",
                     params=[("device_kind", kind), *problem.query_params(), *extra.items()])


def test_the_service_answers_serving_lookups(server: Server):
    kind = _device()
    table = LookupTable(RPA.name, RPA.version, kind,
                        (TableEntry(LLAMA, RpaConfig(8, 32), time_ms=1.0),))
    imported = httpx.post(f"{server.url}/v1/tables", json=table.to_dict(), headers=server.auth)
    assert imported.status_code == 200, imported.text
    exact = _lookup(server, kind, LLAMA)
    assert exact.status_code == 200, exact.text
    assert (exact.json()["match"], exact.json()["config"]) == ("exact", RpaConfig(8, 32).to_dict())
    near = dataclasses.replace(LLAMA, max_num_batched_tokens=1024)
    assert _lookup(server, kind, near).json()["match"] == "nearest"
    miss = _lookup(server, kind, WINDOWED)
    assert miss.status_code == 404 and "no tuned config for kernel 'rpa'" in miss.json()["detail"]
    batch = httpx.post(f"{server.url}/v1/serving/configs/lookup:batch", json={"keys": [
        {"device_kind": kind, **LLAMA.to_dict()}, {"device_kind": kind, **WINDOWED.to_dict()}]})
    assert [item["found"] for item in batch.json()["results"]] == [True, False]
    exported = httpx.get(f"{server.url}/v1/tables/{kind}", params={"kernel": RPA.name})
    assert LookupTable.from_dict(exported.json()) == table


@pytest.mark.parametrize(("params", "named"), [
    ({"kernel": "flash"}, "is no serving kernel"),
    ({"q_heads": "30"}, "multiple of kv_heads"),
    ({"page_size": "0"}, "page_size"),
])
def test_bad_serving_lookups_are_422s_naming_the_field(server: Server, params, named):
    response = httpx.get(f"{server.url}/v1/serving/configs/lookup", params={
        "device_kind": "TPU v5 lite", **dict(LLAMA.query_params()), **params})
    assert response.status_code == 422 and named in response.text, response.text


def test_the_resolver_asks_the_service_for_a_serving_config(server: Server):
    kind = "TPU v5 lite"
    with Store(server.db_url) as store:
        store.publish(_result(kind, dataclasses.replace(LLAMA, max_num_seqs=32),
                              RpaConfig(4, 16), 1.0))
    resolver = Resolver(ResolverSettings(url=server.url, timeout_s=5.0))
    resolution = resolver.resolve(dataclasses.replace(LLAMA, max_num_seqs=32), kind, RPA.name,
                                  get_target("v5e"))
    assert (resolution.source, resolution.match, resolution.config) == (
        "service", "exact", RpaConfig(4, 16))
    resolver.close()


SERVING_LOOKUP = "/v1/serving/configs/lookup"


def _cache_hits(server: Server, route: str) -> float:
    """``autotune_lookup_cache_hits_total`` of ``route`` on the server's /metrics."""
    metrics = httpx.get(f"{server.url}/metrics").text
    found = re.search(rf'^autotune_lookup_cache_hits_total\{{route="{re.escape(route)}"\}} '
                      r'(\S+)$', metrics, re.M)
    assert found, f"no cache hit counter of {route}"
    return float(found.group(1))


def test_serving_lookups_are_cached_until_the_next_write(server: Server):
    """A repeated serving lookup is answered from the service's lookup cache, as an attention
    lookup is (a hit on /metrics), and a config imported, or published straight into the
    database, is seen by the next lookup, single or batched: the cache follows the database's
    data version."""
    kind = _device()
    hits = _cache_hits(server, SERVING_LOOKUP)
    for _ in range(2):
        assert _lookup(server, kind, LLAMA).status_code == 404
    assert _cache_hits(server, SERVING_LOOKUP) == hits + 1  # the miss, cached

    table = LookupTable(RPA.name, RPA.version, kind,
                        (TableEntry(LLAMA, RpaConfig(8, 32), time_ms=2.0),))
    imported = httpx.post(f"{server.url}/v1/tables", json=table.to_dict(), headers=server.auth)
    assert imported.status_code == 200, imported.text
    for _ in range(2):
        assert _lookup(server, kind, LLAMA).json()["config"] == RpaConfig(8, 32).to_dict()
    assert _cache_hits(server, SERVING_LOOKUP) == hits + 2

    near = dataclasses.replace(LLAMA, max_num_seqs=128)
    batch = {"keys": [{"device_kind": kind, **p.to_dict()} for p in (LLAMA, near)]}
    with Store(server.db_url) as store:  # as a tuner writes: not through the service
        store.publish(_result(kind, LLAMA, RpaConfig(16, 32), 1.0))
        assert _lookup(server, kind, LLAMA).json()["config"] == RpaConfig(16, 32).to_dict()
        found = httpx.post(f"{server.url}{SERVING_LOOKUP}:batch", json=batch).json()["results"]
        assert [(r["match"], r["config"]) for r in found] == [
            ("exact", RpaConfig(16, 32).to_dict()), ("nearest", RpaConfig(16, 32).to_dict())]
        store.publish(_result(kind, near, RpaConfig(4, 16), 1.0))
        found = httpx.post(f"{server.url}{SERVING_LOOKUP}:batch", json=batch).json()["results"]
        assert [(r["match"], r["config"]) for r in found] == [
            ("exact", RpaConfig(16, 32).to_dict()), ("exact", RpaConfig(4, 16).to_dict())]
    assert _cache_hits(server, SERVING_LOOKUP) == hits + 2


def test_serving_lookups_read_a_family_once_until_the_next_write(sqlite_db_url):
    """The store keeps a serving family's entries until the next commit, as it keeps an
    attention family's nearest-match candidates: a batch of lookups asked again runs no query
    (``lookup:batch`` of a server's keys at every start), and a publish is seen at once."""
    from sqlalchemy import event

    from storage import LookupRequest

    kind = "TPU v5 lite"
    near = dataclasses.replace(LLAMA, max_num_seqs=128)
    requests = [LookupRequest(kind, LLAMA, RPA.name), LookupRequest(kind, near, RPA.name),
                LookupRequest(kind, WINDOWED, RPA.name)]
    with Store(sqlite_db_url) as store:
        store.publish(_result(kind, LLAMA, RpaConfig(8, 32), 2.0))
        statements: list[str] = []
        event.listen(store.engine, "before_cursor_execute",
                     lambda _c, _cursor, statement, *_: statements.append(statement))

        def looked_up() -> list[Any]:
            return [found and (found[1], found[0].result.config)
                    for found in store.lookup_many(requests)]

        assert looked_up() == [("exact", RpaConfig(8, 32)), ("nearest", RpaConfig(8, 32)), None]
        read = len(statements)
        assert read >= 1
        assert looked_up() == [("exact", RpaConfig(8, 32)), ("nearest", RpaConfig(8, 32)), None]
        assert len(statements) == read, statements[read:]
        store.publish(_result(kind, LLAMA, RpaConfig(16, 32), 1.0))
        assert looked_up() == [("exact", RpaConfig(16, 32)), ("nearest", RpaConfig(16, 32)),
                               None]


# Page 32: a family no other test of the session's server publishes on a v5e.
PAGE32 = dataclasses.replace(LLAMA, page_size=32, pages_per_seq=64)
PAGE32_FAR = dataclasses.replace(PAGE32, max_num_batched_tokens=8192)


def test_the_nearest_serving_entry_is_legal_on_the_device_kinds_chip(sqlite_db_url):
    """Issue 73: a key not stored resolves to the nearest entry legal for its shape, VMEM
    included: (64, 32) at the nearest key needs about 35 MiB of scoped VMEM, over a v5e's 16
    (it would not compile there), so the farther (4, 32) answers. A device kind that is no
    known chip has no VMEM to check: its nearest is the nearest by the stored rules."""
    near = dataclasses.replace(PAGE32, max_num_seqs=128)
    assert RPA.violations(near, RpaConfig(64, 32), "v5e")[0].rule == "vmem"
    with Store(sqlite_db_url) as store:
        for kind in ("TPU v5 lite", "TPU test chip"):
            store.publish(_result(kind, PAGE32, RpaConfig(64, 32), 1.0))
            store.publish(_result(kind, PAGE32_FAR, RpaConfig(4, 32), 1.0))
        found, match = store.lookup(RPA.name, "TPU v5 lite", near)
        assert (match, found.result.problem, found.result.config) == (
            "nearest", PAGE32_FAR, RpaConfig(4, 32))
        found, match = store.lookup(RPA.name, "TPU test chip", near)
        assert (match, found.result.problem, found.result.config) == (
            "nearest", PAGE32, RpaConfig(64, 32))
        # An exact entry is the key's own, whatever it holds.
        assert store.lookup(RPA.name, "TPU v5 lite", PAGE32)[1] == "exact"


def test_the_resolver_borrows_the_services_nearest_entry_legal_on_the_chip(server: Server):
    """The service path of the rule above, end to end: the wrapper's resolver asks the real
    service for a key it does not hold and runs the nearest entry legal on a v5e, not the
    default."""
    kind = "TPU v5 lite"
    near = dataclasses.replace(PAGE32, max_num_seqs=128)
    with Store(server.db_url) as store:
        store.publish(_result(kind, PAGE32, RpaConfig(64, 32), 1.0))
        store.publish(_result(kind, PAGE32_FAR, RpaConfig(4, 32), 1.0))
    resolver = Resolver(ResolverSettings(url=server.url, timeout_s=5.0))
    try:
        resolution = resolver.resolve(near, kind, RPA.name, get_target("v5e"))
    finally:
        resolver.close()
    assert (resolution.source, resolution.match, resolution.origin, resolution.config) == (
        "service", "nearest", PAGE32_FAR, RpaConfig(4, 32))
