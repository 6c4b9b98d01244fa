"""The lookup service over real HTTP: ``autotune serve`` in a subprocess on loopback, on a
SQLite file (and PostgreSQL for concurrency). Publish, exact and nearest lookup, keep-better
and force with history, batch lookup, listing, table export (ETag) and atomic import, auth,
bad input (4xx naming the field), readiness, metrics, 50 concurrent readers with a writer, and
``serve`` refusing a missing or outdated schema."""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections import Counter
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from api.cache import LookupCache
from api.main import MAX_REPORTED_ERRORS
from conftest import Server, run_cli
from storage import ConfigKey, Store, upgrade
from storage.schema import VERSION_TABLE
from kernel.problem import Problem

PROBLEM = {"batch": 1, "q_heads": 8, "q_len": 1024, "head_dim": 128}


def device() -> str:
    """A device kind of its own, so tests sharing the session server do not interact."""
    return f"TPU test {uuid.uuid4().hex[:8]}"


def body(device_kind: str, median_ms: float = 1.0, *, config: dict[str, int] | None = None,
         force: bool = False, **problem: Any) -> dict[str, Any]:
    return {"key": {"device_kind": device_kind, **PROBLEM, **problem},
            "config": config or {"block_q": 256, "block_kv": 512},
            "median_ms": median_ms, "default_median_ms": 2.0, "trials": 12, "method": "device",
            "jax_version": "0.10.2", "force": force}


def lookup_params(device_kind: str, **problem: Any) -> dict[str, Any]:
    return {"kernel": "flash", "device_kind": device_kind, **PROBLEM, **problem}


def publish(server: Server, payload: dict[str, Any]) -> dict[str, Any]:
    response = httpx.put(f"{server.url}/v1/configs", json=payload, headers=server.auth)
    assert response.status_code == 200, response.text
    return response.json()


def test_publish_then_exact_lookup(server: Server) -> None:
    kind = device()
    assert publish(server, body(kind))["status"] == "inserted"
    response = httpx.get(f"{server.url}/v1/configs/lookup", params=lookup_params(kind))
    assert response.status_code == 200
    found = response.json()
    assert found["match"] == "exact"
    assert (found["config"]["block_q"], found["config"]["block_kv"]) == (256, 512)
    assert found["key"] == {"kernel": "flash", "kernel_version": "1", "device_kind": kind,
                            "platform": "tpu", "batch": 1, "q_heads": 8, "kv_heads": 8,
                            "q_len": 1024, "kv_len": 1024, "head_dim": 128,
                            "dtype": "bfloat16", "causal": False, "mode": "fwd",
                            "window": None, "softcap": None, "segmented": False,
                            "bottom_right": False}
    assert (found["time_ms"], found["speedup"]) == (1.0, 2.0)


def test_nearest_lookup_uses_a_legal_config_and_misses_are_404(server: Server) -> None:
    kind = device()
    publish(server, body(kind, config={"block_q": 1024, "block_kv": 1024}))  # illegal for 512
    publish(server, body(kind, q_len=4096, config={"block_q": 512, "block_kv": 512}))

    found = httpx.get(f"{server.url}/v1/configs/lookup",
                      params=lookup_params(kind, q_len=512)).json()
    assert (found["match"], found["key"]["q_len"], found["config"]["block_q"]) == (
        "nearest", 4096, 512)

    miss = httpx.get(f"{server.url}/v1/configs/lookup", params=lookup_params(kind, q_len=64))
    assert miss.status_code == 404
    assert "no tuned config" in miss.json()["detail"]
    other_mode = httpx.get(f"{server.url}/v1/configs/lookup",
                           params=lookup_params(kind, mode="fwd_bwd"))
    assert other_mode.status_code == 404


def test_lookups_see_writes_made_directly_to_the_database(server: Server) -> None:
    """Answers are cached per data version: a tuner writing to the database (not through the
    service) is visible on the next lookup, misses included."""
    from kernel import FlashConfig
    from storage import TunedResult

    kind = device()
    url = f"{server.url}/v1/configs/lookup"
    for _ in range(2):
        assert httpx.get(url, params=lookup_params(kind)).status_code == 404
    with Store(server.db_url) as store:
        tuned = TunedResult(device_kind=kind, problem=Problem.from_dict(PROBLEM),
                            config=FlashConfig(block_q=512), median_ms=2.0)
        store.publish(tuned)
        for _ in range(2):
            assert httpx.get(url, params=lookup_params(kind)).json()["config"]["block_q"] == 512
        store.publish(TunedResult(device_kind=kind, problem=tuned.problem,
                                  config=FlashConfig(block_q=256), median_ms=1.0))
    assert httpx.get(url, params=lookup_params(kind)).json()["config"]["block_q"] == 256


def test_keep_better_and_force_keep_history(server: Server) -> None:
    kind = device()
    publish(server, body(kind, 1.0))
    kept = publish(server, body(kind, 2.0, config={"block_q": 128}))
    assert (kept["status"], kept["entry"]["median_ms"], kept["previous"]["median_ms"]) == (
        "kept", 1.0, 1.0)
    replaced = publish(server, body(kind, 0.5, config={"block_q": 512}))
    assert (replaced["status"], replaced["entry"]["config"]["block_q"]) == ("replaced", 512)
    forced = publish(server, body(kind, 9.0, config={"block_q": 128}, force=True))
    assert (forced["status"], forced["entry"]["median_ms"]) == ("replaced", 9.0)

    with Store(server.db_url) as store:
        key = ConfigKey("flash", "1", kind, "tpu", Problem.from_dict(PROBLEM))
        assert [(h.reason, h.result.median_ms) for h in store.history(key)] == [
            ("rejected", 2.0), ("replaced", 1.0), ("forced", 0.5)]


