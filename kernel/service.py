"""The lookup service as the resolver sees it: one round trip per new problem, a deadline, a
reply size cap and a circuit breaker, so a slow, down or garbage-answering service never
fails a trace.

For a new (device kind, problem) the client asks, in one ``POST /v1/choices/lookup:batch``,
the kernel choices of both modes with the configs of the kernel that runs without a choice and
of the kernels each choice names (``configs``), and keeps every answer, misses included, for
the life of the process. A service older than ``configs`` refuses it: the client then asks
the config beside the choices (``GET /v1/configs/lookup``), at once, as that service expects.
An answer it could not get (a failure, or the breaker open) is asked again once the breaker
closes. No lock is held over the network: threads tracing different problems
wait for the service side by side.

Pure Python and the standard library only (http.client), so a model build needs only jax.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kernel.contract import TunableKernel
from kernel.problem import MODES, Problem
from kernel.registry import KERNELS
from kernel.serving import ServingProblem
from kernel.table import KernelChoice, read_provenance

MAX_REPLY_BYTES = 64 * 1024  # a lookup answer is well under 1 KiB, two choices a few KiB
CHOICES_PATH = "/v1/choices/lookup:batch"
# Where a config is looked up, by the kernel's problem type (TunableKernel.problem_type).
CONFIG_PATHS: dict[type, str] = {Problem: "/v1/configs/lookup",
                                 ServingProblem: "/v1/serving/configs/lookup"}


@dataclass(frozen=True)
class Answer:
    """One lookup's outcome: ``value`` (a parsed answer) or None with ``why``; ``retry_at``
    (``time.monotonic()``) is set when it could not be asked or answered, 0 otherwise."""

    value: Any = None
    why: str = ""
    retry_at: float = 0.0

    def settled(self) -> bool:
        return not self.retry_at or time.monotonic() < self.retry_at


@dataclass(frozen=True)
class ConfigAnswer:
    """A config the service holds for a problem: the config, its provenance, and the tuned
    problem it comes from (another one when the match is nearest)."""

    config: Any
    provenance: Mapping[str, Any]
    match: str
    origin: Problem | None


def url_problem(url: str | None) -> str:
    """Why ``url`` cannot be the service's address ('' when it can)."""
    try:
        parts = urllib.parse.urlsplit(url or "")
        parts.port  # noqa: B018 - raises on a port out of range
    except ValueError as error:
        return f"lookup service URL is unusable: AUTOTUNE_URL={url!r}: {error}"
    if re.search(r"[\x00-\x20\x7f]", url or ""):  # http.client refuses it mid-trace
        return (f"lookup service URL is unusable: AUTOTUNE_URL={url!r} holds a space or a "
                "control character; percent-encode it or remove it")
    if parts.scheme not in ("http", "https") or not parts.hostname:  # "host:8000"
        return (f"lookup service URL is unusable: AUTOTUNE_URL={url!r} is not an http:// or "
                "https:// URL with a host; set it to e.g. http://tuner:8000")
    return ""


