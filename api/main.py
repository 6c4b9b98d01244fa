"""The application factory: ``create_app(settings)`` wires settings, store, metrics, routers
and error handlers. ``uvicorn --factory api.main:create_app`` reads settings from the env."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from api.cache import CACHED_PATHS, LookupCache, LookupCacheMiddleware
from api.metrics import Metrics, MetricsMiddleware
from api.routers import choices, configs, health, pages, serving, tables
from api.settings import ApiSettings
from kernel import AutotuneError
from storage import DatabaseFullError, Store, WriteRefusedError

log = logging.getLogger(__package__)

MAX_REPORTED_ERRORS = 20  # validation errors listed in one 422; the rest are counted


def _error(status_code: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status_code)


def create_app(settings: ApiSettings | None = None) -> FastAPI:
    """A new app with its own store (engine pool), lookup cache and metrics registry."""
    settings = settings or ApiSettings()
    store = Store(settings.db_url, pool_size=settings.db_pool_size)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Everything imported so far lives as long as the process: moving it out of the
        # collector's reach keeps full collections (seen as p99 spikes) short.
        gc.freeze()
        yield
        store.close()

    app = FastAPI(title="flash-autotune", version="1",
                  summary="Tuned flash-attention block sizes per shape and chip.",
                  lifespan=lifespan)
    app.state.settings = settings
    app.state.store = store
    app.state.metrics = Metrics()
    for router in (configs.router, serving.router, choices.router, tables.router, health.router,
                   pages.router):
        app.include_router(router)

    @app.exception_handler(AutotuneError)
    async def _invalid(_request: Request, error: AutotuneError) -> JSONResponse:
        # The project's own validation (one error root): the message names the field or rule.
        return _error(status.HTTP_422_UNPROCESSABLE_CONTENT, str(error))

    @app.exception_handler(RequestValidationError)
    async def _malformed(_request: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes each error's input: the whole object for each of its
        # missing fields, so a 4 MiB body came back as 31 MB. Where and why is enough.
        errors = error.errors()
        detail = [{"type": e["type"], "loc": list(e["loc"]), "msg": e["msg"]}
                  for e in errors[:MAX_REPORTED_ERRORS]]
        if len(errors) > MAX_REPORTED_ERRORS:
            detail.append({"type": "more_errors", "loc": [],
                           "msg": f"{len(errors) - MAX_REPORTED_ERRORS} more errors"})
        return JSONResponse({"detail": detail},
                            status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)

    @app.exception_handler(WriteRefusedError)
    async def _write_refused(_request: Request, error: WriteRefusedError) -> JSONResponse:
        # Read-only or full: reads still work, the message says what to do.
        return _error(status.HTTP_507_INSUFFICIENT_STORAGE if isinstance(error, DatabaseFullError)
                      else status.HTTP_503_SERVICE_UNAVAILABLE, str(error))

    @app.exception_handler(SQLAlchemyError)
    async def _database(request: Request, error: SQLAlchemyError) -> JSONResponse:
        log.error("database error on %s %s: %s", request.method, request.url.path, error)
        return _error(status.HTTP_503_SERVICE_UNAVAILABLE,
                      "the database is unavailable or its schema is not current; see /readyz")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        # Last resort: every expected failure has its own 4xx/503 above.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error(status.HTTP_500_INTERNAL_SERVER_ERROR,
                      "internal error; the server log has the details")

    app.state.cache = LookupCache(store, settings.lookup_cache_size)
    lookup_routes = {r.path: r for router in (configs.router, serving.router)
                     for r in router.routes if r.path in CACHED_PATHS}
    assert sorted(lookup_routes) == sorted(CACHED_PATHS), "every cached path is routed"
    app.add_middleware(LookupCacheMiddleware, cache=app.state.cache, metrics=app.state.metrics,
                       routes=lookup_routes)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)  # outermost: sees all
    return app