def test_a_lookup_says_whether_it_was_measured_in_interpret_mode_and_on_which_device(
        server: Server) -> None:
    """Issue 62 item 11: the lookup's provenance held only the versions, so a config timed
    in interpret mode on a CPU read like a device figure."""
    kind = device()
    publish(server, {**body(kind), "method": "interpret", "device_index": 2,
                     "timing": "wallclock"})
    found = httpx.get(f"{server.url}/v1/configs/lookup", params=lookup_params(kind)).json()
    assert found["provenance"] == {"jax_version": "0.10.2", "jaxlib_version": None,
                                   "libtpu_version": None, "timing": "wallclock",
                                   "method": "interpret", "device_index": 2}
    batch = httpx.post(f"{server.url}/v1/configs/lookup:batch",
                       json={"keys": [lookup_params(kind, q_len=2048)]}).json()
    assert batch["results"][0]["provenance"] == found["provenance"]


def test_batch_lookup_answers_every_key_in_order(server: Server) -> None:
    kind = device()
    publish(server, body(kind))
    keys = [lookup_params(kind, q_len=64), lookup_params(kind), lookup_params(kind, q_len=2048)]
    response = httpx.post(f"{server.url}/v1/configs/lookup:batch", json={"keys": keys})
    assert response.status_code == 200
    results = response.json()["results"]
    assert [(r["found"], r["match"]) for r in results] == [
        (False, None), (True, "exact"), (True, "nearest")]
    assert "no tuned config" in results[0]["detail"]

    bad = httpx.post(f"{server.url}/v1/configs/lookup:batch",
                     json={"keys": [lookup_params(kind), lookup_params(kind, kv_heads=3)]})
    assert bad.status_code == 422 and "keys[1]" in bad.json()["detail"]
    too_many = httpx.post(f"{server.url}/v1/configs/lookup:batch",
                          json={"keys": [lookup_params(kind)] * 101})
    assert too_many.status_code == 422 and "at most 100" in too_many.text


def test_list_filters_and_pages(server: Server) -> None:
    kind = device()
    for q_len in (256, 512, 1024):
        publish(server, body(kind, q_len=q_len, config={"block_q": 256, "block_kv": 256}))
    page = httpx.get(f"{server.url}/v1/configs",
                     params={"device_kind": kind, "offset": 1, "limit": 1}).json()
    assert (page["total"], page["offset"], page["limit"]) == (3, 1, 1)
    assert [item["key"]["q_len"] for item in page["items"]] == [512]
    assert httpx.get(f"{server.url}/v1/configs",
                     params={"device_kind": kind, "dtype": "float32"}).json()["total"] == 0
    unknown = httpx.get(f"{server.url}/v1/configs", params={"device_kind": kind, "colour": "red"})
    assert unknown.status_code == 422 and "colour" in unknown.text


def test_export_with_etag_and_import(server: Server) -> None:
    kind = device()
    for q_len in (256, 512):
        publish(server, body(kind, q_len=q_len, config={"block_q": 256, "block_kv": 256}))
    url = f"{server.url}/v1/tables/{kind}"
    exported = httpx.get(url)
    assert exported.status_code == 200
    table = exported.json()
    assert (table["device_kind"], len(table["entries"])) == (kind, 2)
    etag = exported.headers["etag"]
    assert httpx.get(url, headers={"If-None-Match": etag}).status_code == 304
    assert httpx.get(url, headers={"If-None-Match": '"other"'}).status_code == 200
    assert httpx.get(f"{server.url}/v1/tables/{device()}").status_code == 404

    copy_kind = device()
    imported = httpx.post(f"{server.url}/v1/tables", headers=server.auth,
                          json={**table, "device_kind": copy_kind})
    assert imported.json() == {"inserted": 2, "replaced": 0, "kept": 0, "choices": 0,
                               "left_out": []}
    copy = httpx.get(f"{server.url}/v1/tables/{copy_kind}").json()
    assert copy["entries"] == table["entries"]
    assert httpx.get(url, headers={"If-None-Match": etag}).status_code == 304  # unchanged

    publish(server, body(kind, 0.1, q_len=256, config={"block_q": 128, "block_kv": 256}))
    assert httpx.get(url, headers={"If-None-Match": etag}).status_code == 200  # changed