class ServiceClient:
    """The answers of one lookup service, asked once per key (see the module docstring)."""

    def __init__(self, url: str | None, timeout_s: float, breaker_s: float) -> None:
        self.url, self.timeout_s, self.breaker_s = url, timeout_s, breaker_s
        self.unusable = url_problem(url) if url else "AUTOTUNE_URL unset"
        self._lock = threading.Lock()  # guards the dicts and the breaker, never held over I/O
        self._answers: dict[tuple[Any, ...], Answer] = {}
        self._asking: dict[tuple[Any, ...], threading.Event] = {}
        self._breaker_open_until = 0.0
        self._breaker_cause = ""
        self.requests = 0  # HTTP requests sent, for tests and diagnostics
        self.answers_configs = True  # False once the service refused ``configs`` (older)

    def choice(self, device_kind: str, problem: Problem,
               kernel: TunableKernel | None = None) -> Answer:
        """The service's kernel choice for ``problem`` (and its mode); asking it also asks,
        in the same round trip, the other mode's choice and ``kernel``'s config."""
        key = ("choice", device_kind, problem)
        return self._answer(key, lambda: self._ask_problem(device_kind, problem, kernel))

    def config(self, device_kind: str, problem: Any, kernel: TunableKernel) -> Answer:
        """The service's :class:`ConfigAnswer` of ``kernel`` for ``problem`` (of its problem
        type)."""
        key = ("config", kernel.name, kernel.version, device_kind, problem)
        return self._answer(key, lambda: self._ask_config(device_kind, problem, kernel))

    def _answer(self, key: tuple[Any, ...], ask: Callable[[], None]) -> Answer:
        """The kept answer of ``key``; else ``ask()`` stores it (and maybe others), while
        another thread wanting ``key`` waits for that one, not for the service twice."""
        while True:
            with self._lock:
                answer = self._answers.get(key)
                if answer is not None and answer.settled():
                    return answer
                asking = self._asking.get(key)
                if asking is None:
                    if self.unusable:
                        return Answer(why=self.unusable)
                    if time.monotonic() < self._breaker_open_until:
                        return Answer(why="lookup service failed recently (circuit breaker "
                                      f"open after: {self._breaker_cause})",
                                      retry_at=self._breaker_open_until)
                    asking = self._asking[key] = threading.Event()
                    break
            asking.wait()  # another thread is asking for this key: its answer is ours
        try:
            ask()
        finally:
            with self._lock:
                del self._asking[key]
            asking.set()
        with self._lock:
            return self._answers.get(key) or Answer(why="lookup service was not asked")

    def _ask_problem(self, device_kind: str, problem: Problem,
                     kernel: TunableKernel | None) -> None:
        """Both modes' choices, and the configs of ``kernel`` (when it has fields to tune) and
        of the kernels they name, in one request (two at once for an older service)."""
        modes = [problem.mode, *(m for m in MODES if m != problem.mode)]
        problems = [dataclasses.replace(problem, mode=mode) for mode in modes]
        keys = [{"device_kind": device_kind, **p.to_dict()} for p in problems]
        tuned = kernel if kernel is not None and kernel.space_params(problem) else None
        if self.answers_configs:
            reply = self._send("POST", CHOICES_PATH, {"keys": keys, "configs": dict(
                kernel=tuned and tuned.name,
                versions={k.name: k.version for k in KERNELS.values()})})
            status, body, _ = reply.finish()
            if not (status == 422 and b'"configs"' in body):
                self._keep_choices(reply, device_kind, problems)
                return
            self.answers_configs = False  # a service older than ``configs``
        choices = self._send("POST", CHOICES_PATH, {"keys": keys})
        config = (self._send("GET", CONFIG_PATHS[Problem],
                             _config_params(device_kind, problem, tuned))
                  if tuned is not None else None)
        self._keep_choices(choices, device_kind, problems)
        if config is not None:
            self._keep(("config", tuned.name, tuned.version, device_kind, problem),
                       self._config_answer(config, tuned))

    def _keep_choices(self, reply: _Reply, device_kind: str, problems: list[Problem]) -> None:
        """Keeps the batch reply's choice of each of ``problems``, and the configs it holds."""
        results, failure = self._receive(reply, "lookup service has no kernel choice",
                                         lambda body: body["results"])
        for index, choice_problem in enumerate(problems):
            self._keep(("choice", device_kind, choice_problem),
                       _choice_answer(results, index, failure))
            for name, item in _configs_of(results, index).items():
                kernel = KERNELS[name]
                self._keep(("config", name, kernel.version, device_kind, choice_problem),
                           _parsed_config(item, kernel))

    def _ask_config(self, device_kind: str, problem: Any, kernel: TunableKernel) -> None:
        reply = self._send("GET", CONFIG_PATHS[kernel.problem_type],
                           _config_params(device_kind, problem, kernel))
        self._keep(("config", kernel.name, kernel.version, device_kind, problem),
                   self._config_answer(reply, kernel))

    def _config_answer(self, reply: _Reply, kernel: TunableKernel) -> Answer:
        value, failure = self._receive(reply, "lookup service has no config for this key",
                                       lambda body: _config_of(body, kernel))
        return Answer(value) if value is not None else failure

    def _keep(self, key: tuple[Any, ...], answer: Answer) -> None:
        with self._lock:
            self._answers[key] = answer

    def _send(self, method: str, path: str,
              payload: Mapping[str, Any] | list[tuple[str, Any]]) -> _Reply:
        with self._lock:
            self.requests += 1
        if method == "GET":
            return _Reply.start(f"{self.url.rstrip('/')}{path}?"
                                f"{urllib.parse.urlencode(payload)}", None, self.timeout_s)
        return _Reply.start(f"{self.url.rstrip('/')}{path}", json.dumps(payload).encode(),
                            self.timeout_s)

    def _receive(self, reply: _Reply, miss: str,
                 parse: Callable[[Any], Any]) -> tuple[Any, Answer]:
        """``(parsed, _)`` of a 200; else ``(None, why)``: a 404 is ``miss``, a reply over the
        size cap that key's miss alone, and any other failure opens the breaker."""
        status, body, failure = reply.finish()
        if status == 404:
            return None, Answer(why=miss)
        if failure is None and status != 200:
            failure = f"lookup service answered HTTP {status}"
        if failure is None:
            try:
                return parse(json.loads(body)), Answer()
            except Exception as error:  # noqa: BLE001 - any garbage answer falls back
                failure = f"lookup service sent a bad answer: {type(error).__name__}: {error}"
        if failure.startswith(TOO_LARGE):
            return None, Answer(why=failure)
        with self._lock:
            self._breaker_open_until = time.monotonic() + self.breaker_s
            self._breaker_cause = failure
            return None, Answer(why=failure, retry_at=self._breaker_open_until)


