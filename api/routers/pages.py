"""Server-rendered HTML pages (read-only): ``GET /`` lists the tuned configs, filterable by
device kind, kernel and dtype; ``GET /configs/detail?<key>`` shows one with the plots of its
tuning study (the same templates and plots as ``autotune report``).

Plots are drawn on demand and cached per study and database version (SQLite's
``data_version``; where there is none, as on PostgreSQL, they are drawn every time). Bad
parameters get an HTML page with status 422 naming them, an unknown key a 404, a database
failure a 503; not in the OpenAPI schema (these are pages, not API operations).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlencode

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ValidationError
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from api.deps import StoreDep
from api.schemas import Dtype, ProblemFields, QueryModel, Text, Version
from kernel import AutotuneError
from kernel.problem import DTYPES
from storage import ConfigKey, Store
from storage.models import TunedConfigRow
from storage.results import KEY_TEXT_FIELDS
from storage.unreadable import skipped_note

router = APIRouter(include_in_schema=False)
log = logging.getLogger(__name__)

LIST_LIMIT = 500
PLOT_CACHE_SIZE = 64  # studies whose plots are kept per worker
# matplotlib's font and text caches are shared by all figures and not documented as
# thread-safe, so request threads draw one at a time (drawing holds the GIL anyway).
_DRAWING = threading.Lock()


class Filters(BaseModel):
    """The list page's filters; the form sends an empty value for "any"."""

    device_kind: Text | None = None
    kernel: Text | None = None
    dtype: Dtype | None = None


class DetailKey(ProblemFields, QueryModel):
    """The full key of a stored config, as the list page links it (query parameters)."""

    model_config = QueryModel.model_config

    kernel: Text
    kernel_version: Version
    device_kind: Text
    platform: Text


