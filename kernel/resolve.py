"""Resolution at trace time: which backend runs for a problem, and with which config.

The whole order lives here. The backend (:meth:`Resolver.pick`, per problem and mode): a
pinned TPU kernel (``AUTOTUNE_TPU_KERNEL``) wins; else the kernel choice for the problem
(pinned table > lookup service), falling back to the choice's next best candidate that can run
here, then ``xla``; without a choice, the platform's backend; either, where it cannot run the
problem, ``xla``. The config (:meth:`Resolver.resolve`): the choice's config for its kernel
(tuned for the installed version), then pinned table (an exact entry of any, else the nearest
across them) > lookup service > the backend's default, each
checked against the backend's rules for the device before it is used (the one legality
fallback). An explicit config never reaches the resolver: the wrapper checks it and raises.
Every answer, misses and fallbacks included, is cached per key for the life of the process,
and the first fallback per key logs one warning saying why; only an answer the service could
not give (it failed, or its circuit breaker was open) is asked again once the breaker closes.

Pure Python and the standard library only (http.client), so a model build that embeds a table
needs nothing but jax. The service gets a deadline for the whole request, a reply size cap and
a circuit breaker: a slow, down or garbage-answering service never fails a trace.
"""

from __future__ import annotations

import dataclasses
import http.client
import importlib.metadata
import json
import logging
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernel.contract import TunableKernel
from kernel.errors import ConfigError
from kernel.problem import MODES, Problem
from kernel.registry import DEFAULT_KERNEL, KERNELS, get_kernel
from kernel.rules import x64_enabled
from kernel.table import KernelChoice, LookupTable, find_choice, find_entry, read_provenance
from kernel.targets import GPU_PLATFORMS, Target

log = logging.getLogger(__name__)

SOURCES = ("table", "service", "default")
MAX_REPLY_BYTES = 64 * 1024  # a lookup answer is well under 1 KiB
# The longest settings taken from the environment; longer is a typo (and a deadline past
# threading.TIMEOUT_MAX would fail the trace).
MAX_TIMEOUT_MS = 60_000  # a trace waits at most a minute for the service
MAX_BREAKER_S = 86_400
VERSIONED_PACKAGES = ("jax", "jaxlib", "libtpu")
SAFE_KERNEL = "xla"  # runs every problem on every platform: the last fallback of a choice
Key = tuple[str, str, Problem]  # (kernel, device kind, problem)


@dataclass(frozen=True)
class Resolution:
    """The config a key resolved to, from which source, and why (for fallbacks). ``stale``
    names the versions a table or service entry was tuned under when they differ from the
    installed ones (it is still used: legality is checked here, speed may have moved)."""

    config: Any  # the backend's config type
    source: str  # one of SOURCES
    detail: str = ""
    stale: str = ""
    kernel_by: str = ""  # why this backend ran, when a kernel choice picked it
    retry_at: float = 0.0  # time.monotonic() after which to resolve again; 0: never

    def describe(self) -> str:
        """The source, marked when stale and with how a choice picked the kernel: ``table``,
        ``table (stale: jax 0.9.0 ...)``, ``default; kernel: next best ...``."""
        described = f"{self.source} (stale: {self.stale})" if self.stale else self.source
        return f"{described}; kernel: {self.kernel_by}" if self.kernel_by else described


@dataclass(frozen=True)
class KernelPick:
    """The backend that runs a problem, and why: ``by`` is empty for the platform's backend,
    ``fallback (...)`` for ``SAFE_KERNEL`` in its place, else ``chosen (...)`` or ``next best
    (...)`` naming where the choice came from."""

    kernel: TunableKernel
    by: str = ""
    choice: KernelChoice | None = None
    source: str = ""  # where the choice came from: table or service
    stale: str = ""
    retry_at: float = 0.0  # as Resolution's


