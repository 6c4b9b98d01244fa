"""``/v1/configs``: look up, publish and list tuned configs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response, status
from fastapi.responses import JSONResponse

from api.cache import LookupCache
from api.deps import CacheDep, MetricsDep, StoreDep, Writer, batch_requests
from api.schemas import (
    NEAREST_FAMILY,
    BatchLookupRequest,
    BatchLookupResponse,
    ConfigPage,
    ErrorResponse,
    ListQuery,
    LookupQuery,
    LookupResponse,
    PublishRequest,
    PublishResponse,
    lookup_body,
)
from api.strict_json import StrictJsonRoute
from api.metrics import Metrics
from storage import Entry, LookupRequest, Store

router = APIRouter(prefix="/v1/configs", tags=["configs"],
                   route_class=StrictJsonRoute)


def config_miss_detail(request: LookupRequest) -> str:
    return (f"no tuned config for kernel {request.kernel!r} on {request.device_kind!r} fits "
            f"{request.problem.label()} (no exact entry, and no entry {NEAREST_FAMILY} whose "
            "config is legal for it); tune it with "
            "`autotune tune` or import a table")


@router.get("/lookup", response_model=LookupResponse,
            responses={404: {"model": ErrorResponse}, 422: {"model": ErrorResponse}})
def lookup(key: Annotated[LookupQuery, Query()], request: Request, store: StoreDep,
           metrics: MetricsDep, cache: CacheDep) -> Response:
    """The config tuned for exactly this key, else the nearest tuned problem's (same kernel,
    device kind, dtype, head_dim, causal, mode) whose config is legal for this shape."""
    return cached_lookup(request, key.to_request(), store, metrics, cache, config_miss_detail)


def cached_lookup(request: Request, lookup_request: LookupRequest, store: Store,
                  metrics: Metrics, cache: LookupCache,
                  miss_detail: Callable[[LookupRequest], str]) -> Response:
    """A GET lookup's answer (a 404 naming the key for a miss), counted in the metrics and
    kept in the response cache (``api.cache``) until the next write to the database."""
    version = cache.version()  # before reading, so a write during the read is not masked
    found = store.lookup_many([lookup_request])[0]
    if found is None:
        response = JSONResponse({"detail": miss_detail(lookup_request)},
                                status_code=status.HTTP_404_NOT_FOUND)
        match = "miss"
    else:
        entry, match = found
        response = JSONResponse(lookup_body(entry, match))
    metrics.lookups.labels(match).inc()
    cache.put(request.scope["path"], request.scope["query_string"], version,
              response.status_code, response.body, match)
    return response


@router.post("/lookup:batch", response_model=BatchLookupResponse,
             responses={422: {"model": ErrorResponse}})
def lookup_batch(body: BatchLookupRequest, store: StoreDep,
                 metrics: MetricsDep) -> dict[str, Any]:
    """Many lookups in one request; one result per key, in order, misses included."""
    requests = batch_requests(body.keys, lambda key: key.to_request())
    return {"results": [lookup_item(request, found, metrics) for request, found in
                        zip(requests, store.lookup_many(requests), strict=True)]}


def lookup_item(request: LookupRequest, found: tuple[Entry, str] | None, metrics: Metrics,
                miss_detail: Callable[[LookupRequest], str] = config_miss_detail,
                ) -> dict[str, Any]:
    """A batch result (``BatchLookupItem``) of one looked-up key, counted in the metrics."""
    metrics.lookups.labels(found[1] if found else "miss").inc()
    return ({"found": True, **lookup_body(*found)} if found else
            {"found": False, "detail": miss_detail(request)})


@router.put("", response_model=PublishResponse, dependencies=[Writer],
            responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse},
                       422: {"model": ErrorResponse}})
def publish(body: PublishRequest, store: StoreDep) -> dict[str, Any]:
    """Stores a tuned result unless the stored one is at least as fast (``force`` overrides);
    the loser is kept in the history table. The config must be legal for its problem."""
    outcome = store.publish(body.to_result(), force=body.force)
    previous = outcome.previous
    return {"status": outcome.status, "entry": outcome.entry.to_dict(),
            "previous": None if previous is None else {
                "key": previous.key.to_dict(), "config": previous.config.to_dict(),
                **previous.measurements()}}


@router.get("", response_model=ConfigPage, responses={422: {"model": ErrorResponse}})
def list_configs(query: Annotated[ListQuery, Query()], store: StoreDep) -> dict[str, Any]:
    """Stored entries matching every given filter, oldest first, a page at a time."""
    entries, total = store.list(query.filters(), offset=query.offset, limit=query.limit)
    return {"items": [entry.to_dict() for entry in entries], "total": total,
            "offset": query.offset, "limit": query.limit, "skipped": len(entries.skipped)}
