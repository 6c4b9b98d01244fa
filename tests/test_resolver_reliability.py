"""The resolver against misbehaving lookup services and broken pinned tables: whatever the
service sends (or does not send), a trace falls back to the default with one warning per key,
within the request deadline; a broken table is a ``TableError`` naming the file.

The services are real sockets on loopback, each answering with a fixed byte stream.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import pytest
from conftest import free_port, running_server

import kernel
from kernel import FlashConfig, LookupTable, Problem, TableError, get_target
from kernel.resolve import Resolver, ResolverSettings, reset_resolver
from kernel.service import CHOICES_PATH, _Reply
from storage import Store, TunedResult, upgrade

PROBLEM = Problem(batch=1, q_heads=2, kv_heads=2, q_len=256, kv_len=256, head_dim=64,
                  dtype="float32")
CPU = get_target("cpu")
OK_BODY = json.dumps({"config": FlashConfig(block_q=256).to_dict(), "match": "exact"}).encode()


def _http(body: bytes, status: str = "200 OK", headers: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{headers}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def _nested(depth: int) -> bytes:
    return b'{"config": ' + b"[" * depth + b"]" * depth + b"}"


# name -> what the server sends after reading the request (bytes, or a callable writing to it)
def _trickle(conn: socket.socket) -> None:
    for byte in _http(OK_BODY):
        conn.sendall(bytes([byte]))
        time.sleep(0.2)


def _truncated(conn: socket.socket) -> None:
    conn.sendall(_http(OK_BODY)[:-10])  # Content-Length promises more than arrives


MISBEHAVIOURS: dict[str, bytes | Callable[[socket.socket], None]] = {
    "truncated-body": _truncated,
    "not-http": b"SSH-2.0-OpenSSH_9.0\r\n",
    "long-header-line": b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 100_000 + b"\r\n\r\n{}",
    "too-many-headers": _http(OK_BODY, headers="".join(f"X-{i}: 1\r\n" for i in range(150))),
    "deeply-nested-json": _http(_nested(100_000)),
    "huge-reply": _http(b" " * 1_000_000 + OK_BODY),
    "garbage-json": _http(b"\xff\xfe not json"),
    "illegal-config": _http(json.dumps({"config": {"block_q": 96}, "match": "exact"}).encode()),
    "provenance-not-an-object": _http(json.dumps({"config": {}, "match": "exact",
                                                  "provenance": "tuned on v5e"}).encode()),
    "trickle": _trickle,
}


@pytest.fixture
def service() -> Iterator[Callable[[bytes | Callable[[socket.socket], None]], str]]:
    """Starts a loopback server sending a fixed reply to every connection; returns its URL."""
    sockets: list[socket.socket] = []

    def start(reply: bytes | Callable[[socket.socket], None]) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        sockets.append(listener)

        def serve() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    try:
                        conn.recv(65536)
                        reply(conn) if callable(reply) else conn.sendall(reply)
                    except OSError:
                        pass

        threading.Thread(target=serve, daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    yield start
    for listener in sockets:
        listener.close()


@pytest.mark.parametrize("name", MISBEHAVIOURS)
def test_any_service_failure_falls_back_within_the_deadline(name, service, caplog):
    resolver = Resolver(ResolverSettings(url=service(MISBEHAVIOURS[name]), timeout_s=0.5))
    caplog.set_level(logging.WARNING, logger="kernel.resolve")
    resolver.kernel("flash")  # the one-off discovery of the installed JAX, not the service
    start = time.monotonic()
    resolution = resolver.resolve(PROBLEM, "cpu", "flash", CPU)
    elapsed = time.monotonic() - start
    assert resolution.source == "default", resolution
    assert resolution.config == kernel.get_kernel("flash").default_config(PROBLEM)
    # 0.5 s (the deadline) on a quiet machine; a trace the trickle stalled would wait over a minute
    assert elapsed < 10, f"{name} stalled the trace for {elapsed:.1f} s"
    resolver.resolve(PROBLEM, "cpu", "flash", CPU)  # cached: no second warning, no request
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "default" in warnings[0].getMessage()
    assert resolver.service_requests == 1


def test_a_reply_trickled_past_the_deadline_stays_the_timeout(service):
    """Issue 75 item 11n: the headers on time, the body a byte at a time. The client reads a
    batch reply twice; the second read, once the worker had ended on the socket the deadline
    cut, was the truncated body, logged as a JSON decode error instead of the timeout."""
    def trickle_body(conn: socket.socket) -> None:
        reply = _http(b'{"results": []}' + b" " * 64)
        head = reply.index(b"\r\n\r\n") + 4
        conn.sendall(reply[:head])
        for byte in reply[head:]:
            conn.sendall(bytes([byte]))
            time.sleep(0.1)

    reply = _Reply.start(f"{service(trickle_body)}{CHOICES_PATH}", b"{}", 0.5)
    first = reply.finish()
    assert first[2] == "lookup service did not answer within 500 ms", first
    reply.worker.join(4)  # the cut ends it, long before the 8 s the body takes
    assert not reply.worker.is_alive()
    assert reply.finish() == first


def test_the_default_config_warning_names_only_the_fields_its_mode_uses(caplog):
    """A forward-only call's warning prints the forward tiles, not backward ones it never
    runs; a differentiated call's prints both."""
    resolver = Resolver(ResolverSettings())
    caplog.set_level(logging.WARNING, logger="kernel.resolve")
    for mode in ("fwd", "fwd_bwd"):
        resolver.resolve(dataclasses.replace(PROBLEM, mode=mode), "cpu", "flash", CPU)
    fwd, fwd_bwd = [r.getMessage() for r in caplog.records]
    assert "using the default flash config q" in fwd and "dkv" not in fwd and "dq" not in fwd
    assert "dkv" in fwd_bwd and "dq" in fwd_bwd


