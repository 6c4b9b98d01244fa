"""Resolution at trace time: which backend runs for a problem, and with which config.

The whole order lives here. The backend (:meth:`Resolver.pick`, per problem and mode): a
pinned TPU kernel (``AUTOTUNE_TPU_KERNEL``) wins; else the kernel choice for the problem
(pinned table > lookup service), falling back to the choice's next best candidate that can run
here, then ``xla``; without a choice, the platform's backend; either, where it cannot run the
problem, ``xla``. The config (:meth:`Resolver.resolve`): the choice's config for its kernel
(tuned for the installed version), then pinned table (an exact entry of any, else the nearest
across them) > lookup service (:mod:`kernel.service`) > the backend's default, each checked
against the backend's rules for the device before it is used (the one legality fallback). An
explicit config never reaches the resolver: the wrapper checks it and raises.

Every answer, misses and fallbacks included, is cached per key for the life of the process,
and the first fallback per key logs one warning giving the root cause; only an answer the
service could not give (it failed, or its circuit breaker was open) is asked again once the
breaker closes: by the next trace that needs it, and, in the process-wide resolver, by a timer
at that moment, so that a shape traced while the service was down (its jitted function never
traced again) gets the service's answer: once one is answered, JAX's traces are keyed anew and
each function resolves again on its next call. A key is resolved once even when many threads
trace it, and no lock is held over the network, so threads tracing different problems do not
wait on each other.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernel.contract import TunableKernel
from kernel.errors import ConfigError, StrictMiss, TableError
from kernel.problem import MODES, Problem
from kernel.registry import DEFAULT_KERNEL, KERNELS, registered_kernel
from kernel.rules import x64_enabled
from kernel.sharded import checked_vma
from kernel.service import Answer, ServiceClient
from kernel.table import KernelChoice, LookupTable, ProblemIndex, legal_on
from kernel.table_scope import retrace_all
from kernel.targets import GPU_PLATFORMS, Target

log = logging.getLogger(__name__)

SOURCES = ("table", "service", "default")
# Strict builds: off, every config from a pinned table's exact entry, or its nearest too.
STRICT_MODES = ("", "exact", "nearest")
# The longest settings taken from the environment; longer is a typo (and a deadline past
# threading.TIMEOUT_MAX would fail the trace).
MAX_TIMEOUT_MS = 60_000  # a trace waits at most a minute for the service
MAX_BREAKER_S = 86_400
VERSIONED_PACKAGES = ("jax", "jaxlib", "libtpu")
# Timing methods the tuner no longer uses (autotune.timing), each with why a time it took is
# stale: results timed by one are still legal, but were ranked by another figure.
RETIRED_TIMINGS = {"profile": "the named kernels only, not the whole step"}
SAFE_KERNEL = "xla"  # runs every problem on every platform: the last fallback of a choice
NO_TUNABLE_FIELDS = "no tunable fields"  # the detail of a kernel with one config (xla)
Key = tuple[str, str, Problem]  # (kernel, device kind, problem)


@dataclass(frozen=True)
class Resolution:
    """The config a key resolved to, from which source, and why (for fallbacks). ``stale``
    names the versions a table or service entry was tuned under when they differ from the
    installed ones, or its retired timing method (it is still used: legality is checked here,
    speed may have moved).
    ``match``: ``exact``, or ``nearest`` with ``origin`` the tuned problem it comes from."""

    config: Any  # the backend's config type
    source: str  # one of SOURCES
    detail: str = ""
    stale: str = ""
    kernel_by: str = ""  # why this backend ran, when a kernel choice picked it
    retry_at: float = 0.0  # time.monotonic() after which to resolve again; 0: never
    match: str = ""
    origin: Problem | None = None

    def describe(self, mode: str = "fwd_bwd", kernel: str = "") -> str:
        """Where the config of ``kernel`` came from and which it is (its fields ``mode``
        uses), with how a choice picked the kernel:
        ``table, exact, config q256 ...``, ``table (stale: jax 0.9.0 ...), nearest (from b1
        h8/8 q512 ...), config ...``, ``default, config ...; kernel: next best (...)``, or
        ``xla (no tunable config); kernel: chosen (...)`` for a kernel with one config."""
        if self.detail == NO_TUNABLE_FIELDS:
            described = f"{kernel} (no tunable config)".lstrip()
            return f"{described}; kernel: {self.kernel_by}" if self.kernel_by else described
        parts = [f"{self.source} (stale: {self.stale})" if self.stale else self.source]
        if self.match == "nearest" and self.origin is not None:
            parts.append(f"nearest (from {self.origin.label()})")
        elif self.match:
            parts.append(self.match)
        parts.append(f"config {self.config.label(mode)}")
        described = ", ".join(parts)
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
    request), ``AUTOTUNE_BREAKER_S`` (default 30), ``AUTOTUNE_TPU_KERNEL`` (the registered
    backend ``flash_attention`` runs on a TPU; default: the first registered TPU backend) and
    ``AUTOTUNE_STRICT`` (``1``: every config from a pinned table's exact entry, ``nearest``:
    or its nearest; the service is not asked and a miss fails the trace; default off)."""

    table_paths: tuple[str, ...] = ()
    url: str | None = None
    timeout_s: float = 0.25
    breaker_s: float = 30.0
    tpu_kernel: str | None = None
    strict: str = ""  # one of STRICT_MODES

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
            strict=_strict_mode(os.environ.get("AUTOTUNE_STRICT", "")),
        )


