"""``/v1/serving/configs``: look up the tuned configs of a serving kernel (ragged paged
attention), keyed by a serving problem (``kernel.serving.ServingProblem``; docs/serving.md).
They are published by importing a table (``POST /v1/tables``) and exported as one
(``GET /v1/tables/{device_kind}?kernel=...``)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response

from api.deps import CacheDep, MetricsDep, StoreDep, batch_requests
from api.routers.configs import cached_lookup, lookup_item
from api.schemas import (
    SERVING_NEAREST_FAMILY,
    ErrorResponse,
    ServingBatchLookupRequest,
    ServingBatchLookupResponse,
    ServingLookupQuery,
    ServingLookupResponse,
)
from api.strict_json import StrictJsonRoute
from storage import LookupRequest

router = APIRouter(prefix="/v1/serving/configs", tags=["serving"], route_class=StrictJsonRoute)


def serving_miss_detail(request: LookupRequest) -> str:
    return (f"no tuned config for kernel {request.kernel!r} on {request.device_kind!r} fits "
            f"{request.problem.label()} (no exact entry, and no entry {SERVING_NEAREST_FAMILY} "
            "whose config is legal for it); tune it, or import a table")


@router.get("/lookup", response_model=ServingLookupResponse,
            responses={404: {"model": ErrorResponse}, 422: {"model": ErrorResponse}})
def lookup(key: Annotated[ServingLookupQuery, Query()], request: Request, store: StoreDep,
           metrics: MetricsDep, cache: CacheDep) -> Response:
    """The config tuned for exactly this serving key, else the nearest tuned problem's of its
    family whose config is legal for this one (on the device kind's chip, where it is a known
    one: its VMEM too)."""
    return cached_lookup(request, key.to_request(), store, metrics, cache, serving_miss_detail)


@router.post("/lookup:batch", response_model=ServingBatchLookupResponse,
             responses={422: {"model": ErrorResponse}})
def lookup_batch(body: ServingBatchLookupRequest, store: StoreDep,
                 metrics: MetricsDep) -> dict[str, Any]:
    """Many serving lookups in one request; one result per key, in order, misses included."""
    requests = batch_requests(body.keys, lambda key: key.to_request())
    return {"results": [lookup_item(request, found, metrics, serving_miss_detail)
                        for request, found in zip(requests, store.lookup_many(requests),
                                                  strict=True)]}
