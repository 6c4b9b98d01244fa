"""Schema fuzzing: schemathesis generates requests, valid and invalid, for every operation of
the service's OpenAPI schema and sends them, authenticated, over HTTP to a real ``autotune
serve`` on its own database; no request may get a server error (5xx). Bounded to 25 examples
per operation and mode.

(The schema is taken from ``api.create_app().openapi()`` at collection, the same document the
server serves, because schemathesis' lazy pytest fixture loader does not support pytest 9.)
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from api import ApiSettings, create_app
from conftest import Server, run_cli

SCHEMA = schemathesis.openapi.from_dict(create_app(ApiSettings(db_url="sqlite://")).openapi())
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]


@pytest.fixture(scope="module")
def fuzz_server(start_server, tmp_path_factory) -> Server:
    url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'autotune.db'}"
    assert run_cli("db", "upgrade", "--db", url).returncode == 0
    return start_server(url)


def test_the_served_schema_is_the_fuzzed_one(fuzz_server: Server) -> None:
    import httpx

    served = httpx.get(f"{fuzz_server.url}/openapi.json").json()
    assert set(served["paths"]) == {operation.path for operation in OPERATIONS}


def _inputs(operation: Any) -> int:
    return sum(len(part) for part in (operation.path_parameters, operation.query,
                                      operation.headers, operation.body))


# Negative cases only where there is an input to break (healthz & co. take none).
CASES = [pytest.param(operation, mode, id=f"{operation.label} {mode}")
         for operation in OPERATIONS for mode in GenerationMode
         if mode == GenerationMode.POSITIVE or _inputs(operation)]


@pytest.mark.parametrize("operation, mode", CASES)
def test_no_request_gets_a_server_error(operation: Any, mode: GenerationMode,
                                        fuzz_server: Server) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=25, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        case.call_and_validate(base_url=fuzz_server.url, headers=fuzz_server.auth,
                               checks=[not_a_server_error], timeout=30)

    check()