def _strict_mode(raw: str) -> str:
    """``AUTOTUNE_STRICT`` as one of ``STRICT_MODES``; a bad value logs one error and turns
    strict mode on (exact): a build that asked for it must not quietly run without."""
    value = {"1": "exact", "true": "exact", "0": "", "false": ""}.get(raw.lower(), raw.lower())
    if value in STRICT_MODES:
        return value
    log.error("flash-autotune: AUTOTUNE_STRICT=%r is not one of 1, nearest or 0; using 1 "
              "(every config from a pinned table's exact entry)", raw)
    return "exact"


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
    """Which recorded ``<package>_version`` differ from the installed ones, and a retired
    timing method (the version of the measurement itself, :data:`RETIRED_TIMINGS`), as
    ``jax 0.9.0 (installed 0.10.2)``; '' if none. A package not installed here (libtpu on a
    service host) cannot have moved."""
    moved = [f"{package} {provenance[f'{package}_version']} (installed {installed[package]})"
             for package in VERSIONED_PACKAGES
             if installed[package] is not None
             and provenance.get(f"{package}_version") not in (None, installed[package])]
    timing = provenance.get("timing")
    if timing in RETIRED_TIMINGS:
        moved.append(f"timing {timing} ({RETIRED_TIMINGS[timing]})")
    return ", ".join(moved)



