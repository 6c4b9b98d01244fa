"""Config resolution at trace time: explicit > pinned table > lookup service > default.

Pure Python and the standard library only (urllib), so a model build that embeds a table needs
nothing but jax. Every answer, misses included, is cached per key for the life of the process;
the service gets a short timeout and a circuit breaker, so a slow, down or garbage-answering
service never fails a trace, it only falls back (with one warning per key saying why).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from typing import Any

from kernel.config import ConfigError
from kernel.problem import Problem
from kernel.space import Target
from kernel.table import LookupTable

log = logging.getLogger(__name__)

KERNEL_NAME = "flash"
SOURCES = ("explicit", "table", "service", "default")


@dataclass(frozen=True)
class Resolution:
    """Which config a key resolved to, from which source, and why (for fallbacks)."""

    config: Any  # the kernel's config type
    source: str  # one of SOURCES
    detail: str = ""


@dataclass(frozen=True)
class ResolverSettings:
    """Read from the environment: ``AUTOTUNE_TABLE``, ``AUTOTUNE_URL``,
    ``AUTOTUNE_TIMEOUT_MS`` (default 250), ``AUTOTUNE_BREAKER_S`` (default 30) and
    ``AUTOTUNE_TPU_KERNEL`` (the registered kernel ``flash_attention`` runs on a TPU; default
    ours, ``flash``)."""

    table_paths: tuple[str, ...] = ()
    url: str | None = None
    timeout_s: float = 0.25
    breaker_s: float = 30.0
    tpu_kernel: str = KERNEL_NAME

    @classmethod
    def from_env(cls) -> ResolverSettings:
        tables = os.environ.get("AUTOTUNE_TABLE", "")
        return cls(
            table_paths=tuple(p for p in tables.split(os.pathsep) if p),
            url=os.environ.get("AUTOTUNE_URL") or None,
            timeout_s=float(os.environ.get("AUTOTUNE_TIMEOUT_MS", "250")) / 1000,
            breaker_s=float(os.environ.get("AUTOTUNE_BREAKER_S", "30")),
            tpu_kernel=os.environ.get("AUTOTUNE_TPU_KERNEL") or KERNEL_NAME,
        )


class Resolver:
    """Resolves and caches configs per (kernel, device kind, problem)."""

    def __init__(self, settings: ResolverSettings | None = None) -> None:
        self.settings = settings or ResolverSettings.from_env()
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str, Problem], Resolution] = {}
        self._tables: list[LookupTable] = []
        self._breaker_open_until = 0.0
        self.service_requests = 0  # HTTP requests sent, for tests and diagnostics
        for path in self.settings.table_paths:
            self.use_table(path)

    def use_table(self, path: str | Path) -> None:
        """Pins a lookup table (of any registered kernel); it wins over the service for its
        kernel and device kind. Raises TableError if malformed."""
        table = LookupTable.load(path)
        with self._lock:
            self._tables.append(table)
            self._cache.clear()

    def resolve(self, problem: Problem, device_kind: str, kernel_name: str = KERNEL_NAME,
                target: Target | None = None) -> Resolution:
        """The config of ``kernel_name`` for ``problem`` on ``device_kind``; ``target`` (the
        rules' target of the device) picks the default, else it is looked up by device kind."""
        key = (kernel_name, device_kind, problem)
        cached = self._cache.get(key)  # dict reads are atomic: the hot path takes no lock
        if cached is not None:
            return cached
        with self._lock:
            if key not in self._cache:
                self._cache[key] = self._resolve_uncached(problem, device_kind, kernel_name,
                                                          target)
            return self._cache[key]

    def sources(self) -> dict[tuple[str, str, Problem], str]:
        """The source each key seen so far was resolved from."""
        return {key: resolution.source for key, resolution in self._cache.items()}

    def _resolve_uncached(self, problem: Problem, device_kind: str, kernel_name: str,
                          target: Target | None) -> Resolution:
        from kernel.registry import device_target, get_kernel  # the registry imports us

        kernel = get_kernel(kernel_name)
        reasons = []
        for table in self._tables:
            if (table.kernel, table.device_kind) != (kernel_name, device_kind):
                continue
            found = table.lookup(problem)
            if found:
                entry, match = found
                return Resolution(entry.config, "table", f"{match} match in pinned table")
        if self._tables:
            reasons.append(f"no pinned table entry for {kernel_name} on {device_kind!r}")
        if self.settings.url:
            config, why = self._ask_service(problem, device_kind, kernel)
            if config is not None:
                return Resolution(config, "service", why)
            reasons.append(why)
        else:
            reasons.append("no table pinned and AUTOTUNE_URL unset")
        target = target or device_target("", device_kind)  # a TPU generation, else cpu
        config = kernel.default_config(problem, target)
        detail = "; ".join(reasons)
        log.warning("flash-autotune: using the default %s config %s for %s on %s (%s)",
                    kernel_name, config.label(), problem.label(), device_kind, detail)
        return Resolution(config, "default", detail)

    def _ask_service(self, problem: Problem, device_kind: str, kernel: Any) -> tuple[Any, str]:
        now = time.monotonic()
        if now < self._breaker_open_until:
            return None, "lookup service failed recently (circuit breaker open)"
        query = urllib.parse.urlencode({"kernel": kernel.name, "device_kind": device_kind,
                                        **{k: str(v).lower() if isinstance(v, bool) else v
                                           for k, v in problem.to_dict().items()}})
        url = f"{self.settings.url.rstrip('/')}/v1/configs/lookup?{query}"
        self.service_requests += 1
        try:
            with urllib.request.urlopen(url, timeout=self.settings.timeout_s) as response:
                body = json.loads(response.read())
            config = kernel.config_from_dict(body["config"])
            return config, f"{body.get('match')} match from service"
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None, "lookup service has no config for this key"
            reason = f"lookup service answered HTTP {error.code}"
        except (OSError, ValueError, KeyError, TypeError, ConfigError) as error:
            reason = f"lookup service failed: {type(error).__name__}: {error}"
        self._breaker_open_until = time.monotonic() + self.settings.breaker_s
        return None, reason


_default_resolver: Resolver | None = None
_default_lock = threading.Lock()


def get_resolver() -> Resolver:
    """The process-wide resolver, created from the environment on first use."""
    global _default_resolver
    if _default_resolver is None:
        with _default_lock:
            if _default_resolver is None:
                _default_resolver = Resolver()
    return _default_resolver


def reset_resolver(settings: ResolverSettings | None = None) -> Resolver:
    """Replaces the process-wide resolver (fresh cache), e.g. after changing the environment."""
    global _default_resolver
    with _default_lock:
        _default_resolver = Resolver(settings)
    return _default_resolver


def use_table(path: str | Path) -> None:
    """Pins a lookup table for this process (same as ``AUTOTUNE_TABLE=path``)."""
    get_resolver().use_table(path)


def resolution_sources() -> dict[tuple[str, str, Problem], str]:
    """Which source each key traced so far in this process was resolved from."""
    return get_resolver().sources()