@pytest.mark.parametrize("entry, message", [
    ({"problem": {"batch": 1, "q_heads": 8, "q_len": 512, "head_dim": 128, "dtype": "int4"},
      "config": {}}, "entry 1: dtype"),
    ({"problem": {"batch": 1, "q_heads": 8, "q_len": 512, "head_dim": 128},
      "config": {"block_q": 384}, "time_ms": 1.0}, "entry 1 .*block_divides"),
    # Issue 55 item 9: an OverflowError, answered 500.
    ({"problem": {"batch": 1, "q_heads": 8, "q_len": 512, "head_dim": 128,
                  "softcap": 10 ** 400}, "config": {}},
     "entry 1: softcap must be positive and finite .* an integer too large for a float"),
])
def test_bad_table_import_writes_nothing(server: Server, entry: dict[str, Any],
                                         message: str) -> None:
    kind = device()
    good = {"problem": {"batch": 1, "q_heads": 8, "q_len": 256, "head_dim": 128},
            "config": {"block_q": 256, "block_kv": 256}, "time_ms": 1.0}
    table = {"schema_version": 3, "kernel": "flash", "kernel_version": "1", "device_kind": kind,
             "entries": [good, entry]}
    response = httpx.post(f"{server.url}/v1/tables", headers=server.auth, json=table)
    assert response.status_code == 422
    assert re.search(message, response.json()["detail"])
    listed = httpx.get(f"{server.url}/v1/configs", params={"device_kind": kind}).json()
    assert listed["total"] == 0


def test_a_table_import_refuses_a_malformed_others_and_names_what_it_leaves_out(
        server: Server) -> None:
    """Issue 55 items 9 and 15: an ``others`` item whose kernel is a list answered 500 (a
    TypeError); one of a kernel the server does not install was dropped without a word."""
    kind = device()
    table = {"schema_version": 3, "kernel": "flash", "kernel_version": "1", "device_kind": kind,
             "entries": [], "others": [{"kernel": ["splash"], "kernel_version": "1",
                                        "entries": []}]}
    refused = httpx.post(f"{server.url}/v1/tables", headers=server.auth, json=table)
    assert refused.status_code == 422, refused.text
    assert "others[0]: field 'kernel' must be a non-empty string" in refused.json()["detail"]
    table["others"][0]["kernel"] = "future"
    imported = httpx.post(f"{server.url}/v1/tables", headers=server.auth, json=table)
    assert imported.json() == {"inserted": 0, "replaced": 0, "kept": 0, "choices": 0,
                               "left_out": ["future"]}, imported.text


