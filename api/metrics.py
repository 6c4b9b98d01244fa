"""Prometheus metrics in a per-app registry (several apps in one process do not clash)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

# Request methods counted by name; any other (clients may send any token) counts as "other".
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """Request counts and latency per route, lookups by match kind, and lookup cache hits."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("autotune_http_requests", "HTTP requests handled.",
                                ("method", "route", "status"), registry=self.registry)
        self.latency = Histogram("autotune_http_request_duration_seconds",
                                 "Time to handle an HTTP request.", ("method", "route"),
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.lookups = Counter("autotune_lookups", "Config lookups by match kind "
                               "(exact, nearest, miss).", ("match",), registry=self.registry)
        for match in ("exact", "nearest", "miss"):
            self.lookups.labels(match)  # export zeros, so a rate is defined from the start
        self.cache_hits = Counter("autotune_lookup_cache_hits", "GET lookups answered from "
                                  "the response cache (api.cache), by route.", ("route",),
                                  registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Pure ASGI middleware (no per-request task like BaseHTTPMiddleware): counts every HTTP
    request by its route template ("unmatched" for any path no route serves) and its method
    ("other" for unknown ones), so no request can grow the label set."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_with_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            method = scope["method"] if scope["method"] in HTTP_METHODS else "other"
            self.metrics.requests.labels(method, route, str(status)).inc()
            self.metrics.latency.labels(method, route).observe(time.perf_counter() - start)
