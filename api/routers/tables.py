"""``/v1/tables``: export and import lookup tables (``kernel.table.LookupTable`` JSON)."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header, HTTPException, Path, Query, Response, status

from api.deps import StoreDep, Writer
from api.schemas import TEXT_PATTERN, ErrorResponse, ExportQuery, ImportQuery, ImportResponse
from api.strict_json import StrictJsonRoute
from kernel import LookupTable

router = APIRouter(prefix="/v1/tables", tags=["tables"], route_class=StrictJsonRoute)


@router.get("/{device_kind:path}", responses={  # a device kind may hold "/"
    200: {"description": "The lookup table (kernel.table.LookupTable JSON), with an ETag.",
          "content": {"application/json": {}}},
    304: {"description": "Unchanged since the ETag sent in If-None-Match."},
    404: {"model": ErrorResponse}})
def export_table(
    store: StoreDep,
    device_kind: Annotated[str, Path(max_length=128, pattern=TEXT_PATTERN)],
    query: Annotated[ExportQuery, Query()],
    if_none_match: Annotated[str | None, Header(max_length=1024)] = None,
) -> Response:
    """Every tuned config on ``device_kind`` (of ``kernel``, or of every kernel its choices
    name), and every kernel choice there, ready to pin in a model build."""
    table = store.export_table(device_kind, kernel=query.kernel,
                               kernel_version=query.kernel_version)
    if not table.entries and not table.choices:
        known = store.device_kinds(query.kernel)
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            f"no tuned configs of kernel {table.kernel!r} version "
                            f"{table.kernel_version!r} on device kind {device_kind!r}; "
                            f"device kinds with configs: {known}")
    body = json.dumps(table.to_dict(), sort_keys=True).encode()
    etag = f'"{hashlib.sha256(body).hexdigest()[:32]}"'
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if if_none_match is not None:
        tags = {tag.strip().removeprefix("W/") for tag in if_none_match.split(",")}
        if etag in tags or "*" in tags:
            return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=headers)
    return Response(body, media_type="application/json", headers=headers)


@router.post("", response_model=ImportResponse, dependencies=[Writer],
             responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse},
                        422: {"model": ErrorResponse}})
def import_table(
    store: StoreDep,
    table: Annotated[dict[str, Any], Body(description="A kernel.table.LookupTable as JSON.")],
    query: Annotated[ImportQuery, Query()],
) -> dict[str, Any]:
    """Imports a whole table in one transaction: all entries and choices or none (422 names
    the bad one). Each entry is published like ``PUT /v1/configs`` (keep-better unless
    ``force``); each kernel choice replaces the stored one for its problem."""
    parsed = LookupTable.from_dict(table)
    outcomes = store.import_table(parsed, force=query.force)
    counts = {"inserted": 0, "replaced": 0, "kept": 0}
    for outcome in outcomes:
        counts[outcome.status] += 1
    return {**counts, "choices": len(parsed.choices), "left_out": list(parsed.left_out)}