def test_writes_need_the_token(server: Server) -> None:
    payload = body(device())
    no_token = httpx.put(f"{server.url}/v1/configs", json=payload)
    assert no_token.status_code == 401 and "Authorization: Bearer" in no_token.json()["detail"]
    wrong = httpx.put(f"{server.url}/v1/configs", json=payload,
                      headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "does not match" in wrong.json()["detail"]
    table = {"schema_version": 1, "kernel": "flash", "kernel_version": "1",
             "device_kind": "x", "entries": []}
    assert httpx.post(f"{server.url}/v1/tables", json=table).status_code == 401
    lookups = httpx.get(f"{server.url}/v1/configs/lookup",
                        params=lookup_params(payload["key"]["device_kind"]))
    assert lookups.status_code == 404  # reads are open; nothing was written


@pytest.fixture(scope="module")
def tokenless_server(start_server, tmp_path_factory) -> Server:
    """A server started without AUTOTUNE_API_TOKEN (and without --allow-anonymous-writes)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('tokenless') / 'autotune.db'}"
    assert run_cli("db", "upgrade", "--db", url).returncode == 0
    return start_server(url, token=None)


def test_without_a_token_writes_are_refused_unless_allowed(start_server,
                                                           tokenless_server: Server) -> None:
    refused = httpx.put(f"{tokenless_server.url}/v1/configs", json=body("cpu"))
    assert refused.status_code == 403
    assert "AUTOTUNE_API_TOKEN" in refused.json()["detail"]
    assert "--allow-anonymous-writes" in refused.json()["detail"]

    opened = start_server(tokenless_server.db_url, token=None,
                          args=("--allow-anonymous-writes",))
    assert httpx.put(f"{opened.url}/v1/configs", json=body("cpu")).status_code == 200
    assert httpx.get(f"{tokenless_server.url}/v1/configs/lookup",
                     params=lookup_params("cpu")).status_code == 200


@pytest.mark.parametrize("params, field", [
    ({"batch": None}, "batch"),
    ({"q_len": -5}, "q_len"),
    ({"dtype": "int8"}, "dtype"),
    ({"q_len": 10**9}, "q_len"),
    ({"head_dim": "wide"}, "head_dim"),
    ({"causal": "maybe"}, "causal"),
    ({"kv_heads": 3}, "kv_heads"),
    ({"device_kind": "TPU\x00"}, "device_kind"),
    ({"colour": "red"}, "colour"),
])
def test_bad_lookup_input_is_a_4xx_naming_the_field(server: Server, params: dict[str, Any],
                                                    field: str) -> None:
    query = {k: v for k, v in {**lookup_params("cpu"), **params}.items() if v is not None}
    response = httpx.get(f"{server.url}/v1/configs/lookup", params=query)
    assert response.status_code == 422
    assert field in response.text


@pytest.mark.parametrize("mutate, field", [
    (lambda b: b["key"].pop("batch"), "batch"),
    (lambda b: b.update(median_ms=-1), "median_ms"),
    (lambda b: b.update(method="guess"), "method"),
    (lambda b: b["config"].update(block_q=100), "block_q"),
    (lambda b: b["config"].update(block_size=128), "block_size"),
    (lambda b: b["config"].update(pipeline_depth=0), "pipeline_depth"),
    (lambda b: b["key"].update(dtype="int8"), "dtype"),
])
def test_bad_publish_is_a_422_naming_the_field(server: Server, mutate, field: str) -> None:
    payload = body(device())
    mutate(payload)
    response = httpx.put(f"{server.url}/v1/configs", json=payload, headers=server.auth)
    assert response.status_code == 422
    assert field in response.text


def _table(device_kind: str, *entries: dict[str, Any]) -> dict[str, Any]:
    return {"schema_version": 1, "kernel": "flash", "kernel_version": "1",
            "device_kind": device_kind, "entries": list(entries)}


TABLE_ENTRY = {"problem": {"batch": 1, "q_heads": 8, "q_len": 256, "head_dim": 128},
               "config": {"block_q": 256, "block_kv": 256}, "time_ms": 1.0}


@pytest.mark.parametrize("method, path, raw, field", [
    ("PUT", "/v1/configs", json.dumps(body("K")).replace('"median_ms": 1.0', '"median_ms": NaN'),
     "body.median_ms: NaN"),
    ("PUT", "/v1/configs", json.dumps(body("K")).replace('"K"', '"TPU \\ud800"'),
     "body.key.device_kind"),
    ("POST", "/v1/tables", json.dumps(_table("K", TABLE_ENTRY)).replace(
        '"time_ms": 1.0', '"time_ms": Infinity'), "body.entries[0].time_ms: Infinity"),
    ("POST", "/v1/tables", json.dumps(_table("K", TABLE_ENTRY)).replace('"K"', '"\\udc00"'),
     "body.device_kind"),
    ("POST", "/v1/configs/lookup:batch", json.dumps({"keys": [lookup_params("K")]}).replace(
        '"q_len": 1024', '"q_len": -Infinity'), "body.keys[0].q_len: -Infinity"),
    ("POST", "/v1/configs/lookup:batch", '{"keys": [{"\\ud800": 1}]}', "body.keys[0]: the key"),
], ids=["publish-nan", "publish-surrogate", "import-infinity", "import-surrogate",
        "batch-infinity", "batch-surrogate-key"])
def test_non_finite_numbers_and_lone_surrogates_are_422s_naming_the_field(
        server: Server, method: str, path: str, raw: str, field: str) -> None:
    """Python's json reads NaN, Infinity and lone surrogates; neither validation errors nor
    the database can encode them, so they are refused first (they were 500s)."""
    response = httpx.request(method, f"{server.url}{path}", content=raw.encode(),
                             headers={**server.auth, "Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    assert field in response.json()["detail"]
    assert httpx.get(f"{server.url}/v1/configs", params={"device_kind": "K"}).json()[
        "total"] == 0


def test_a_time_no_measurement_gives_is_a_422_naming_the_floor(server: Server) -> None:
    """Issue 75 item 11j: a PUT of 5e-324 ms was stored, and every tune of its key kept it."""
    kind = device()
    response = httpx.put(f"{server.url}/v1/configs", json=body(kind, 5e-324),
                         headers=server.auth)
    assert response.status_code == 422 and "below 0.0001 ms" in response.text, response.text
    assert httpx.get(f"{server.url}/v1/configs/lookup",
                     params=lookup_params(kind)).status_code == 404


def test_integers_beyond_what_a_database_column_holds_are_422s(server: Server) -> None:
    """2**31 fits SQLite's INTEGER but not PostgreSQL's: every stored integer is bounded by
    both (a 503 on PostgreSQL and a 500 on SQLite before)."""
    kind = device()
    for trials in (2**31, 2**64):
        response = httpx.put(f"{server.url}/v1/configs", json={**body(kind), "trials": trials},
                             headers=server.auth)
        assert response.status_code == 422 and "trials" in response.text
        entry = {**TABLE_ENTRY, "provenance": {"trials": trials}}
        response = httpx.post(f"{server.url}/v1/tables", json=_table(kind, entry),
                              headers=server.auth)
        assert response.status_code == 422
        assert "entry 0" in response.json()["detail"] and "trials" in response.text
    assert publish(server, {**body(kind), "trials": 2**31 - 1})["status"] == "inserted"


def test_malformed_json_is_a_4xx(server: Server) -> None:
    response = httpx.put(f"{server.url}/v1/configs", content=b"{not json",
                         headers={**server.auth, "Content-Type": "application/json"})
    assert 400 <= response.status_code < 500
    response = httpx.post(f"{server.url}/v1/tables", content=b"[1, 2",
                          headers={**server.auth, "Content-Type": "application/json"})
    assert 400 <= response.status_code < 500


def test_metrics_count_lookups_by_match_kind(server: Server) -> None:
    kind = device()
    publish(server, body(kind))

    def counts() -> dict[str, float]:
        metrics = httpx.get(f"{server.url}/metrics").text
        return {m: float(v) for m, v in
                re.findall(r'^autotune_lookups_total\{match="(\w+)"\} (\S+)$', metrics, re.M)}

    before = counts()
    for q_len in (1024, 1024, 2048, 64):
        httpx.get(f"{server.url}/v1/configs/lookup", params=lookup_params(kind, q_len=q_len))
    after = counts()
    assert {m: after[m] - before.get(m, 0) for m in after} == {
        "exact": 2, "nearest": 1, "miss": 1}
    text_metrics = httpx.get(f"{server.url}/metrics").text
    assert 'route="/v1/configs/lookup"' in text_metrics
    assert "autotune_http_request_duration_seconds_bucket" in text_metrics


def test_a_repeated_lookup_is_a_cache_hit_until_the_next_write(server: Server) -> None:
    """The lookup cache answers a repeated ``GET /v1/configs/lookup`` (counted by route in
    ``autotune_lookup_cache_hits_total``, and by match kind as any lookup); a publish makes the
    next one a fresh answer."""
    kind = device()
    route = "/v1/configs/lookup"

    def hits() -> float:
        metrics = httpx.get(f"{server.url}/metrics").text
        return float(re.search(r'^autotune_lookup_cache_hits_total\{route="/v1/configs/lookup"'
                               r'\} (\S+)$', metrics, re.M).group(1))

    publish(server, body(kind))
    before = hits()
    for _ in range(3):
        assert httpx.get(f"{server.url}{route}", params=lookup_params(kind)).status_code == 200
    assert hits() == before + 2
    publish(server, body(kind, 0.5, config={"block_q": 512}))
    found = httpx.get(f"{server.url}{route}", params=lookup_params(kind)).json()
    assert found["config"]["block_q"] == 512 and hits() == before + 2


def test_metrics_labels_stay_bounded_under_random_methods_and_paths(server: Server) -> None:
    """Unknown methods and unmatched paths fold into one label value each (random method
    names grew /metrics without bound)."""
    with server.client() as client:
        for i in range(20):
            client.request(f"X{uuid.uuid4().hex[:8].upper()}", f"/nowhere/{i}")
            client.request(f"Y{uuid.uuid4().hex[:8].upper()}", "/healthz")
        exposed = client.get("/metrics").text
    labels = re.findall(r'^autotune_http_requests_total\{method="([^"]*)",route="([^"]*)"',
                        exposed, re.M)
    assert {method for method, _ in labels} <= {"GET", "HEAD", "POST", "PUT", "PATCH",
                                                "DELETE", "OPTIONS", "other"}
    assert ("other", "unmatched") in labels
    assert not any(route.startswith("/nowhere") for _, route in labels)


def test_health_docs_and_openapi(server: Server) -> None:
    assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/readyz").json() == {"status": "ready"}
    for probe in ("/healthz", "/readyz"):  # the probe of many uptime checkers (405 before)
        response = httpx.head(f"{server.url}{probe}")
        assert (response.status_code, response.content) == (200, b"")
    assert httpx.get(f"{server.url}/docs").status_code == 200
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert {"/v1/configs/lookup", "/v1/configs/lookup:batch", "/v1/configs",
            "/v1/tables/{device_kind}", "/v1/tables"} <= set(paths)


def test_readyz_is_503_when_the_schema_is_not_current(tokenless_server: Server) -> None:
    with Store(tokenless_server.db_url) as store:
        with store.engine.begin() as connection:
            head = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
            connection.execute(text(f"DELETE FROM {VERSION_TABLE}"))
        try:
            response = httpx.get(f"{tokenless_server.url}/readyz")
            assert response.status_code == 503
            assert httpx.head(f"{tokenless_server.url}/readyz").status_code == 503
            assert "autotune db upgrade" in response.json()["detail"]
        finally:
            with store.engine.begin() as connection:
                connection.execute(text(f"INSERT INTO {VERSION_TABLE} VALUES (:head)"),
                                   {"head": head})
    assert httpx.get(f"{tokenless_server.url}/readyz").status_code == 200


def test_pages_answer_a_database_failure_with_an_html_page(tokenless_server: Server) -> None:
    """A browser got the JSON 503 of the API routes, shown raw."""
    assert httpx.head(f"{tokenless_server.url}/").status_code == 200  # 405 before
    with Store(tokenless_server.db_url) as store:
        with store.engine.begin() as connection:
            connection.execute(text("ALTER TABLE autotune_configs RENAME TO moved_away"))
        try:
            response = httpx.get(f"{tokenless_server.url}/")
        finally:
            with store.engine.begin() as connection:
                connection.execute(text("ALTER TABLE moved_away RENAME TO autotune_configs"))
    assert response.status_code == 503
    assert response.headers["content-type"].startswith("text/html")
    assert "Database unavailable" in response.text and "autotune db upgrade" in response.text
    assert httpx.get(f"{tokenless_server.url}/").status_code == 200


@pytest.mark.parametrize("stale", [False, True], ids=["missing", "unversioned"])
def test_serve_refuses_a_missing_or_unversioned_schema(tmp_path, stale: bool) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    if stale:
        assert run_cli("db", "upgrade", "--db", url).returncode == 0
        with Store(url) as store, store.engine.begin() as connection:
            connection.execute(text(f"DELETE FROM {VERSION_TABLE}"))
    done = run_cli("serve", "--db", url, "--port", "1", timeout=60)
    assert done.returncode == 1
    assert f"autotune db upgrade --db {url}" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def busy_server(request, server: Server, start_server) -> Server:
    """The session server (SQLite), or a server on a new PostgreSQL database."""
    if request.param == "sqlite":
        return server
    url = request.getfixturevalue("postgres_databases")()
    assert run_cli("db", "upgrade", "--db", url).returncode == 0
    return start_server(url)


def test_concurrent_readers_and_a_writer(busy_server: Server) -> None:
    """50 clients look up keys while one writer publishes them: no errors, no lost write."""
    kind, written = device(), 20
    q_lens = [128 * (i + 1) for i in range(written)]
    statuses: Counter[int] = Counter()
    failures: list[BaseException] = []
    done = threading.Event()
    lock = threading.Lock()

    def reader(index: int) -> None:
        try:
            with busy_server.client() as client:
                i = index
                while not done.is_set():
                    q_len = q_lens[i % written]
                    status = client.get("/v1/configs/lookup", params=lookup_params(
                        kind, q_len=q_len)).status_code
                    with lock:
                        statuses[status] += 1
                    i += 7
        except BaseException as error:  # noqa: BLE001 (reported below)
            failures.append(error)

    readers = [threading.Thread(target=reader, args=(i,)) for i in range(50)]
    for thread in readers:
        thread.start()
    try:
        with busy_server.client(headers=busy_server.auth) as writer:
            for q_len in q_lens:
                response = writer.put("/v1/configs", json=body(
                    kind, q_len=q_len, config={"block_q": 128, "block_kv": 128}))
                assert response.status_code == 200, response.text
    finally:
        done.set()
        for thread in readers:
            thread.join()
    assert failures == []
    assert set(statuses) <= {200, 404} and sum(statuses.values()) > written
    with busy_server.client() as client:
        for q_len in q_lens:
            found = client.get("/v1/configs/lookup", params=lookup_params(kind, q_len=q_len))
            assert found.status_code == 200 and found.json()["match"] == "exact"


def test_the_kernel_resolver_reads_the_service(server: Server) -> None:
    """``kernel.resolve`` (urllib) against the real service: exact, nearest, and a miss that
    falls back to the default config."""
    from kernel import get_target
    from kernel.resolve import Resolver, ResolverSettings

    kind, cpu = device(), get_target("cpu")
    publish(server, body(kind, config={"block_q": 512, "block_kv": 512}))
    resolver = Resolver(ResolverSettings(url=server.url, timeout_s=10))
    exact = resolver.resolve(Problem.from_dict(PROBLEM), kind, "flash", cpu)
    assert (exact.source, exact.config.block_q, exact.detail) == (
        "service", 512, "exact match from service")
    nearest = resolver.resolve(Problem.from_dict({**PROBLEM, "q_len": 2048}), kind, "flash",
                               cpu)
    assert (nearest.source, nearest.config.block_q) == ("service", 512)
    assert nearest.detail == "nearest match from service"
    miss = resolver.resolve(Problem.from_dict({**PROBLEM, "q_len": 256}), kind, "flash", cpu)
    assert miss.source == "default" and "no config" in miss.detail
    assert resolver.service_requests == 3


def test_a_body_over_the_limit_is_a_413_before_it_is_parsed(server: Server) -> None:
    """A write's body: ``AUTOTUNE_MAX_BODY_BYTES`` (4 MiB of ``{}`` would take gigabytes once
    parsed)."""
    table = b'{"entries": [' + b"{}," * ((4 << 20) // 3) + b"{}]}"
    for content in (table, iter([table[:1 << 20], table[1 << 20:]])):  # declared, then chunked
        response = httpx.post(f"{server.url}/v1/tables", content=content, timeout=30,
                              headers={**server.auth, "Content-Type": "application/json"})
        assert response.status_code == 413, response.text[:200]
        assert "AUTOTUNE_MAX_BODY_BYTES" in response.json()["detail"]


def test_a_lookup_body_has_a_limit_of_its_own_and_a_write_checks_its_token_first(
        server: Server) -> None:
    """Issue 75 item 11a: 4 MiB (under the write limit) of ``{}`` keys, no token, held the
    event loop 3.5 s per request while parsed, though a batch takes at most 100 keys: a
    lookup's body past ``AUTOTUNE_MAX_LOOKUP_BODY_BYTES`` (64 KiB) is a 413 unread; a write
    without its token is a 401 before its body is read (not a 422 about the body)."""
    keys = b'{"keys": [' + b"{}," * (1 << 20) + b"{}]}"
    for path in ("/v1/configs/lookup:batch", "/v1/choices/lookup:batch"):
        for content in (keys, iter([keys[:1 << 16], keys[1 << 16:]])):  # declared, chunked
            response = httpx.post(f"{server.url}{path}", content=content, timeout=30,
                                  headers={"Content-Type": "application/json"})
            assert response.status_code == 413, response.text[:200]
            assert "65536 bytes" in response.json()["detail"]
            assert "AUTOTUNE_MAX_LOOKUP_BODY_BYTES" in response.json()["detail"]
    response = httpx.post(f"{server.url}/v1/configs/lookup:batch",
                          json={"keys": [lookup_params(device(), q_len=256)] * 100})
    assert response.status_code == 200  # the largest batch is well within it
    for method, path in (("PUT", "/v1/configs"), ("POST", "/v1/tables")):
        response = httpx.request(method, f"{server.url}{path}", content=b"[" * 100_000,
                                 headers={"Content-Type": "application/json"})
        assert response.status_code == 401, response.text[:200]
        assert "Authorization: Bearer" in response.json()["detail"]


def test_a_device_kind_with_a_slash_is_exported(server: Server) -> None:
    kind = f"{device()}/slice-2"
    publish(server, body(kind))
    response = httpx.get(f"{server.url}/v1/tables/{kind.replace('/', '%2F')}")
    assert response.status_code == 200 and response.json()["device_kind"] == kind


def test_the_lookup_cache_skips_padded_query_strings(tmp_path) -> None:
    """``&`` padding makes a valid lookup's query up to 16 KiB: answered, never cached."""
    url = f"sqlite:///{tmp_path / 'cache.db'}"
    upgrade(url)
    with Store(url) as store:
        cache = LookupCache(store, max_entries=10)
        plain, padded = b"device_kind=x&batch=1", b"device_kind=x&batch=1" + b"&" * 2000
        for query in (plain, padded):
            cache.put("/v1/configs/lookup", query, cache.version(), 200, b"{}", "exact")
        assert cache.get("/v1/configs/lookup", plain) == (200, b"{}", "exact")
        assert cache.get("/v1/configs/lookup", padded) is None