def test_an_xla_choice_is_described_as_having_no_tunable_config():
    """``resolution_sources()`` says xla has no config to tune, not that a default ran."""
    resolver = Resolver(ResolverSettings())
    resolver.resolve(PROBLEM, "cpu", "xla", CPU, "chosen (exact choice in pinned table)")
    assert resolver.sources() == {("xla", "cpu", PROBLEM): "xla (no tunable config); kernel: "
                                                           "chosen (exact choice in pinned table)"}


def test_a_kernel_without_tunable_fields_asks_nothing_and_warns_nothing(service, caplog):
    """xla has one config: resolving it asks no service and logs no "using the default"
    warning (noise on every new shape of a model whose table chose xla)."""
    resolver = Resolver(ResolverSettings(url=service(_http(OK_BODY)), timeout_s=2))
    caplog.set_level(logging.WARNING, logger="kernel.resolve")
    resolution = resolver.resolve(PROBLEM, "cpu", "xla", CPU)
    assert resolution.config == kernel.get_kernel("xla").default_config(PROBLEM)
    assert (resolution.source, resolution.detail) == ("default", "no tunable fields")
    assert resolver.service_requests == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_block_beyond_any_float_falls_back_on_a_tpu_target(service):
    """The VMEM estimate of a TPU target computes with the blocks: one past a float's range
    is refused as a bad answer before it gets there."""
    huge = b'{"config": {"block_q": 1' + b"0" * 310 + b'}, "match": "exact"}'
    resolver = Resolver(ResolverSettings(url=service(_http(huge)), timeout_s=2))
    resolution = resolver.resolve(PROBLEM, "TPU v5 lite", "flash", get_target("v5e"))
    assert resolution.source == "default" and "block_q must be from 1 to" in resolution.detail


@pytest.mark.parametrize("url", ["http://[::1:8000", "http://127.0.0.1:99999",
                                 "127.0.0.1:8000", "ftp://127.0.0.1:8000", "http:///v1",
                                 "http://exa mple.com", "http://127.0.0.1:8000/v\t1"])
def test_an_unusable_service_url_falls_back(url):
    """Issue 75 item 11b: a space in the host raised ``http.client.InvalidURL`` out of the
    trace."""
    resolution = Resolver(ResolverSettings(url=url)).resolve(PROBLEM, "cpu", "flash", CPU)
    assert resolution.source == "default"
    assert "lookup service URL is unusable" in resolution.detail


def test_the_one_warning_of_a_url_without_scheme_names_the_root_cause(monkeypatch, caplog):
    """Issue 46 item 7: the kernel choice's lookup and the config's meet the same root cause,
    and the key's one warning gives it, not "circuit breaker open"."""
    monkeypatch.setenv("AUTOTUNE_URL", "127.0.0.1:8765")
    caplog.set_level(logging.WARNING, logger="kernel.resolve")
    reset_resolver()
    try:
        q = jnp.ones((1, 2, 256, 64), jnp.float32)
        kernel.flash_attention(q, q, q)
    finally:
        reset_resolver(ResolverSettings())
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "'127.0.0.1:8765' is not an http:// or https:// URL" in warning
    assert "circuit breaker" not in warning