class Resolver:
    """Resolves and caches backends and configs per (kernel, device kind, problem)."""

    def __init__(self, settings: ResolverSettings | None = None, *,
                 ask_again: bool = False) -> None:
        """``ask_again``: ask the service again, by a timer, for each answer it could not
        give once its breaker closes, and key JAX's traces anew when one is answered (the
        process-wide resolver, whose answers the wrapper's traces use)."""
        self.settings = settings or ResolverSettings.from_env()
        self._ask_again = ask_again
        self._unanswered: dict[tuple[int, Any], tuple[dict[Any, Any], Any, Callable[[], Any]]] = {}
        self._timer: threading.Timer | None = None
        self._asking_again = threading.local()  # set in the timer's thread: no second warning
        self.service = ServiceClient(self.settings.url, self.settings.timeout_s,
                                     self.settings.breaker_s)
        self._lock = threading.Lock()  # guards the dicts below, never held over I/O
        self._gates: dict[tuple[Any, ...], threading.Lock] = {}  # one per key being resolved
        self._cache: dict[Key, Resolution] = {}
        self._picks: dict[tuple[str, str, Problem, bool], KernelPick] = {}
        self._choice_configs: dict[Key, Resolution] = {}
        self._earlier: dict[Key, str] = {}  # sources resolved before the last pinning
        self._tables: dict[str, LookupTable] = {}  # by resolved path, in pinning order
        self._indexes: dict[tuple[str, ...], ProblemIndex] = {}
        self._kernels: dict[str, TunableKernel] = {}
        self._installed = installed_versions()
        self._strict_misses: list[str] = []
        for path in self.settings.table_paths:
            try:
                self.use_table(path)
            except TableError as error:  # the trace runs on the other sources
                log.error("flash-autotune: AUTOTUNE_TABLE: %s; resolving without it", error)

    @property
    def service_requests(self) -> int:
        """HTTP requests sent to the lookup service, for tests and diagnostics."""
        return self.service.requests

    def use_table(self, path: str | Path, strict: bool | str = False) -> None:
        """Pins a lookup table (of any registered backend); it wins over the service for its
        kernel and device kind. Pinning a path again replaces its table (the file changed).
        Raises ``TableError`` naming the file if it is malformed. ``strict`` (True or
        ``"nearest"``) turns strict mode on, as ``AUTOTUNE_STRICT``."""
        if strict not in (False, True, "nearest"):
            raise ValueError(f"strict must be True, False or 'nearest', got {strict!r}")
        self.pin(LookupTable.load(path), os.path.realpath(path))
        if strict:
            self.settings = dataclasses.replace(
                self.settings, strict="nearest" if strict == "nearest" else "exact")

    def pin(self, table: LookupTable, name: str) -> None:
        """Pins a loaded table under ``name`` (pinned again, the name's table is replaced):
        ``use_table``'s, or a ``kernel.tables`` block's (:mod:`kernel.scoped_resolver`)."""
        with self._lock:
            self._earlier.update(self._described())  # what was traced may still run
            self._tables[name] = table
            for cache in (self._cache, self._picks, self._choice_configs, self._indexes):
                cache.clear()

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
        """The registered backend ``name`` (of either problem type) after ``discover`` (once
        per process)."""
        if name not in self._kernels:
            self._kernels[name] = registered_kernel(name).discover()
        return self._kernels[name]

    def _once(self, cache: dict[Any, Any], key: Any, compute: Callable[[], Any]) -> Any:
        """``cache[key]`` while settled, else ``compute()`` stored there: by one thread per
        key at a time (the others wait for it), keys side by side."""
        cached = cache.get(key)  # dict reads are atomic: the hot path takes no lock
        if cached is not None and _settled(cached):
            return cached
        with self._lock:
            gate = self._gates.setdefault((id(cache), key), threading.Lock())
        with gate:
            cached = cache.get(key)
            if cached is None or not _settled(cached):
                cached = compute()
                with self._lock:
                    cache[key] = cached
            if cached.retry_at and self._ask_again:
                self._wait_for_service(cache, key, compute, cached.retry_at)
            return cached

    def _wait_for_service(self, cache: dict[Any, Any], key: Any, compute: Callable[[], Any],
                          retry_at: float) -> None:
        """Keeps ``key`` to ask again at ``retry_at`` (the breaker's close), by a timer."""
        with self._lock:
            self._unanswered[(id(cache), key)] = (cache, key, compute)
            if self._timer is None:
                self._timer = threading.Timer(max(0.0, retry_at - time.monotonic()) + 0.01,
                                              self._ask_service_again)
                self._timer.daemon = True
                self._timer.start()

    def _ask_service_again(self) -> None:
        """Resolves each unanswered key again (the timer's thread); when one is answered now,
        keys JAX's traces anew, so a function traced during the outage resolves it on its next
        call. The keys still unanswered wait for the next close of the breaker."""
        with self._lock:
            unanswered, self._unanswered, self._timer = self._unanswered, {}, None
        self._asking_again.active = True
        try:
            answered = [key for cache, key, compute in unanswered.values()
                        if not self._once(cache, key, compute).retry_at]
        finally:
            self._asking_again.active = False
        if answered:
            log.info("flash-autotune: the lookup service answered %d key(s) it could not "
                     "before; functions traced since resolve again on their next call",
                     len(answered))
            retrace_all()

    def close(self) -> None:
        """Stops asking the service again (a resolver replaced by another)."""
        with self._lock:
            timer, self._timer, self._ask_again = self._timer, None, False
        if timer is not None:
            timer.cancel()

    def pick(self, problem: Problem, device_kind: str, platform: str,
             target: Target) -> KernelPick:
        """The backend that runs ``problem`` (as called) on this device, when no explicit
        config pins it to the platform's: the module docstring gives the order."""
        # x64 and check_vma too: a kernel that refuses them (x64_violations, vma_violations)
        # must not stay picked for such calls
        key = (platform, device_kind, problem, x64_enabled(), checked_vma())
        return self._once(self._picks, key,
                          lambda: self._pick_uncached(problem, device_kind, platform, target))

    def _pick_uncached(self, problem: Problem, device_kind: str, platform: str,
                       target: Target) -> KernelPick:
        if platform == "tpu" and self.settings.tpu_kernel:
            return self._platform_pick(problem, platform, target)
        choice, source, why, retry_at = self._find_choice(problem, device_kind,
                                                          self.platform_kernel(platform))
        if choice is None:
            return dataclasses.replace(self._platform_pick(problem, platform, target),
                                       retry_at=retry_at)
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
                warn_next_best(name, problem, device_kind, choice.kernel, "; ".join(refused))
            if name == choice.kernel and self._current(choice):
                moded = dataclasses.replace(problem, mode=choice.problem.mode)
                match = "exact" if choice.problem == moded else "nearest"
                with self._lock:
                    self._choice_configs[(name, device_kind, moded)] = Resolution(
                        choice.config, source, why, stale, match=match, origin=choice.problem)
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

    def refusals(self, problem: Problem, target: Target) -> dict[str, str]:
        """The registered backends that cannot run ``problem`` where it is traced (on
        ``target``, inside ``jax.shard_map`` with ``check_vma``, under x64), each with why."""
        return {name: why for name in KERNELS if (why := self._cannot_run(name, problem, target))}

    def _cannot_run(self, name: str, problem: Problem, target: Target) -> str:
        """Why backend ``name`` cannot run ``problem`` on ``target`` ('' when it can): not in
        this build, no rules for this device (so it neither runs nor is interpreted here),
        or a problem its kernels refuse."""
        if name not in KERNELS:
            return f"kernel {name!r} is not in this build"
        try:
            self.kernel(name).check_runs(problem, target)
        except ConfigError as error:
            return str(error)
        return ""

    def _find_choice(self, problem: Problem, device_kind: str, platform_kernel: TunableKernel,
                     ) -> tuple[KernelChoice | None, str, str, float]:
        """The kernel choice for ``problem``: pinned tables, then the service; the called
        mode's first, then the other's (a model tuned for training traces its forward pass
        before it is differentiated). ``(choice, source, match, 0)``, or ``(None, '', why,
        retry_at)``. The service is asked the platform kernel's config in the same round
        trip, for when there is no choice."""
        modes = [problem.mode, *(mode for mode in MODES if mode != problem.mode)]
        reasons = []
        for mode in modes:
            moded = dataclasses.replace(problem, mode=mode)
            found = self._index(("choices", device_kind), lambda: [
                c for t in self._tables.values() if t.device_kind == device_kind
                for c in t.choices], lambda choice: choice.kernel).find(moded)
            if found is not None:
                return found[0], "table", f"{found[1]} choice in pinned table", 0.0
            reasons.append(f"no pinned kernel choice for {moded.label()} on {device_kind!r}")
        retry_at = 0.0
        for mode in modes if not self.settings.strict else ():  # a build never asks a server
            answer = self.service.choice(device_kind, dataclasses.replace(problem, mode=mode),
                                         platform_kernel)
            if answer.value is not None:
                choice, match = answer.value
                return choice, "service", f"{match} choice from service", 0.0
            reasons.append(answer.why)
            retry_at = max(retry_at, answer.retry_at)
        return None, "", "; ".join(reasons), retry_at

    def _index(self, key: tuple[str, ...], items: Callable[[], list[Any]],
               kernel_of: Callable[[Any], str]) -> ProblemIndex:
        """The index of the pinned tables' ``items()`` under ``key``, built once per pinning."""
        index = self._indexes.get(key)
        if index is None:
            with self._lock:
                index = self._indexes.get(key)
                if index is None:
                    index = self._indexes[key] = ProblemIndex(items(), kernel_of)
        return index

    def resolve(self, problem: Problem, device_kind: str, kernel_name: str,
                target: Target, kernel_by: str = "") -> Resolution:
        """The config of ``kernel_name`` for ``problem`` on a device of ``device_kind``, whose
        rules are ``target``'s (the module docstring gives the order). ``kernel_by``: how
        :meth:`pick` chose the kernel, for :meth:`sources`."""
        resolution = self._once(self._cache, (kernel_name, device_kind, problem), lambda: (
            dataclasses.replace(self._resolve_uncached(problem, device_kind,
                                                       self.kernel(kernel_name), target),
                                kernel_by=kernel_by)))
        if self.settings.strict and not self._strictly_answered(resolution):
            self._fail_strict(f"{kernel_name} {problem.label()} on {device_kind!r} "
                              f"({resolution.describe(problem.mode, kernel_name)})")
        return resolution

    def _strictly_answered(self, resolution: Resolution) -> bool:
        """Whether a strict build takes ``resolution``: from a pinned table, exact (or nearest
        under ``AUTOTUNE_STRICT=nearest``), or a kernel with nothing to tune."""
        return resolution.detail == NO_TUNABLE_FIELDS or resolution.source == "table" and (
            resolution.match == "exact" or self.settings.strict == "nearest")

    def _fail_strict(self, missed: str) -> None:
        """Raises :class:`StrictMiss` listing every miss of this process, ``missed`` last."""
        with self._lock:
            self._strict_misses = [*dict.fromkeys([*self._strict_misses, missed])]
            listed = "; ".join(self._strict_misses)
        exactly = "exactly" if self.settings.strict == "exact" else "exactly or nearest"
        raise StrictMiss(f"AUTOTUNE_STRICT: the pinned tables do not answer {exactly}: "
                         f"{listed}; tune these problems into the table (kernel.capture or "
                         "autotune.tune_model on the step, then autotune export) or unset "
                         "AUTOTUNE_STRICT")

    def sources(self) -> dict[Key, str]:
        """How each key seen so far was resolved (:meth:`Resolution.describe`); a key not
        resolved again since a table was pinned keeps its earlier source (a function traced
        before may still run it)."""
        with self._lock:  # another thread may be resolving a new key
            return {**self._earlier, **self._described()}

    def _described(self) -> dict[Key, str]:
        return {key: resolution.describe(key[2].mode, key[0])
                for key, resolution in list(self._cache.items())}

    def _resolve_uncached(self, problem: Problem, device_kind: str, kernel: TunableKernel,
                          target: Target) -> Resolution:
        """The resolution order of a config, in one place."""
        if not kernel.space_params(problem):  # xla: its one config, nothing to look up or warn
            return Resolution(kernel.default_config(problem, target), "default",
                              NO_TUNABLE_FIELDS)
        reasons, retry_at = [], 0.0
        chosen = self._choice_configs.get((kernel.name, device_kind, problem))
        candidates = [("choice", lambda: (chosen, ""))] if chosen is not None else []
        candidates += [("table", lambda: self._from_tables(problem, device_kind, kernel,
                                                           target))]
        if not self.settings.strict:  # a strict build never asks a server
            candidates += [("service", lambda: self._from_service(problem, device_kind, kernel))]
        for source, find in candidates:
            found, why = find()
            if isinstance(found, Answer):
                found, why, retry_at = found.value, found.why, max(retry_at, found.retry_at)
            if found is None:
                reasons.append(why)
                continue
            broken = kernel.violations(problem, found.config, target)
            if not broken:
                return found
            reasons.append(f"the {source}'s config {found.config.label(problem.mode)} is "
                           "illegal here: " + "; ".join(map(str, broken)))
        config = kernel.default_config(problem, target)
        detail = "; ".join(reasons)
        if not getattr(self._asking_again, "active", False):  # said when first traced
            log.warning("flash-autotune: using the default %s config %s for %s on %s (%s)",
                        kernel.name, config.label(problem.mode), problem.label(), device_kind,
                        detail)
        return Resolution(config, "default", detail, retry_at=retry_at)

    def _from_tables(self, problem: Problem, device_kind: str, kernel: TunableKernel,
                     target: Target) -> tuple[Resolution | None, str]:
        """An exact entry of any pinned table, else the nearest across them whose config is
        legal on ``target`` (the first table's on a tie; an entry illegal here, over the chip's
        VMEM say, gives way to the next nearest), among the tables of this kernel's installed
        version."""
        if not self._tables:
            return None, "no table pinned"
        tables = [t for pinned in self._tables.values() for t in pinned.kernel_tables()
                  if (t.kernel, t.device_kind) == (kernel.name, device_kind)]
        if tables and all(t.kernel_version != kernel.version for t in tables):
            return None, (f"the pinned tables of {kernel.name} on {device_kind!r} are of "
                          f"kernel version {tables[0].kernel_version!r}, but version "
                          f"{kernel.version!r} is installed, whose configs mean something "
                          "else; export a table tuned with this version")
        index = self._index(("entries", kernel.name, device_kind), lambda: [
            e for t in tables if t.kernel_version == kernel.version for e in t.entries],
            lambda entry: kernel.name)
        # None legal here: the nearest by the stored rules, which the caller refuses, naming
        # the rule (a miss "illegal here", not "no entry").
        found = index.find(problem, legal_on(kernel, problem, target)) or index.find(problem)
        if found is None:
            return None, f"no pinned table entry for {kernel.name} on {device_kind!r}"
        entry, match = found
        return Resolution(entry.config, "table", f"{match} match in pinned table",
                          stale_versions(entry.provenance, self._installed), match=match,
                          origin=entry.problem), ""

    def _from_service(self, problem: Problem, device_kind: str,
                      kernel: TunableKernel) -> tuple[Resolution | Answer | None, str]:
        answer = self.service.config(device_kind, problem, kernel)
        if answer.value is None:
            return answer, ""
        found = answer.value
        return Resolution(found.config, "service", f"{found.match} match from service",
                          stale_versions(found.provenance, self._installed), match=found.match,
                          origin=found.origin), ""


