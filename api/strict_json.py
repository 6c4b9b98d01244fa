"""JSON request bodies as RFC 8259 defines them: ``NaN``, ``Infinity`` and lone UTF-16
surrogates (``"\\ud800"``), which Python's ``json`` accepts, are refused with a 422 naming the
field, before validation or storage see them (neither can encode them, and FastAPI's default
422 handler fails echoing them). A body past ``AUTOTUNE_MAX_BODY_BYTES`` (a write's) or
``AUTOTUNE_MAX_LOOKUP_BODY_BYTES`` (a lookup's) is a 413, unread; a body declared as another
media type, a 415."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response, status
from fastapi.routing import APIRoute

from api.deps import Writer, check_writer
from api.schemas import MAX_BATCH_KEYS


def _field(path: list[str | int]) -> str:
    return "body" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}"
                            for part in path)


_SURROGATE = re.compile("[\ud800-\udfff]")
_NOT_TEXT = "holds a lone UTF-16 surrogate, which is not text; send valid Unicode"


def json_problem(value: Any) -> str | None:
    """Why ``value`` (parsed JSON) is not portable JSON, naming the first bad field, or None.
    Iterative: nesting as deep as the parser allows cannot overflow the stack here."""
    pending: list[tuple[list[str | int], Any]] = [([], value)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return (f"{_field(path)}: {json.dumps(value)} is not a JSON number; send a finite "
                    "number (or null where the field is optional)")
        if isinstance(value, str) and _SURROGATE.search(value):
            return f"{_field(path)}: {json.dumps(value[:60])} {_NOT_TEXT}"
        items: Any = (value.items() if isinstance(value, dict)
                      else enumerate(value) if isinstance(value, list) else ())
        children = []
        for key, item in items:
            if isinstance(key, str) and _SURROGATE.search(key):
                return f"{_field(path)}: the key {json.dumps(key[:60])} {_NOT_TEXT}"
            children.append(([*path, key], item))
        pending.extend(reversed(children))  # first field first
    return None


def _is_json(media_type: str) -> bool:
    """``application/json`` or a JSON-based ``application/...+json`` (as FastAPI reads)."""
    kind, _, subtype = media_type.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


class StrictJsonRequest(Request):
    """A request whose body is refused with a 413 once it passes ``limit`` bytes (the setting
    ``limit_name``), before the rest is read: parsed JSON takes up to a hundred times the
    bytes of its text, and parsing holds the event loop."""

    def __init__(self, request: Request, limit: int, limit_name: str) -> None:
        super().__init__(request.scope, request.receive)
        self.limit, self.limit_name = limit, limit_name

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            too_large = HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                                      f"the request body is larger than {self.limit} bytes; "
                                      "send less (a table in parts, a batch of at most "
                                      f"{MAX_BATCH_KEYS} keys), or raise the server's "
                                      f"{self.limit_name}")
            declared = self.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.limit:
                raise too_large
            chunks, size = [], 0
            async for chunk in self.stream():  # a chunked body declares no length
                size += len(chunk)
                if size > self.limit:
                    raise too_large
                chunks.append(chunk)
            self._body = b"".join(chunks)
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            parsed = json.loads(await self.body())
            problem = json_problem(parsed)
            if problem:
                # An HTTPException passes FastAPI's body parsing unchanged (others become 400s).
                raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, problem)
            self._json = parsed
        return self._json


class StrictJsonRoute(APIRoute):
    """A route whose JSON body is parsed by ``StrictJsonRequest``. A write's token is checked
    before its body is read, and a lookup's body (no token) has a limit of its own."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        takes_body = self.body_field is not None
        writes = Writer in self.dependencies

        async def strict_handler(request: Request) -> Response:
            # FastAPI validates a body of another type as raw bytes ("Input should be a valid
            # dictionary"): curl's --data-binary sends application/x-www-form-urlencoded.
            # Without a Content-Type, the same (FastAPI reads no JSON then either).
            media = request.headers.get("content-type", "").split(";")[0].strip().lower()
            if takes_body and not _is_json(media):
                sent = f"as {media}" if media else "without a Content-Type"
                raise HTTPException(status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                                    f"the body is sent {sent}, not as JSON; send it with "
                                    "the header Content-Type: application/json")
            if writes:
                await check_writer(request)
            return await handler(_limited(request, writes))

        return strict_handler


def _limited(request: Request, writes: bool) -> StrictJsonRequest:
    """``request`` with the body limit of a write, or of a lookup (which needs no token)."""
    settings = request.app.state.settings
    if writes:
        return StrictJsonRequest(request, settings.max_body_bytes, "AUTOTUNE_MAX_BODY_BYTES")
    return StrictJsonRequest(request, settings.max_lookup_body_bytes,
                             "AUTOTUNE_MAX_LOOKUP_BODY_BYTES")