def test_a_422_names_each_problem_without_echoing_the_body(server: Server) -> None:
    """FastAPI's own 422 repeats the enclosing object for each missing field (31 MB back for
    a 4 MiB body); ours says where and why, at most ``MAX_REPORTED_ERRORS`` times."""
    response = httpx.put(f"{server.url}/v1/configs", json={"key": {"x": "A" * 100_000}},
                         headers=server.auth, timeout=30)
    assert response.status_code == 422
    assert len(response.content) < 10_000, len(response.content)
    detail = response.json()["detail"]
    assert {"type": "missing", "loc": ["body", "key", "q_len"], "msg": "Field required"} in detail
    assert all("input" not in e for e in detail)
    keys = [{"q_len": "x"}] * 30  # five errors per key: four fields missing, one not a number
    response = httpx.post(f"{server.url}/v1/configs/lookup:batch", json={"keys": keys})
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert len(detail) == MAX_REPORTED_ERRORS + 1
    assert detail[-1]["msg"] == f"{len(keys) * 5 - MAX_REPORTED_ERRORS} more errors"


@pytest.mark.parametrize("table, ending", [
    ({"entries": [{**TABLE_ENTRY, "config": {"block_q": "A" * 1_000_000}}]}, "AAA'"),
    ({"kernel": "A" * 1_000_000}, "choose one of flash, "),
], ids=["config-value", "kernel-name"])
def test_our_own_422s_cut_a_quoted_value(server: Server, table: dict[str, Any],
                                         ending: str) -> None:
    """An error message quotes the bad value; a megabyte of it is cut in the middle, keeping
    what is wrong and the fix (the whole value came back before)."""
    response = httpx.post(f"{server.url}/v1/tables", json={**_table(device()), **table},
                          headers=server.auth, timeout=30)
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert len(detail) < 2000 and "characters ...]" in detail, detail[:100]
    assert ending in detail[-600:], detail[-600:]


