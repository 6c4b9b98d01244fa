"""Request dependencies: the store, the metrics and the write guard; batch keys."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from typing import Annotated, TypeVar

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.cache import LookupCache
from api.metrics import Metrics
from api.settings import ApiSettings
from kernel import AutotuneError
from storage import Store

_Request = TypeVar("_Request")

_bearer = HTTPBearer(auto_error=False, description="AUTOTUNE_API_TOKEN of the server")


# Dependencies are ``async def`` although they do not await: FastAPI runs a plain ``def``
# dependency in the threadpool, one thread hop each, which dominated the lookup latency.


async def get_store(request: Request) -> Store:
    return request.app.state.store


async def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


async def get_settings(request: Request) -> ApiSettings:
    return request.app.state.settings


async def get_cache(request: Request) -> LookupCache:
    return request.app.state.cache


async def require_writer(
    settings: Annotated[ApiSettings, Depends(get_settings)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Writes need ``Authorization: Bearer <AUTOTUNE_API_TOKEN>``; without a configured token
    they are refused unless the server was started with ``--allow-anonymous-writes`` (a set
    token always wins: ``autotune serve`` refuses the two together)."""
    if settings.api_token is None:
        if settings.allow_anonymous_writes:
            return
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            "writes are disabled: this server has no API token; set "
                            "AUTOTUNE_API_TOKEN before `autotune serve` (and send it as a bearer "
                            "token), or start it with --allow-anonymous-writes")
    challenge = {"WWW-Authenticate": "Bearer"}
    if credentials is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED,
                            "writes need the header `Authorization: Bearer <AUTOTUNE_API_TOKEN>`",
                            headers=challenge)
    # Header values arrive decoded as latin-1: their bytes, against the token's UTF-8 bytes.
    expected = settings.api_token.get_secret_value().encode()
    if not secrets.compare_digest(credentials.credentials.encode("latin-1"), expected):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED,
                            "the bearer token does not match this server's AUTOTUNE_API_TOKEN",
                            headers=challenge)


async def check_writer(request: Request) -> None:
    """``require_writer`` of ``request`` outside FastAPI's dependencies: a write's token is
    checked before its body is read (FastAPI reads the body first)."""
    await require_writer(request.app.state.settings, await _bearer(request))


StoreDep = Annotated[Store, Depends(get_store)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
CacheDep = Annotated[LookupCache, Depends(get_cache)]
Writer = Depends(require_writer)


def batch_requests(keys: Iterable[object], to_request: Callable[[object], _Request]
                   ) -> list[_Request]:
    """A batch's keys as storage requests; a key that breaks a cross-field rule (grouped-query
    heads, ...) is a 422 naming its index, before anything is looked up."""
    requests = []
    for index, key in enumerate(keys):
        try:
            requests.append(to_request(key))
        except AutotuneError as error:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                                f"keys[{index}]: {error}") from None
    return requests
