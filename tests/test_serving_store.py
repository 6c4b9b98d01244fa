"""Serving configs in storage and the service (docs/serving.md): their own tables (migration
0011), publish with keep-better and history, exact and nearest-legal lookups, a table's import
and export at schema 5, ``/v1/serving/configs/lookup`` (+ ``:batch``) on the real service, and
the wrapper's resolver asking it."""

from __future__ import annotations

import dataclasses
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