def _env_number(name: str, default: float, most: float) -> float:
    """A number in (0, ``most``] from the environment; a bad value logs one error and keeps
    the default, so a typo never fails a trace."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
        if 0 < value <= most:
            return value
    except ValueError:
        pass
    log.error("flash-autotune: %s=%r is not a number above 0 and at most %g; using %g (set it "
              "to a number such as %g, or unset it)", name, raw, most, default, default)
    return default


@dataclass(frozen=True)
class ResolverSettings:
    """Read from the environment: ``AUTOTUNE_TABLE`` (paths joined by ``os.pathsep``),
    ``AUTOTUNE_URL``, ``AUTOTUNE_TIMEOUT_MS`` (default 250: the deadline of a whole service
    request), ``AUTOTUNE_BREAKER_S`` (default 30) and ``AUTOTUNE_TPU_KERNEL`` (the registered
    backend ``flash_attention`` runs on a TPU; default: the first registered TPU backend)."""

    table_paths: tuple[str, ...] = ()
    url: str | None = None
    timeout_s: float = 0.25
    breaker_s: float = 30.0
    tpu_kernel: str | None = None

    @classmethod
    def from_env(cls) -> ResolverSettings:
        tables = os.environ.get("AUTOTUNE_TABLE", "")
        tpu_kernel = os.environ.get("AUTOTUNE_TPU_KERNEL") or None
        tpu_kernels = [name for name, k in KERNELS.items() if "tpu" in k.platforms]
        if tpu_kernel is not None and tpu_kernel not in tpu_kernels:
            log.error("flash-autotune: AUTOTUNE_TPU_KERNEL=%r is not a registered TPU kernel "
                      "(%s); using the default", tpu_kernel, ", ".join(tpu_kernels))
            tpu_kernel = None
        return cls(
            table_paths=tuple(p for p in tables.split(os.pathsep) if p),
            url=os.environ.get("AUTOTUNE_URL") or None,
            timeout_s=_env_number("AUTOTUNE_TIMEOUT_MS", 250, MAX_TIMEOUT_MS) / 1000,
            breaker_s=_env_number("AUTOTUNE_BREAKER_S", 30, MAX_BREAKER_S),
            tpu_kernel=tpu_kernel,
        )


def installed_versions() -> dict[str, str | None]:
    """The installed versions of jax, jaxlib and libtpu (None where not installed)."""
    out: dict[str, str | None] = {}
    for package in VERSIONED_PACKAGES:
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def stale_versions(provenance: Mapping[str, Any], installed: Mapping[str, str | None]) -> str:
    """Which recorded ``<package>_version`` differ from the installed ones ('' if none); a
    package not installed here (libtpu on a service host) cannot have moved."""
    moved = [f"{package} {provenance[f'{package}_version']} (installed {installed[package]})"
             for package in VERSIONED_PACKAGES
             if installed[package] is not None
             and provenance.get(f"{package}_version") not in (None, installed[package])]
    return ", ".join(moved)


class Resolver:
    """Resolves and caches configs per (kernel, device kind, problem)."""

    def __init__(self, settings: ResolverSettings | None = None) -> None:
        self.settings = settings or ResolverSettings.from_env()
        self._lock = threading.Lock()
        self._cache: dict[Key, Resolution] = {}
        self._picks: dict[tuple[str, str, Problem, bool], KernelPick] = {}
        self._choice_configs: dict[Key, Resolution] = {}
        self._tables: list[LookupTable] = []
        self._kernels: dict[str, TunableKernel] = {}
        self._installed = installed_versions()
        self._breaker_open_until = 0.0
        self._unanswered = 0  # service lookups that failed or were skipped by the breaker
        self.service_requests = 0  # HTTP requests sent, for tests and diagnostics
        for path in self.settings.table_paths:
            self.use_table(path)

    def use_table(self, path: str | Path) -> None:
        """Pins a lookup table (of any registered backend); it wins over the service for its
        kernel and device kind. Raises ``TableError`` naming the file if it is malformed."""
        table = LookupTable.load(path)
        with self._lock:
            self._tables.append(table)
            self._cache.clear()
            self._picks.clear()
            self._choice_configs.clear()

    def platform_kernel(self, platform: str) -> TunableKernel:
        """The backend ``flash_attention`` runs on a JAX platform, with what the installed JAX
        tells it: ``AUTOTUNE_TPU_KERNEL`` on a TPU, else the first registered backend native
        to the platform; on a CPU the default one, interpreted (the CPU is the TPU kernel's
        correctness oracle)."""
        platform = "gpu" if platform in GPU_PLATFORMS else platform
        if platform == "tpu" and self.settings.tpu_kernel:
            name = self.settings.tpu_kernel
        elif platform == "cpu":
            name = DEFAULT_KERNEL
        else:
            name = next((k.name for k in KERNELS.values() if platform in k.platforms),
                        DEFAULT_KERNEL)
        return self.kernel(name)

    def kernel(self, name: str) -> TunableKernel:
        """The registered backend ``name`` after ``discover`` (once per process)."""
        if name not in self._kernels:
            self._kernels[name] = get_kernel(name).discover()
        return self._kernels[name]

    def pick(self, problem: Problem, device_kind: str, platform: str,
             target: Target) -> KernelPick:
        """The backend that runs ``problem`` (as called) on this device, when no explicit
        config pins it to the platform's: the module docstring gives the order."""
        # x64 too: a kernel that refuses it (x64_violations) must not stay picked for such calls
        key = (platform, device_kind, problem, x64_enabled())
        cached = self._picks.get(key)
        if cached is not None and _settled(cached):
            return cached
        with self._lock:
            cached = self._picks.get(key)
            if cached is None or not _settled(cached):
                unanswered = self._unanswered
                pick = self._pick_uncached(problem, device_kind, platform, target)
                self._picks[key] = dataclasses.replace(pick,
                                                       retry_at=self._retry_at(unanswered))
            return self._picks[key]

    def _pick_uncached(self, problem: Problem, device_kind: str, platform: str,
                       target: Target) -> KernelPick:
        if platform == "tpu" and self.settings.tpu_kernel:
            return self._platform_pick(problem, platform, target)
        choice, source, why = self._find_choice(problem, device_kind)
        if choice is None:
            return self._platform_pick(problem, platform, target)
        stale = stale_versions(choice.provenance, self._installed)
        refused = []
        for name in dict.fromkeys([*choice.ranked(), SAFE_KERNEL]):
            reason = self._cannot_run(name, problem, target)
            if reason:
                refused.append(reason)
                continue
            if name == choice.kernel:
                by = f"chosen ({why})"
            else:
                by = f"next best ({why}: " + "; ".join(refused) + ")"
                log.warning("flash-autotune: running %s for %s on %s instead of the chosen %s "
                            "(%s)", name, problem.label(), device_kind, choice.kernel,
                            "; ".join(refused))
            if name == choice.kernel and self._current(choice):
                self._choice_configs[(name, device_kind, dataclasses.replace(
                    problem, mode=choice.problem.mode))] = Resolution(choice.config, source,
                                                                      why, stale)
            return KernelPick(self.kernel(name), by, choice, source, stale)
        log.warning("flash-autotune: no candidate of the kernel choice for %s on %s can run "
                    "here (%s); using the platform's kernel", problem.label(), device_kind,
                    "; ".join(refused))
        return self._platform_pick(problem, platform, target)

    def _platform_pick(self, problem: Problem, platform: str, target: Target) -> KernelPick:
        """The platform's backend, or ``SAFE_KERNEL`` when that cannot run ``problem`` here
        (x64, a shape its kernels refuse, a pinned TPU kernel without this target)."""
        kernel = self.platform_kernel(platform)
        refused = self._cannot_run(kernel.name, problem, target)
        if not refused or self._cannot_run(SAFE_KERNEL, problem, target):
            return KernelPick(kernel)  # runnable, or nothing is: the wrapper names the rule
        log.warning("flash-autotune: running %s for %s instead of %s (%s)", SAFE_KERNEL,
                    problem.label(), kernel.name, refused)
        return KernelPick(self.kernel(SAFE_KERNEL), f"fallback ({refused})")

    def _current(self, choice: KernelChoice) -> bool:
        """Whether the choice's config was tuned for the installed version of its kernel
        (a version bump changes what a config means); unrecorded counts as current."""
        recorded = choice.provenance.get("kernel_version")
        return recorded is None or recorded == self.kernel(choice.kernel).version

    def _cannot_run(self, name: str, problem: Problem, target: Target) -> str:
        """Why backend ``name`` cannot run ``problem`` on ``target`` ('' when it can)."""
        if name not in KERNELS:
            return f"kernel {name!r} is not in this build"
        try:
            self.kernel(name).check_runs(problem, target)
        except ConfigError as error:
            return str(error)
        return ""

    def _find_choice(self, problem: Problem,
                     device_kind: str) -> tuple[KernelChoice | None, str, str]:
        """The kernel choice for ``problem``: pinned tables, then the service; the called
        mode's first, then the other's (a model tuned for training traces its forward pass
        before it is differentiated). ``(choice, source, match)``, or ``(None, '', why)``."""
        modes = [problem.mode, *(mode for mode in MODES if mode != problem.mode)]
        reasons = []
        for source, found in (("table", self._choice_from_tables),
                              ("service", self._choice_from_service)):
            for mode in modes:
                choice, why = found(dataclasses.replace(problem, mode=mode), device_kind)
                if choice is not None:
                    return choice, source, why
                reasons.append(why)
        return None, "", "; ".join(reasons)

    def _choice_from_tables(self, problem: Problem,
                            device_kind: str) -> tuple[KernelChoice | None, str]:
        """An exact choice of any pinned table, else the nearest across them."""
        found = find_choice(problem, [c for table in self._tables
                                      if table.device_kind == device_kind for c in table.choices])
        if found is None:
            return None, f"no pinned kernel choice for {problem.label()} on {device_kind!r}"
        return found[0], f"{found[1]} choice in pinned table"

    def _choice_from_service(self, problem: Problem,
                             device_kind: str) -> tuple[KernelChoice | None, str]:
        answer, why = self._ask_service(
            "/v1/choices/lookup", {"device_kind": device_kind, **_problem_params(problem)},
            "lookup service has no kernel choice for this key",
            lambda answer: (KernelChoice.from_dict(answer), answer.get("match")))
        if answer is None:
            return None, why
        return answer[0], f"{answer[1]} choice from service"

    def resolve(self, problem: Problem, device_kind: str, kernel_name: str,
                target: Target, kernel_by: str = "") -> Resolution:
        """The config of ``kernel_name`` for ``problem`` on a device of ``device_kind``, whose
        rules are ``target``'s: the first of the kernel choice's config (when the choice
        picked this kernel), the pinned tables, the service and the default that is legal
        there. ``kernel_by``: how :meth:`pick` chose the kernel, for :meth:`sources`."""
        key = (kernel_name, device_kind, problem)
        cached = self._cache.get(key)  # dict reads are atomic: the hot path takes no lock
        if cached is not None and _settled(cached):
            return cached
        with self._lock:
            cached = self._cache.get(key)
            if cached is None or not _settled(cached):
                unanswered = self._unanswered
                resolution = self._resolve_uncached(problem, device_kind,
                                                    self.kernel(kernel_name), target)
                self._cache[key] = dataclasses.replace(resolution, kernel_by=kernel_by,
                                                       retry_at=self._retry_at(unanswered))
            return self._cache[key]

    def _retry_at(self, unanswered: int) -> float:
        """When to resolve again an answer found with ``unanswered`` service failures
        before: once the breaker closes, if a lookup since failed or was skipped; else
        never (0)."""
        return self._breaker_open_until if self._unanswered != unanswered else 0.0

    def sources(self) -> dict[Key, str]:
        """How each key seen so far was resolved (:meth:`Resolution.describe`)."""
        with self._lock:  # another thread may be resolving a new key
            resolved = list(self._cache.items())
        return {key: resolution.describe() for key, resolution in resolved}

    def _resolve_uncached(self, problem: Problem, device_kind: str, kernel: TunableKernel,
                          target: Target) -> Resolution:
        if not kernel.space_params(problem):  # xla: its one config, nothing to look up or warn
            return Resolution(kernel.default_config(problem, target), "default",
                              "no tunable fields")
        reasons = []
        chosen = self._choice_configs.get((kernel.name, device_kind, problem))
        if chosen is not None:
            broken = kernel.violations(problem, chosen.config, target)
            if not broken:
                return chosen
            reasons.append(f"the kernel choice's config {chosen.config.label()} is illegal "
                           "here: " + "; ".join(map(str, broken)))
        for source, found in (("table", self._from_tables), ("service", self._from_service)):
            config, provenance, why = found(problem, device_kind, kernel)
            if config is None:
                reasons.append(why)
                continue
            broken = kernel.violations(problem, config, target)
            if broken:
                reasons.append(f"the {source}'s config {config.label()} is illegal here: "
                               + "; ".join(map(str, broken)))
                continue
            return Resolution(config, source, why, stale_versions(provenance, self._installed))
        config = kernel.default_config(problem, target)
        detail = "; ".join(reasons)
        log.warning("flash-autotune: using the default %s config %s for %s on %s (%s)",
                    kernel.name, config.label(), problem.label(), device_kind, detail)
        return Resolution(config, "default", detail)

    def _from_tables(self, problem: Problem, device_kind: str,
                     kernel: TunableKernel) -> tuple[Any, Mapping[str, Any], str]:
        """An exact entry of any pinned table, else the nearest across them (the first
        table's on a tie), among the tables of this kernel's installed version."""
        if not self._tables:
            return None, {}, "no table pinned"
        tables = [t for t in self._tables if (t.kernel, t.device_kind) == (kernel.name,
                                                                           device_kind)]
        current = [t for t in tables if t.kernel_version == kernel.version]
        if tables and not current:
            return None, {}, (f"the pinned tables of {kernel.name} on {device_kind!r} are of "
                              f"kernel version {tables[0].kernel_version!r}, but version "
                              f"{kernel.version!r} is installed, whose configs mean something "
                              "else; export a table tuned with this version")
        found = find_entry(problem, [e for table in current for e in table.entries], kernel.name)
        if found is None:
            return None, {}, f"no pinned table entry for {kernel.name} on {device_kind!r}"
        entry, match = found
        return entry.config, entry.provenance, f"{match} match in pinned table"

    def _from_service(self, problem: Problem, device_kind: str,
                      kernel: TunableKernel) -> tuple[Any, Mapping[str, Any], str]:
        answer, why = self._ask_service(
            "/v1/configs/lookup",
            dict(kernel=kernel.name, kernel_version=kernel.version, device_kind=device_kind,
                 **_problem_params(problem)),
            "lookup service has no config for this key",
            lambda answer: (kernel.config_from_dict(answer["config"]),
                            read_provenance(answer), answer.get("match")))
        if answer is None:
            return None, {}, why
        config, provenance, match = answer
        return config, provenance, f"{match} match from service"

    def _ask_service(self, path: str, params: Mapping[str, Any], miss: str,
                     parse: Any) -> tuple[Any, str]:
        """One GET of the service (one deadline), its JSON answer through ``parse``:
        ``(parsed, '')``, or ``(None, why)``. A 404 is ``miss``; any failure, a bad answer
        included, opens the circuit breaker."""
        if not self.settings.url:
            return None, "AUTOTUNE_URL unset"
        if time.monotonic() < self._breaker_open_until:
            self._unanswered += 1
            return None, "lookup service failed recently (circuit breaker open)"
        self.service_requests += 1
        status, body, failure = _get(f"{self.settings.url.rstrip('/')}{path}?"
                                     f"{urllib.parse.urlencode(params)}", self.settings.timeout_s)
        if status == 404:
            return None, miss
        if failure is None and status != 200:
            failure = f"lookup service answered HTTP {status}"
        if failure is None:
            try:
                return parse(json.loads(body)), ""
            except Exception as error:  # noqa: BLE001 - any garbage answer falls back
                failure = f"lookup service sent a bad answer: {type(error).__name__}: {error}"
        self._breaker_open_until = time.monotonic() + self.settings.breaker_s
        self._unanswered += 1
        return None, failure


