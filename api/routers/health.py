"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Response, status
from sqlalchemy.exc import SQLAlchemyError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE

from api.deps import MetricsDep, StoreDep

router = APIRouter(tags=["health"])


def get_and_head(path: str, **route: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers an endpoint for GET and for HEAD (the probe of many uptime checkers and load
    balancers; 405 before), each with its own OpenAPI operation id (one route of both methods
    gave both one id, and FastAPI warned of the duplicate)."""
    def register(endpoint: Callable[..., Any]) -> Callable[..., Any]:
        router.get(path, **route)(endpoint)
        operation_id = f"{endpoint.__name__}{path.replace('/', '_')}_head"
        router.head(path, operation_id=operation_id, **route)(endpoint)
        return endpoint

    return register


@get_and_head("/healthz")
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@get_and_head("/readyz", responses={503: {
    "description": "Database unreachable or schema not current; detail says the fix."}})
def readyz(store: StoreDep) -> JSONResponse:
    """The database is reachable, its schema is current and (SQLite) its file is sound."""
    try:
        problem = store.readiness_problem()
    except SQLAlchemyError as error:
        problem = f"cannot read the database: {str(getattr(error, 'orig', error)).strip()}"
    if problem:
        return JSONResponse({"status": "unavailable", "detail": problem},
                            status_code=status.HTTP_503_SERVICE_UNAVAILABLE)
    return JSONResponse({"status": "ready"})


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE: {}}}})
def metrics(registry: MetricsDep) -> Response:
    """Prometheus text format."""
    return Response(registry.render(), media_type=CONTENT_TYPE)