def test_a_key_skipped_by_the_open_breaker_names_what_opened_it(service):
    resolver = Resolver(ResolverSettings(url=service(b"SSH-2.0-OpenSSH_9.0\r\n"), timeout_s=2))
    other = Problem.from_dict({**PROBLEM.to_dict(), "q_len": 512, "kv_len": 512})
    first = resolver.resolve(PROBLEM, "cpu", "flash", CPU).detail
    assert "lookup service failed: BadStatusLine" in first
    skipped = resolver.resolve(other, "cpu", "flash", CPU).detail
    assert "circuit breaker open after: lookup service failed: BadStatusLine" in skipped


def test_a_good_reply_is_used(service):
    resolver = Resolver(ResolverSettings(url=service(_http(OK_BODY)), timeout_s=2))
    resolution = resolver.resolve(PROBLEM, "cpu", "flash", CPU)
    assert (resolution.source, resolution.config.block_q) == ("service", 256)


@pytest.mark.parametrize("value", ["fast", "-5", "0", "inf", "1e20"])
def test_a_bad_timeout_setting_is_reported_once_and_never_fails_a_trace(value, monkeypatch,
                                                                         caplog):
    monkeypatch.setenv("AUTOTUNE_TIMEOUT_MS", value)
    caplog.set_level(logging.ERROR, logger="kernel.resolve")
    settings = ResolverSettings.from_env()
    assert settings.timeout_s == 0.25
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "AUTOTUNE_TIMEOUT_MS" in record.getMessage() and value in record.getMessage()
    reset_resolver(settings)
    try:
        q = jnp.ones((1, 2, 256, 64), jnp.float32)
        assert kernel.flash_attention(q, q, q).shape == q.shape
    finally:
        reset_resolver(ResolverSettings())


@pytest.mark.parametrize(("value", "mode", "error"), [
    ("1", "exact", False), ("nearest", "nearest", False), ("0", "", False), ("", "", False),
    ("yes please", "exact", True)])
def test_autotune_strict_turns_a_strict_build_on_and_a_bad_value_never_off(
        value, mode, error, monkeypatch, caplog):
    """AUTOTUNE_STRICT (issue 71 item 6): 1 or nearest; a value it does not know logs one
    error naming it and keeps strict mode on, so a build that asked for it never runs
    without it."""
    monkeypatch.setenv("AUTOTUNE_STRICT", value)
    caplog.set_level(logging.ERROR, logger="kernel.resolve")
    assert ResolverSettings.from_env().strict == mode
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert [value in message and "AUTOTUNE_STRICT" in message for message in errors] == (
        [True] if error else [])


def _table(tmp_path, config: FlashConfig, **provenance) -> str:
    path = tmp_path / "table.json"
    path.write_text(json.dumps({
        "schema_version": 1, "kernel": "flash", "kernel_version": "1", "device_kind": "cpu",
        "entries": [{"problem": PROBLEM.to_dict(), "config": config.to_dict(),
                     "provenance": provenance}]}))
    return str(path)