def test_a_body_sent_as_another_media_type_is_a_415_naming_the_header(server: Server) -> None:
    """What ``curl --data-binary @table.json`` sends: once a 422 "Input should be a valid
    dictionary" for a valid table."""
    table = json.dumps(_table(device(), TABLE_ENTRY))
    for media_type in ("application/x-www-form-urlencoded", "text/plain; charset=utf-8"):
        response = httpx.post(f"{server.url}/v1/tables", content=table,
                              headers={**server.auth, "Content-Type": media_type})
        assert response.status_code == 415, response.text
        assert "Content-Type: application/json" in response.json()["detail"]
    # Issue 75 item 11p: without the header, "Input should be a valid dictionary".
    response = httpx.post(f"{server.url}/v1/tables", content=table, headers=server.auth)
    assert response.status_code == 415, response.text
    assert response.json()["detail"].startswith("the body is sent without a Content-Type")
    for media_type in ("application/json; charset=utf-8", "application/merge-patch+json"):
        response = httpx.post(f"{server.url}/v1/tables", content=table,
                              headers={**server.auth, "Content-Type": media_type})
        assert response.status_code == 200, response.text


def test_exporting_an_unknown_kernel_is_a_422_with_or_without_a_version(server: Server) -> None:
    """With a version, it was a table of kernel 'nope' (the device's choices in it) that no
    import accepts."""
    for params in ({"kernel": "nope"}, {"kernel": "nope", "kernel_version": "1"}):
        response = httpx.get(f"{server.url}/v1/tables/{device()}", params=params)
        assert response.status_code == 422, response.text
        assert "unknown kernel 'nope'; choose one of" in response.json()["detail"]