class PlotCache:
    """Rendered plots per (study, database version); bounded, least recently used out."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[tuple[str, int], dict[str, str]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int]) -> dict[str, str] | None:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
            return self._items.get(key)

    def put(self, key: tuple[str, int], images: dict[str, str]) -> None:
        with self._lock:
            self._items[key] = images
            while len(self._items) > self.size:
                self._items.popitem(last=False)


def _page(request: Request, template: str, status_code: int = 200, **context: Any
          ) -> HTMLResponse:
    env = getattr(request.app.state, "page_templates", None)
    if env is None:  # matplotlib and the templates load with the first page
        from present.views import template_env

        env = request.app.state.page_templates = template_env()
    return HTMLResponse(env.get_template(template).render(**context), status_code=status_code)


def _invalid(request: Request, title: str, error: ValidationError, hint: str) -> HTMLResponse:
    return _error(request, 422, title, *(f"{'.'.join(map(str, e['loc'])) or 'query'}: "
                                         f"{e['msg']}" for e in error.errors()), hint)


def _error(request: Request, status_code: int, title: str, *messages: str) -> HTMLResponse:
    return _page(request, "error.html", status_code, status=status_code, title=title,
                 messages=messages)


def _distinct(store: Store, column: Any) -> list[str]:
    with store.engine.connect() as connection:
        return list(connection.scalars(select(column).distinct().order_by(column)))


def _html_errors(page: Callable[[Request, Store], HTMLResponse]
                 ) -> Callable[[Request, Store], Awaitable[HTMLResponse]]:
    """``page``, built in a thread of its own limiter (``AUTOTUNE_MAX_PAGE_RENDERS`` at once:
    the others wait without holding one of the pool's threads, which lookups need), with a
    database failure answered as an HTML page (the app's own handler answers JSON, which a
    browser shows raw)."""
    def built(request: Request, store: Store) -> HTMLResponse:
        try:
            return page(request, store)
        except SQLAlchemyError as error:
            log.error("database error on %s %s: %s", request.method, request.url.path, error)
            return _error(request, 503, "Database unavailable",
                          "The database is unavailable or its schema is not current; /readyz "
                          "says which, and `autotune db upgrade` brings a schema up to date.")

    @functools.wraps(page)
    async def answer(request: Request, store: StoreDep) -> HTMLResponse:
        return await anyio.to_thread.run_sync(built, request, store,
                                              limiter=_renders(request.app.state))

    return answer


def _renders(state: Any) -> anyio.CapacityLimiter:
    """The app's limiter of pages built at once (made in the event loop, on first use)."""
    if getattr(state, "page_renders", None) is None:
        state.page_renders = anyio.CapacityLimiter(state.settings.max_page_renders)
    return state.page_renders


def detail_link(key: ConfigKey) -> str:
    fields = [(name, getattr(key, name)) for name in KEY_TEXT_FIELDS]
    return "/configs/detail?" + urlencode([*fields, *key.problem.query_params()])


@router.api_route("/", methods=["GET", "HEAD"], response_class=HTMLResponse)
@_html_errors
def index(request: Request, store: StoreDep) -> HTMLResponse:
    """The tuned configs, filtered by the form's ``device_kind``, ``kernel`` and ``dtype``
    (an empty value means any)."""
    try:
        filters = Filters.model_validate(
            {k: v for k, v in request.query_params.items() if v}).model_dump(exclude_none=True)
    except ValidationError as error:
        return _invalid(request, "Invalid filter", error,
                        "Pick the values from the form's lists, or leave them empty for any.")
    entries, total = store.list(filters, limit=LIST_LIMIT)
    selects = [("device_kind", "device kind", _distinct(store, TunedConfigRow.device_kind)),
               ("kernel", "kernel", _distinct(store, TunedConfigRow.kernel)),
               ("dtype", "dtype", list(DTYPES))]
    return _page(request, "index.html", filters=filters, selects=selects, total=total,
                 entries=[(entry, detail_link(entry.result.key)) for entry in entries],
                 skipped=entries.skipped, skipped_note=skipped_note)


@router.get("/configs/detail", response_class=HTMLResponse)
@_html_errors
def detail(request: Request, store: StoreDep) -> HTMLResponse:
    """One stored config by its full key, with the plots of its tuning study."""
    try:
        query = request.query_params
        key = DetailKey.model_validate({name: query.getlist(name) if name == "window" else value
                                        for name, value in query.items()})
        problem = key.to_problem()
    except ValidationError as error:
        return _invalid(request, "Invalid config key", error,
                        "Open a config from the list of tuned configs.")
    except AutotuneError as error:  # a cross-field rule of the problem
        return _error(request, 422, "Invalid config key", str(error))
    entry = store.get(ConfigKey(key.kernel, key.kernel_version, key.device_kind, key.platform,
                                problem))
    if entry is None:
        return _error(request, 404, "No such tuned config",
                      f"Nothing is stored for {key.kernel} {key.kernel_version} on "
                      f"{key.device_kind!r} ({key.platform}) for {problem.label()}.")

    from present.plots import choice_image, images
    from present.views import problem_view
    from storage.studies import get_storage

    state = request.app.state
    cache: PlotCache = getattr(state, "plot_cache", None) or PlotCache(PLOT_CACHE_SIZE)
    state.plot_cache = cache
    # Kept once Optuna's tables exist (a tuner may create them after the server started).
    storage = getattr(state, "optuna_storage", None) or get_storage(store.url, create=False)
    state.optuna_storage = storage
    version = store.data_version()

    def cached(name: str, draw: Callable[[], dict[str, str]]) -> dict[str, str]:
        """``draw()`` through the cache, looked up again once the drawing lock is held: views
        that waited for it while another drew the same plots take that drawing."""
        drawn = None if version is None else cache.get((name, version))
        if drawn is None:
            with _DRAWING:
                drawn = None if version is None else cache.get((name, version))
                if drawn is None:
                    drawn = draw()
                    if version is not None:
                        cache.put((name, version), drawn)
        return drawn

    def render(study: Any) -> dict[str, str]:
        return cached(f"study:{study.name}:{study.winner_params}", lambda: images(study))

    def render_choice(choice: Any) -> dict[str, str]:
        return cached(f"choice:{key.device_kind}:{choice.problem.label()}",
                      lambda: choice_image(choice))

    found = store.lookup_choices([(key.device_kind, problem)])[0]
    view = problem_view(entry, storage, render=render,
                        choice=found[0] if found and found[1] == "exact" else None,
                        render_choice=render_choice)
    return _page(request, "detail.html", view=view)