def warn_next_best(kernel: str, problem: Problem, device_kind: str, chosen: str,
                   why: str) -> None:
    """The one warning of a kernel choice whose chosen kernel cannot run where it is traced."""
    log.warning("flash-autotune: running %s for %s on %s instead of the chosen %s (%s)",
                kernel, problem.label(), device_kind, chosen, why)


def _settled(answer: Resolution | KernelPick) -> bool:
    """Whether a cached answer stands (it need not be asked again yet)."""
    return not answer.retry_at or time.monotonic() < answer.retry_at


_default_resolver: Resolver | None = None
_default_lock = threading.Lock()


def get_resolver() -> Resolver:
    """The process-wide resolver, created from the environment on first use."""
    global _default_resolver
    if _default_resolver is None:
        with _default_lock:
            if _default_resolver is None:
                _default_resolver = Resolver(ask_again=True)
    return _default_resolver


def reset_resolver(settings: ResolverSettings | None = None) -> Resolver:
    """Replaces the process-wide resolver (fresh cache), e.g. after changing the environment."""
    global _default_resolver
    with _default_lock:
        if _default_resolver is not None:
            _default_resolver.close()
        _default_resolver = Resolver(settings, ask_again=True)
    return _default_resolver


def use_table(path: str | Path, strict: bool | str = False) -> None:
    """Pins a lookup table for this process (same as ``AUTOTUNE_TABLE=path``); a function
    traced before is traced again on its next call, resolving from it. ``strict=True`` (or
    ``"nearest"``): a strict build from now on, as ``AUTOTUNE_STRICT=1`` (or ``nearest``):
    every attention call must resolve from the pinned tables, else its trace fails listing
    the problems they miss (docs/sharded-training.md)."""
    get_resolver().use_table(path, strict)
    retrace_all()


def resolution_sources() -> dict[Key, str]:
    """How each key traced so far in this process was resolved: the source (``table``,
    ``service`` or ``default``, marked ``(stale: ...)`` when tuned under other jax/jaxlib/libtpu
    versions or a retired timing method), ``exact`` or ``nearest (from <tuned problem>)``, the
    config that ran, and
    ``; kernel: ...`` when a kernel choice picked the key's kernel (which ran)."""
    return get_resolver().sources()