# --- issue 62 item 8: strictness ---


@pytest.mark.parametrize("token", [" s3cret", "s3cret\n", "\ts3cret "])
def test_serve_refuses_a_token_with_surrounding_whitespace_in_one_line(tmp_path,
                                                                       token: str) -> None:
    """Such a server started, and no write could ever authenticate: an HTTP header's value
    loses the whitespace. Refused at startup (not stripped: its clients hold the token as
    given), without echoing it."""
    url = f"sqlite:///{tmp_path / 'autotune.db'}"
    assert run_cli("db", "upgrade", "--db", url).returncode == 0
    done = run_cli("serve", "--db", url, "--port", "1", env={"AUTOTUNE_API_TOKEN": token},
                   timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "error: AUTOTUNE_API_TOKEN: Value error, the token starts or ends with whitespace, "
        "which no HTTP header carries (no bearer token would match it); remove the whitespace")
    assert "s3cret" not in done.stderr + done.stdout


@pytest.mark.parametrize("force", ["yes", "1", "on", "maybe"])
def test_an_imports_force_is_true_or_false_only(server: Server, force: str) -> None:
    """``force=yes``, ``1`` or ``on`` were read as true (other endpoints' booleans are 422s)."""
    kind = device()
    table = _table(kind, TABLE_ENTRY)
    response = httpx.post(f"{server.url}/v1/tables", params={"force": force},
                          headers=server.auth, json=table)
    assert response.status_code == 422, response.text
    [error] = response.json()["detail"]
    assert error["loc"] == ["query", "force"] and f"give true or false, got '{force}'" in \
        error["msg"]
    assert httpx.get(f"{server.url}/v1/configs", params={"device_kind": kind}).json()[
        "total"] == 0
    assert httpx.post(f"{server.url}/v1/tables", params={"force": "true"}, headers=server.auth,
                      json=table).json()["inserted"] == 1