def _config_of(body: Any, kernel: TunableKernel) -> ConfigAnswer:
    """A found config's JSON body as a :class:`ConfigAnswer` of ``kernel``."""
    key = body.get("key")
    fields = [field.name for field in dataclasses.fields(kernel.problem_type)]
    origin = (kernel.problem_type.from_dict({name: key[name] for name in fields if name in key})
              if isinstance(key, dict) else None)
    return ConfigAnswer(kernel.config_from_dict(body["config"]), read_provenance(body),
                        body.get("match"), origin)


def _parsed_config(item: Any, kernel: TunableKernel) -> Answer:
    """A batch item (``BatchLookupItem``) as a config :class:`Answer`: a bad one is that key's
    miss."""
    try:
        if not item.get("found"):
            return Answer(why=item.get("detail") or "lookup service has no config for this key")
        return Answer(_config_of(item, kernel))
    except Exception as error:  # noqa: BLE001 - a bad item is that key's miss
        return Answer(why=f"lookup service sent a bad config: {type(error).__name__}: {error}")


def _configs_of(results: Any, index: int) -> dict[str, Any]:
    """The configs the ``index``-th batch result holds, by registered kernel ({} if none or
    malformed: those configs are asked on their own when needed)."""
    try:
        configs = results[index].get("configs") or {}
        return {name: item for name, item in configs.items() if name in KERNELS}
    except Exception:  # noqa: BLE001 - a bad item answers no config
        return {}


def _choice_answer(results: Any, index: int, failure: Answer) -> Answer:
    """The batch reply's ``index``-th result as an :class:`Answer` of a choice."""
    if results is None:
        return failure
    try:
        result = results[index]
        if not result.get("found"):
            return Answer(why=result.get("detail") or "lookup service has no kernel choice")
        return Answer((KernelChoice.from_dict(result), result.get("match")))
    except Exception as error:  # noqa: BLE001 - a bad item is that key's miss
        return Answer(why=f"lookup service sent a bad choice: {type(error).__name__}: {error}")


def _config_params(device_kind: str, problem: Any,
                   kernel: TunableKernel) -> list[tuple[str, Any]]:
    """The query of a config lookup (:data:`CONFIG_PATHS`; the problem's ``query_params``)."""
    return [*dict(kernel=kernel.name, kernel_version=kernel.version,
                  device_kind=device_kind).items(), *problem.query_params()]


TOO_LARGE = "lookup service reply is larger than"


@dataclass
class _Reply:
    """One HTTP request in flight on its own thread, under one deadline for the whole
    exchange (connect, headers and body) and at most :data:`MAX_REPLY_BYTES` of body."""

    connection: http.client.HTTPConnection | None
    deadline: float
    worker: threading.Thread | None = None
    sock: socket.socket | None = None
    result: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def start(cls, url: str, body: bytes | None, deadline_s: float) -> _Reply:
        parts = urllib.parse.urlsplit(url)
        connection_type = (http.client.HTTPSConnection if parts.scheme == "https"
                           else http.client.HTTPConnection)
        reply = cls(connection_type(parts.hostname, parts.port, timeout=deadline_s),
                    time.monotonic() + deadline_s)
        target = f"{parts.path}?{parts.query}" if parts.query else parts.path
        reply.worker = threading.Thread(target=reply._exchange, args=(target, body),
                                        name="autotune-lookup", daemon=True)
        reply.worker.start()
        return reply

    def _exchange(self, target: str, body: bytes | None) -> None:
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            self.connection.request("POST" if body is not None else "GET", target, body,
                                    headers)
            # The response reads from it after the connection lets go of it (Connection: close)
            self.sock = self.connection.sock
            response = self.connection.getresponse()
            data = response.read(MAX_REPLY_BYTES + 1)
            if len(data) > MAX_REPLY_BYTES:
                raise _TooLarge(f"{TOO_LARGE} {MAX_REPLY_BYTES} bytes")
            self.result["reply"] = (response.status, data)
        except BaseException as error:  # noqa: BLE001 - reported, never raised
            self.result["error"] = error

    def finish(self) -> tuple[int | None, bytes, str | None]:
        """``(status, body, failure)``, ``failure`` None when a reply arrived; the same on every
        call (a second one once read the body the deadline had cut short). Never raises."""
        if "outcome" not in self.result:
            self.result["outcome"] = self._outcome()
        return self.result["outcome"]

    def _outcome(self) -> tuple[int | None, bytes, str | None]:
        self.worker.join(max(0.0, self.deadline - time.monotonic()))
        if self.worker.is_alive():  # past the deadline: cut the socket so the worker ends too
            if self.sock is not None:
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.connection.close()
            return None, b"", (f"lookup service did not answer within "
                               f"{self.connection.timeout * 1000:.0f} ms")
        self.connection.close()
        if "error" in self.result:
            error = self.result["error"]
            if isinstance(error, _TooLarge):
                return None, b"", str(error)
            return None, b"", f"lookup service failed: {type(error).__name__}: {error}"
        status, body = self.result["reply"]
        return status, body, None


class _TooLarge(Exception):
    """A reply over :data:`MAX_REPLY_BYTES`: that key's miss, not a service failure."""
