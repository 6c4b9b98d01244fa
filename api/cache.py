"""A response cache for the GET lookups (``/v1/configs/lookup`` and
``/v1/serving/configs/lookup``), in front of FastAPI's parameter parsing.

Keyed by the path and the raw query string (a resolver sends the same bytes for the same key)
and tagged with ``Store.data_version()``: an answer is served only while no process has
committed to the database since it was computed, so a publish, an import or a tuner writing
directly to the database is visible on the next request. Where the database offers no such signal
(PostgreSQL), nothing is cached. Bounded: full means cleared, so odd query strings cannot grow
memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from api.metrics import Metrics
from storage import Store

LOOKUP_PATH = "/v1/configs/lookup"
SERVING_LOOKUP_PATH = "/v1/serving/configs/lookup"
CACHED_PATHS = (LOOKUP_PATH, SERVING_LOOKUP_PATH)  # the GET lookups answered from the cache


# A lookup's query string is about 150 bytes; a longer one (padded with ``&``, which the parser
# ignores) is answered but not cached, so the cache's memory stays bounded by its entry count.
MAX_CACHED_QUERY = 1024


class LookupCache:
    def __init__(self, store: Store, max_entries: int) -> None:
        self.store = store
        self.max_entries = max_entries
        # (path, query string) -> (data version, status, body, match label for the metrics)
        self._entries: dict[tuple[str, bytes], tuple[int, int, bytes, str]] = {}

    def version(self) -> int | None:
        """The version to tag an answer computed from now on with; None: do not cache."""
        return self.store.data_version() if self.max_entries else None

    def get(self, path: str, query: bytes) -> tuple[int, bytes, str] | None:
        entry = self._entries.get((path, query))
        if entry is None or entry[0] != self.version():
            return None
        return entry[1:]

    def put(self, path: str, query: bytes, version: int | None, status: int, body: bytes,
            match: str) -> None:
        """Caches the answer to ``path?query`` computed after ``version()`` returned
        ``version``."""
        if version is None or len(query) > MAX_CACHED_QUERY:
            return
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        self._entries[path, query] = (version, status, body, match)


class LookupCacheMiddleware:
    """Answers a cached lookup without routing, parsing or a database query."""

    def __init__(self, app: Any, cache: LookupCache, metrics: Metrics,
                 routes: Mapping[str, Any]) -> None:
        self.app = app
        self.cache = cache
        self.metrics = metrics
        # path -> its lookup APIRoute, so request metrics label a hit like a miss
        self.routes = dict(routes)
        for path in self.routes:
            metrics.cache_hits.labels(path)  # export zeros, so a rate is defined from the start

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if route is not None and scope["method"] == "GET":
            hit = self.cache.get(scope["path"], scope["query_string"])
            if hit is not None:
                status, body, match = hit
                scope["route"] = route
                self.metrics.lookups.labels(match).inc()
                self.metrics.cache_hits.labels(scope["path"]).inc()
                await send({"type": "http.response.start", "status": status, "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