def test_unknown_query_parameters_of_the_tables_endpoints_are_422s(server: Server) -> None:
    """``GET /v1/tables/{device}?colour=red`` answered the table, ignoring it (the other
    endpoints answer 422)."""
    kind = device()
    publish(server, body(kind))
    assert httpx.get(f"{server.url}/v1/tables/{kind}", params={"kernel": "flash"}
                     ).status_code == 200
    for method, path, options in (("GET", f"/v1/tables/{kind}", {}),
                                  ("POST", "/v1/tables", {"json": _table(kind)})):
        response = httpx.request(method, f"{server.url}{path}", headers=server.auth,
                                 params={"colour": "red"}, **options)
        assert response.status_code == 422, response.text
        [error] = response.json()["detail"]
        assert error["loc"] == ["query", "colour"] and error["type"] == "extra_forbidden"


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b.update(median_ms=0), "body.median_ms: Input should be greater than 0"),
    (lambda b: b.update(default_median_ms=0.0), "body.default_median_ms: Input should be "
                                                "greater than 0"),
    (lambda b: b.update(speedup=0.0), "body.speedup: Input should be greater than 0"),
    (lambda b: b.update(roofline_fraction=1e9), "body.roofline_fraction: Input should be less "
                                                "than or equal to 1"),
    (lambda b: b.update(roofline_fraction=0), "body.roofline_fraction: Input should be greater "
                                              "than 0"),
    (lambda b: b["key"].update(device_kind="\ufeffcpu"), "device_kind must be printable text, "
                                                         "got '\\ufeffcpu', which holds U+FEFF "
                                                         "(ZERO WIDTH NO-BREAK SPACE)"),
    (lambda b: b["key"].update(device_kind="TPU\u00a0v5 lite"), "U+00A0 (NO-BREAK SPACE)"),
], ids=["median-0", "default-median-0", "speedup-0", "roofline-1e9", "roofline-0", "bom",
        "no-break-space"])
def test_a_publish_of_a_measurement_or_device_kind_no_tune_makes_is_a_422(
        server: Server, mutate, message: str) -> None:
    """A median of 0 ms, a roofline fraction of 1e9 and a device kind with a BOM (stored apart
    from ``cpu``) were stored."""
    payload = body(device())
    mutate(payload)
    response = httpx.put(f"{server.url}/v1/configs", json=payload, headers=server.auth)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    said = detail if isinstance(detail, str) else "; ".join(  # a ResultError's, or pydantic's
        f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in detail)
    assert message in said, said
    assert httpx.get(f"{server.url}/v1/configs", params={"device_kind": "\ufeffcpu"}).json()[
        "total"] == 0


@pytest.mark.parametrize("change, message", [
    ({"speedup": 0.0}, "speedup must be a finite number above 0, got 0.0"),
    ({"time_ms": 0}, "median_ms (a table entry's time_ms) must be a finite number above 0, "
                     "got 0"),
    ({"provenance": {"roofline_fraction": 1e9}}, "roofline_fraction must be above 0 and at "
                                                 "most 1"),
], ids=["speedup-0", "time-0", "roofline-1e9"])
def test_an_import_of_a_measurement_no_tune_makes_writes_nothing(
        server: Server, change: dict[str, Any], message: str) -> None:
    kind = device()
    response = httpx.post(f"{server.url}/v1/tables", headers=server.auth,
                          json=_table(kind, {**TABLE_ENTRY, **change}))
    assert response.status_code == 422, response.text
    assert f"flash entry 0 (b1 h8/8 q256 kv256 d128 bfloat16 full fwd): {message}" in \
        response.json()["detail"]
    assert httpx.get(f"{server.url}/v1/configs", params={"device_kind": kind}).json()[
        "total"] == 0


def test_the_cli_import_refuses_a_device_kind_with_a_bom_as_the_service_does(
        sqlite_db_url: str, tmp_path) -> None:
    path = tmp_path / "table.json"
    path.write_text(json.dumps(_table("\ufeffcpu", TABLE_ENTRY)))
    done = run_cli("import", str(path), "--db", sqlite_db_url, env={"COLUMNS": "250"})
    assert done.returncode == 2, done.stderr
    assert "device_kind must be printable text" in done.stderr and "U+FEFF" in done.stderr
    with Store(sqlite_db_url) as store:
        assert store.list(limit=None)[1] == 0


def test_every_operation_has_its_own_id() -> None:
    """Issue 75 item 8: /healthz and /readyz answer GET and HEAD from one route each, which
    gave both methods one OpenAPI operation id (FastAPI warned: "Duplicate Operation ID")."""
    import warnings

    from api.main import create_app

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the duplicate's warning fails the test
        schema = create_app().openapi()
    ids = [operation["operationId"] for path in schema["paths"].values()
           for operation in path.values()]
    assert len(ids) == len(set(ids)), ids
    assert {"get", "head"} <= schema["paths"]["/healthz"].keys()