def _settled(answer: Resolution | KernelPick) -> bool:
    """Whether a cached answer stands (it need not be asked again yet)."""
    return not answer.retry_at or time.monotonic() < answer.retry_at


def _problem_params(problem: Problem) -> dict[str, Any]:
    """The problem's fields as query parameters (booleans as ``true``/``false``)."""
    return {k: str(v).lower() if isinstance(v, bool) else v
            for k, v in problem.to_dict().items()}


def _get(url: str, deadline_s: float) -> tuple[int | None, bytes, str | None]:
    """GETs ``url`` with one deadline for the whole request (connect, headers and body) and
    at most :data:`MAX_REPLY_BYTES` of body: ``(status, body, failure)``, ``failure`` None
    when a reply arrived. Never raises: whatever goes wrong is the failure's text."""
    result: dict[str, Any] = {}
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:  # "host:8000"
            raise ValueError(f"{url.split('?')[0]!r} is not an http:// or https:// URL with "
                             "a host; set AUTOTUNE_URL to e.g. http://tuner:8000")
        connection_type = (http.client.HTTPSConnection if parts.scheme == "https"
                           else http.client.HTTPConnection)
        connection = connection_type(parts.hostname, parts.port, timeout=deadline_s)
    except Exception as error:  # noqa: BLE001 - a malformed AUTOTUNE_URL, a port out of range
        return None, b"", f"lookup service URL is unusable: {error}"

    def request() -> None:
        try:
            connection.request("GET", f"{parts.path}?{parts.query}")
            response = connection.getresponse()
            body = response.read(MAX_REPLY_BYTES + 1)
            if len(body) > MAX_REPLY_BYTES:
                raise ValueError(f"reply larger than {MAX_REPLY_BYTES} bytes")
            result["reply"] = (response.status, body)
        except BaseException as error:  # noqa: BLE001 - reported, never raised
            result["error"] = error

    worker = threading.Thread(target=request, name="autotune-lookup", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if worker.is_alive():  # past the deadline: cut the socket so the worker ends too
        if connection.sock is not None:
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        connection.close()
        return None, b"", f"lookup service did not answer within {deadline_s * 1000:.0f} ms"
    connection.close()
    if "error" in result:
        error = result["error"]
        return None, b"", f"lookup service failed: {type(error).__name__}: {error}"
    status, body = result["reply"]
    return status, body, None


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


def resolution_sources() -> dict[Key, str]:
    """How each key traced so far in this process was resolved: ``table``, ``service`` or
    ``default``, marked ``(stale: ...)`` when tuned under other jax/jaxlib/libtpu versions and
    followed by ``; kernel: ...`` when a kernel choice picked the key's kernel (which ran)."""
    return get_resolver().sources()