def test_an_illegal_table_config_falls_back_once_and_the_source_says_default(tmp_path,
                                                                            caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="kernel.resolve")
    # A JAX whose in-kernel pipelines lower only depths 1 and 2: the table's depth 3 is storable
    # (some JAX lowers it) but illegal here.
    monkeypatch.setattr("kernel.backends.flash.depths.supported_pipeline_depths", lambda: (1, 2))
    path = _table(tmp_path, FlashConfig(block_q=128, pipeline_depth=3))
    resolver = reset_resolver(ResolverSettings(table_paths=(path,)))
    try:
        q = jnp.ones((1, 2, 256, 64), jnp.float32)
        for _ in range(3):
            kernel.flash_attention(q, q, q)
        default = kernel.get_kernel("flash").default_config(PROBLEM)
        assert kernel.resolution_sources() == {
            ("flash", "cpu", PROBLEM): f"default, config {default.label(PROBLEM.mode)}"}
        [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert "pipeline_depth" in warning and "table" in warning
        assert "no table pinned" not in warning
        assert resolver.resolve(PROBLEM, "cpu", "flash", CPU).source == "default"
    finally:
        reset_resolver(ResolverSettings())


def test_an_entry_tuned_under_other_versions_is_used_and_marked_stale(tmp_path):
    path = _table(tmp_path, FlashConfig(block_q=256), jax_version="0.0.1")
    reset_resolver(ResolverSettings(table_paths=(path,)))
    try:
        q = jnp.ones((1, 2, 256, 64), jnp.float32)
        kernel.flash_attention(q, q, q)
        [source] = kernel.resolution_sources().values()
        assert source.startswith("table (stale: jax 0.0.1 (installed ")
    finally:
        reset_resolver(ResolverSettings())
    current = _table(tmp_path, FlashConfig(block_q=256),
                     jax_version=kernel.resolve.installed_versions()["jax"])
    resolver = Resolver(ResolverSettings(table_paths=(current,)))
    assert resolver.resolve(PROBLEM, "cpu", "flash", CPU).describe() == \
        f"table, exact, config {FlashConfig(block_q=256).label()}"


_ENTRY_TABLE = (b'{"schema_version": 1, "kernel": "flash", "kernel_version": "1", '
                b'"device_kind": "cpu", "entries": [{"problem": '
                + json.dumps(PROBLEM.to_dict()).encode() + b', "config": {}, "time_ms": %b}]}')


@pytest.mark.parametrize("content, message", [
    (b'{"schema_version": 1, "kernel": "flash\xff"}', "is not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"schema_version": 1, "kernel": "nokernel", "kernel_version": "1", "device_kind": "cpu",'
     b' "entries": []}', "unknown kernel 'nokernel'"),
    (_ENTRY_TABLE % (b"1" + b"0" * 400), "time_ms must be a non-negative number a float holds"),
    (_ENTRY_TABLE % (b"1" * 5000), "is not valid JSON: Exceeds the limit"),
])
def test_a_broken_pinned_table_is_a_table_error_naming_the_file(tmp_path, content, message,
                                                                 caplog):
    """``use_table`` raises it; from AUTOTUNE_TABLE it is logged and the resolver, so every
    trace, runs without the table."""
    path = tmp_path / "broken.json"
    path.write_bytes(content)
    with pytest.raises(TableError, match=message) as raised:
        LookupTable.load(path)
    assert str(path) in str(raised.value)
    with pytest.raises(TableError, match=message):
        Resolver(ResolverSettings()).use_table(path)
    caplog.set_level(logging.ERROR, logger="kernel.resolve")
    resolver = Resolver(ResolverSettings(table_paths=(str(path),)))
    assert resolver.resolve(PROBLEM, "cpu", "flash", CPU).source == "default"
    [error] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert str(path) in error


def test_stored_configs_must_have_a_depth_some_jax_lowers():
    flash = kernel.get_kernel("flash")
    for depth in (7, 1000):
        rules = {v.rule for v in flash.stored_violations(PROBLEM, FlashConfig(pipeline_depth=depth))}
        assert rules == {"pipeline_depth"}
    assert not flash.stored_violations(PROBLEM, FlashConfig(block_q=256, pipeline_depth=4))


def test_a_package_not_installed_here_is_not_a_stale_version():
    installed = {"jax": "0.10.2", "jaxlib": "0.10.2", "libtpu": None}
    assert kernel.resolve.stale_versions({"libtpu_version": "0.0.20"}, installed) == ""
    assert kernel.resolve.stale_versions({"jax_version": "0.9.0"}, installed) == \
        "jax 0.9.0 (installed 0.10.2)"


def test_an_answer_missed_while_the_breaker_was_open_is_asked_again(service):
    """A key resolved while the breaker is open got the default; once the breaker closes, it
    is asked again (it kept the default for the life of the process)."""
    failing, good = service(b"SSH-2.0-OpenSSH_9.0\r\n"), service(_http(OK_BODY))
    resolver = Resolver(ResolverSettings(url=failing, timeout_s=2, breaker_s=0.3))
    other = Problem.from_dict({**PROBLEM.to_dict(), "q_len": 512, "kv_len": 512})
    assert resolver.resolve(PROBLEM, "cpu", "flash", CPU).source == "default"  # opens it
    assert resolver.resolve(other, "cpu", "flash", CPU).source == "default"  # skipped
    assert resolver.service_requests == 1
    resolver.service.url = good  # the service is back
    assert resolver.resolve(other, "cpu", "flash", CPU).source == "default"  # still open
    time.sleep(0.35)
    assert resolver.resolve(other, "cpu", "flash", CPU).source == "service"
    assert resolver.resolve(PROBLEM, "cpu", "flash", CPU).source == "service"
    assert resolver.service_requests == 3
    resolver.resolve(PROBLEM, "cpu", "flash", CPU)  # answered: cached for good
    assert resolver.service_requests == 3


def test_the_service_is_asked_for_the_installed_kernel_version(tmp_path, monkeypatch,
                                                               start_server):
    """The service answers for the version it is asked (its own installed one, before): a
    client whose kernel is at another version gets no config of the other meaning."""
    from storage import Store, TunedResult, upgrade

    db = f"sqlite:///{tmp_path / 'versions.db'}"
    upgrade(db)
    server = start_server(db)
    with Store(db) as store:
        store.publish(TunedResult(problem=PROBLEM, config=FlashConfig(block_q=256),
                                  device_kind="cpu", median_ms=1.0, platform="cpu"))
    resolver = Resolver(ResolverSettings(url=server.url, timeout_s=10))
    assert resolver.resolve(PROBLEM, "cpu", "flash", CPU).source == "service"
    monkeypatch.setattr(type(resolver.kernel("flash")), "version", "2")
    resolver = Resolver(ResolverSettings(url=server.url, timeout_s=10))
    resolution = resolver.resolve(PROBLEM, "cpu", "flash", CPU)
    assert resolution.source == "default" and "no config" in resolution.detail


def test_a_table_of_another_kernel_version_is_not_used(tmp_path, monkeypatch):
    path = _table(tmp_path, FlashConfig(block_q=256))
    monkeypatch.setattr(type(kernel.get_kernel("flash")), "version", "2")
    resolution = Resolver(ResolverSettings(table_paths=(path,))).resolve(
        PROBLEM, "cpu", "flash", CPU)
    assert resolution.source == "default"
    assert "kernel version '1', but version '2' is installed" in resolution.detail


def test_an_exact_entry_of_a_later_table_beats_a_nearer_one_of_an_earlier(tmp_path):
    """Each table alone answers; together, exact beats nearest whichever file comes first."""
    longer = Problem.from_dict({**PROBLEM.to_dict(), "q_len": 512, "kv_len": 512})
    paths = []
    for name, problem, block in (("a", longer, 256), ("b", PROBLEM, 128)):
        (tmp_path / name).mkdir()
        paths.append(tmp_path / name / "table.json")
        paths[-1].write_text(json.dumps({
            "schema_version": 1, "kernel": "flash", "kernel_version": "1", "device_kind": "cpu",
            "entries": [{"problem": problem.to_dict(),
                         "config": FlashConfig(block_q=block).to_dict()}]}))
    resolver = Resolver(ResolverSettings(table_paths=tuple(map(str, paths))))
    resolution = resolver.resolve(PROBLEM, "cpu", "flash", CPU)
    assert (resolution.config.block_q, resolution.detail) == (128, "exact match in pinned table")


def test_the_sources_name_the_config_and_the_tuned_problem_a_nearest_match_came_from(
        tmp_path):
    """Issue 46 item 6: a q1024 call borrowing the q256 entry says so, and which config ran."""
    resolver = reset_resolver(ResolverSettings(table_paths=(
        _table(tmp_path, FlashConfig(block_q=128)),)))
    try:
        for length in (256, 1024):
            q = jnp.ones((1, 2, length, 64), jnp.float32)
            kernel.flash_attention(q, q, q)
        sources = kernel.resolution_sources()
    finally:
        reset_resolver(ResolverSettings())
    label = FlashConfig(block_q=128).label(PROBLEM.mode)
    longer = dataclasses.replace(PROBLEM, q_len=1024, kv_len=1024)
    assert sources == {
        ("flash", "cpu", PROBLEM): f"table, exact, config {label}",
        ("flash", "cpu", longer): f"table, nearest (from {PROBLEM.label()}), config {label}"}
    assert resolver.resolve(longer, "cpu", "flash", CPU).origin == PROBLEM


def test_pinning_an_updated_file_replaces_its_table(tmp_path):
    """A18: the file's new entries win; the old table is not kept beside the new one."""
    path = _table(tmp_path, FlashConfig(block_q=128))
    resolver = Resolver(ResolverSettings(table_paths=(path,)))
    assert resolver.resolve(PROBLEM, "cpu", "flash", CPU).config.block_q == 128
    _table(tmp_path, FlashConfig(block_q=256))
    resolver.use_table(path)
    assert resolver.resolve(PROBLEM, "cpu", "flash", CPU).config.block_q == 256


@pytest.mark.parametrize("kind", ["device", "fifo", "directory", "huge", "missing"])
def test_a_table_path_that_is_no_regular_file_of_bounded_size_is_refused(kind, tmp_path,
                                                                         monkeypatch, caplog):
    """A13: /dev/zero, a FIFO (which would block a read), a directory and a file over the
    size limit are refused before they are read; from AUTOTUNE_TABLE, the trace still runs.
    Issue 55 item 6: a missing file was "not valid JSON ... No such file or directory"."""
    path = tmp_path / "table.json"
    if kind == "device":
        path = "/dev/zero"
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        monkeypatch.setattr("kernel.table.MAX_TABLE_BYTES", 1000)
        path.write_text(" " * 1001)
    message = {"huge": "over the", "missing": "does not exist"}.get(kind,
                                                                     "is not a regular file")
    with pytest.raises(TableError, match=message):
        LookupTable.load(path)
    caplog.set_level(logging.ERROR, logger="kernel.resolve")
    monkeypatch.setenv("AUTOTUNE_TABLE", str(path))
    reset_resolver()
    try:
        q = jnp.ones((1, 2, 256, 64), jnp.float32)
        assert kernel.flash_attention(q, q, q).shape == q.shape
    finally:
        reset_resolver(ResolverSettings())
    [error] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "AUTOTUNE_TABLE" in error and str(path) in error and message in error


def test_sources_can_be_read_while_another_thread_resolves():
    resolver = Resolver(ResolverSettings())
    resolver.kernel("flash")
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                resolver.sources()
            except RuntimeError as error:  # dictionary changed size during iteration
                errors.append(error)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for batch in range(1, 400):
            resolver.resolve(dataclasses.replace(PROBLEM, batch=batch), "cpu", "flash", CPU)
    finally:
        done.set()
        reader.join()
    assert errors == []


def test_a_tpu_of_an_unlisted_kind_gets_the_most_conservative_limits_with_one_warning(caplog):
    """A21: not the CPU target (no VMEM limit), under which over-limit configs would run."""
    caplog.set_level(logging.WARNING, logger="kernel.targets")
    target = kernel.device_target("tpu", "TPU v9 future")
    assert target.scoped_vmem_bytes == min(
        t.scoped_vmem_bytes for t in kernel.TARGETS.values() if t.scoped_vmem_bytes)
    assert kernel.device_target("tpu", "TPU v9 future") is target
    [warning] = [r.getMessage() for r in caplog.records]
    assert "'TPU v9 future'" in warning and target.name in warning
    assert kernel.device_target("cpu", "cpu").scoped_vmem_bytes is None
    wide = FlashConfig(block_q=4096, block_kv=4096)
    long = dataclasses.replace(PROBLEM, q_len=8192, kv_len=8192, head_dim=128)
    assert "vmem" in {v.rule for v in kernel.get_kernel("flash").violations(long, wide, target)}


def test_a_shape_traced_while_the_service_was_down_gets_its_config_once_it_is_back(
        tmp_path) -> None:
    """Issue 75 item 9: the service was down when a shape was first traced, so it kept the
    default for the whole job, its jitted function never traced again. Once the breaker
    closes, the process-wide resolver asks again, and the function's next call traces anew
    with the service's config."""
    port = free_port()  # nothing answers there yet
    reset_resolver(ResolverSettings(url=f"http://127.0.0.1:{port}", breaker_s=0.5))
    traces: list[None] = []

    def attend(q: jax.Array) -> jax.Array:
        traces.append(None)
        return kernel.flash_attention(q, q, q, causal=True)

    step = jax.jit(attend)
    q = jnp.ones((1, 2, 256, 64), jnp.float32)
    try:
        step(q)
        [(key, how)] = [(k, h) for k, h in kernel.resolution_sources().items()
                        if k[0] == "flash"]
        assert how.startswith("default"), how
        db = f"sqlite:///{tmp_path / 'up.db'}"
        upgrade(db)
        tuned = FlashConfig(block_q=128, block_kv=128, block_kv_compute=128)
        with Store(db) as store:
            store.publish(TunedResult(device_kind=key[1], problem=key[2], config=tuned,
                                      median_ms=1.0))
        with running_server(db, tmp_path, token=None, port=port):
            deadline = time.monotonic() + 60  # the breaker closes every 0.5 s
            while kernel.resolution_sources()[key].startswith("default"):
                assert time.monotonic() < deadline, kernel.resolution_sources()[key]
                time.sleep(0.1)
        step(q)
        now = kernel.resolution_sources()[key]
    finally:
        reset_resolver(ResolverSettings())
    assert len(traces) == 2  # traced again, not the first trace's program run
    assert now.startswith(f"service, exact, config {tuned.label(key[2].mode)}"), now
