"""``/v1/choices``: which kernel runs a problem on a device kind, with the evidence."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, status
from fastapi.responses import JSONResponse

from api.deps import MetricsDep, StoreDep, batch_requests
from api.metrics import Metrics
from api.routers.configs import lookup_item
from api.schemas import (
    NEAREST_FAMILY,
    BatchChoiceRequest,
    BatchChoiceResponse,
    ChoiceListQuery,
    ChoicePage,
    ChoiceQuery,
    ChoiceResponse,
    ConfigsWanted,
    ErrorResponse,
)
from api.strict_json import StrictJsonRoute
from kernel import Problem
from kernel.registry import KERNELS
from storage import LookupRequest, Store, StoredChoice

router = APIRouter(prefix="/v1/choices", tags=["choices"], route_class=StrictJsonRoute)


def _miss_detail(device_kind: str, problem: Problem) -> str:
    return (f"no kernel choice on {device_kind!r} fits {problem.label()} (no exact one, and "
            f"none {NEAREST_FAMILY} whose config is legal for it); make one with "
            "`autotune tune --kernels ...` or import a table")


def _answer(stored: StoredChoice, match: str) -> dict[str, Any]:
    """A found choice: the chosen kernel and config, the match, every candidate's time."""
    body = stored.to_dict()
    return {"match": match, **{name: body[name] for name in (
        "kernel", "config", "times_ms", "candidates", "problem", "provenance")}}


@router.get("/lookup", response_model=ChoiceResponse,
            responses={404: {"model": ErrorResponse}, 422: {"model": ErrorResponse}})
def lookup(key: Annotated[ChoiceQuery, Query()], store: StoreDep) -> Any:
    """The kernel chosen for exactly this problem on this device kind, else the nearest
    problem's choice (same dtype, head_dim, causal, mode, window, softcap or none, segment ids
    or none) whose config is legal here."""
    device_kind, problem = key.to_choice_request()
    found = store.lookup_choices([(device_kind, problem)])[0]
    if found is None:
        return JSONResponse({"detail": _miss_detail(device_kind, problem)},
                            status_code=status.HTTP_404_NOT_FOUND)
    return _answer(*found)


@router.post("/lookup:batch", response_model=BatchChoiceResponse,
             responses={422: {"model": ErrorResponse}})
def lookup_batch(body: BatchChoiceRequest, store: StoreDep,
                 metrics: MetricsDep) -> dict[str, Any]:
    """Many choice lookups in one request; one result per key, in order, misses included.
    With ``configs``, each result also holds the configs asked (``ConfigsWanted``)."""
    requests = batch_requests(body.keys, lambda key: key.to_choice_request())
    choices = store.lookup_choices(requests)
    results = [{"found": True, **_answer(*found)} if found else
               {"found": False, "detail": _miss_detail(*request)}
               for request, found in zip(requests, choices, strict=True)]
    if body.configs is not None:
        for result, configs in zip(results, _configs(body.configs, requests, choices, store,
                                                     metrics), strict=True):
            result["configs"] = configs
    return {"results": results}


def _configs(wanted: ConfigsWanted, requests: list[tuple[str, Problem]],
             choices: list[tuple[StoredChoice, str] | None], store: Store,
             metrics: Metrics) -> list[dict[str, Any]]:
    """Per key, by kernel: the configs ``wanted`` asks (``_asked``), misses included."""
    asked = [_asked(wanted, *request, found)
             for request, found in zip(requests, choices, strict=True)]
    answers = iter(store.lookup_many([request for key in asked for request in key]))
    return [{request.kernel: lookup_item(request, next(answers), metrics) for request in key}
            for key in asked]


def _asked(wanted: ConfigsWanted, device_kind: str, problem: Problem,
           found: tuple[StoredChoice, str] | None) -> list[LookupRequest]:
    """The config lookups of one key: ``wanted.kernel`` and each kernel its choice names, at
    the asker's versions (a kernel it did not list, or that this build lacks, is left out)."""
    named = [*([wanted.kernel] if wanted.kernel else []),
             *(found[0].choice.ranked() if found else [])]
    return [LookupRequest(device_kind=device_kind, problem=problem, kernel=name,
                          kernel_version=wanted.versions[name])
            for name in dict.fromkeys(named) if name in wanted.versions and name in KERNELS]


@router.get("", response_model=ChoicePage, responses={422: {"model": ErrorResponse}})
def list_choices(query: Annotated[ChoiceListQuery, Query()], store: StoreDep) -> dict[str, Any]:
    """Stored kernel choices matching every given filter, oldest first, a page at a time."""
    choices, total = store.list_choices(query.filters(), offset=query.offset,
                                        limit=query.limit)
    return {"items": [stored.to_dict() for stored in choices], "total": total,
            "offset": query.offset, "limit": query.limit, "skipped": len(choices.skipped)}
