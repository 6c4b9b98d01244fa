"""Shared fixtures.

Databases: ``empty_db_url`` / ``db_url`` run each test against a new SQLite file and a new
PostgreSQL database (on the server named by ``AUTOTUNE_TEST_POSTGRES_URL``, which ``.ci/run``
starts; without it the PostgreSQL case skips, or fails when ``CI`` is set).
Servers: ``start_server`` runs the real ``autotune serve`` on a free loopback port; ``server``
is one such server for the whole session, with a bearer token.
Ctrl-C: the suite raises ``KeyboardInterrupt`` on SIGINT however it was started (see
:func:`pytest_configure`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from kernel.problem import Problem

POSTGRES_ENV = "AUTOTUNE_TEST_POSTGRES_URL"
_SCRIPT = Path(sys.executable).with_name("autotune")  # the console script of this env
# Where the package is on PYTHONPATH but not installed (a TPU VM's carried wheels): the module.
AUTOTUNE = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "autotune"]
TOKEN = "test-token-" + uuid.uuid4().hex


def run_cli(*args: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Runs ``autotune ARGS`` in a subprocess and returns it (never raises on exit status). A
    crash of the interpreter prints its Python stack to the captured stderr (faulthandler)."""
    return subprocess.run([*AUTOTUNE, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})})


def sqlite_copy(source: Path, folder: Path) -> str:
    """The URL of a copy of the SQLite file ``source`` in ``folder``, taken with SQLite's
    backup (a connection still open on ``source`` may hold recent writes in its write-ahead
    log): a test's own copy of a database a module fixture prepared once."""
    copy = folder / source.name
    with closing(sqlite3.connect(source)) as original, closing(sqlite3.connect(copy)) as into:
        original.backup(into)
    return f"sqlite:///{copy}"


def float32_bound(cpu: float) -> float:
    """The relative error an f32 kernel may have against a float32 or float64 reference on this
    process's default device: ``cpu`` (a summation order apart) except on a TPU, whose f32
    matmuls run at default precision (bf16 passes), where it is kernel.tolerance's TPU bound: a
    TPU v5e measured 1.8e-3 to 7.9e-3 on the kernel test files' f32 cases
    (bench/results/tpu-v5e-2026-12-06/kerneltests.log)."""
    import jax

    from kernel.tolerance import max_relative_error

    return max_relative_error("float32", "tpu") if jax.default_backend() == "tpu" else cpu


def plain_sources(sources: dict[Any, str]) -> dict[Any, str]:
    """``kernel.resolution_sources()`` without each key's match and config (``table, exact,
    config ...`` reads ``table``), for tests that check only where configs came from."""
    return {key: re.sub(r"(, (exact|nearest \(from [^)]*\)))?, config [^;]*", "", value)
            for key, value in sources.items()}


def unavailable(name: str) -> str:
    """Why the registered backend ``name`` runs nothing here whatever the problem: an optional
    package it needs is not installed (its ``*_missing`` rule, e.g. ``tokamax_missing``),
    naming the extra; '' when it can run."""
    from kernel import Problem, get_kernel

    problem = Problem(1, 1, 1, 128, 128, 128, "float32", False, "fwd")
    return "; ".join(str(v) for v in get_kernel(name).problem_violations(problem)
                     if v.rule.endswith("_missing"))


def refusal(kernel: Any, problem: Problem, target: Any) -> str:
    """Why backend ``kernel`` cannot run ``problem`` on ``target`` (its ``check_runs``: no
    rules for the device, or a problem rule, anywhere or on that device alone); '' when it
    can."""
    from kernel import ConfigError

    try:
        kernel.check_runs(problem, target)
    except ConfigError as error:
        return str(error)
    return ""


def installed(name: str) -> Any:
    """``name`` as a test parameter, skipped naming the extra to install where the backend's
    optional package is missing (:func:`unavailable`; CI installs every one)."""
    why = unavailable(name)
    return pytest.param(name, marks=pytest.mark.skip(reason=why)) if why else name


def problem_flags(problem: Problem) -> list[str]:
    """The ``autotune`` problem flags (``--batch ... --mode``) that select ``problem``."""
    fields = problem.to_dict()
    flags = [f"--{name.replace('_', '-')}={fields[name]}" for name in
             ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim", "dtype", "mode")]
    flags.append("--causal" if fields["causal"] else "--no-causal")
    if problem.window is not None:
        flags.append(f"--window={problem.window[0]},{problem.window[1]}")
    if problem.softcap is not None:
        flags.append(f"--softcap={problem.softcap}")
    return [*flags, *(["--segmented"] if problem.segmented else []),
            *(["--bottom-right"] if problem.bottom_right else [])]


def pytest_configure(config: pytest.Config) -> None:
    """Restores Python's Ctrl-C handler where the suite's shell ignores SIGINT (a background job:
    ``&`` in a script, nohup). The Ctrl-C tests send SIGINT to the suite and to ``autotune``
    subprocesses; ignored, it would be lost and the search under test would run to its end.
    The subprocesses inherit the default disposition and install the same handler."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(config, "workerinput"):
        return
    share_compiled_programs(config)
    if getattr(config.option, "numprocesses", None):
        config.pluginmanager.register(FileProgress(config), "file-progress")


def share_compiled_programs(config: pytest.Config) -> None:
    """One JAX compilation cache for the run (a new folder, removed at its end), which the
    workers and every ``autotune`` subprocess inherit: the suite compiles the same small
    programs in many processes (the suite on 3 workers, 2 cores: 1,281 -> 1,040 s one run after the other, 2026-12-07).
    JAX keys each entry by the program, its options and the jax/jaxlib versions; a cache
    the user already set is kept."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    folder = tempfile.mkdtemp(prefix="flash-autotune-jax-cache-")
    os.environ.update(JAX_COMPILATION_CACHE_DIR=folder,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))


class FileProgress:
    """Under pytest-xdist (``.ci/run``: each test file on one worker), the controller's line
    per test file once its last test finished, e.g. ``tests/test_x.py done (12 passed,
    1 skipped, 34.5 s)``, so that a slow run shows where it is among its dots. The seconds are
    the worker's on that file: its tests' setups, calls and teardowns."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.left: Counter[str] = Counter()  # tests of each file not finished yet
        self.outcomes: dict[str, Counter[str]] = defaultdict(Counter)
        self.seconds: Counter[str] = Counter()
        self.running: dict[str, str] = {}  # a test's outcome so far (the worst of its phases)

    def pytest_xdist_node_collection_finished(self, node: object, ids: list[str]) -> None:
        if not self.left:  # every worker collects the same tests
            self.left.update(nodeid.split("::")[0] for nodeid in ids)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = report.nodeid.split("::")[0]
        self.seconds[path] += report.duration
        outcome = self.running.get(report.nodeid, "passed")
        if report.failed:
            outcome = "failed" if report.when == "call" else "error"
        elif report.skipped and outcome == "passed":
            outcome = "skipped"
        self.running[report.nodeid] = outcome
        if report.when != "teardown":
            return
        self.outcomes[path][self.running.pop(report.nodeid)] += 1
        self.left[path] -= 1
        if self.left[path] == 0:
            counts = ", ".join(f"{n} {outcome}" for outcome, n in self.outcomes[path].items())
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            if reporter._tw.width_of_current_line:  # after progress dots: a line of its own
                reporter.write("\n")
            reporter.write_line(f"{path} done ({counts}, {self.seconds[path]:.1f} s)")


# --- databases ---


@pytest.fixture(scope="session")
def postgres_databases() -> Iterator[Callable[[], str]]:
    """A factory of new, empty PostgreSQL databases: each is a new schema (cheap, unlike
    CREATE DATABASE) in one database created for this session and dropped at the end."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from storage import normalize_url

    base = os.environ.get(POSTGRES_ENV)
    if not base:
        if os.environ.get("CI"):
            pytest.fail(f"{POSTGRES_ENV} is not set although CI is; .ci/run starts PostgreSQL "
                        "and sets it")
        pytest.skip(f"{POSTGRES_ENV} is not set; run .ci/run or point it at a PostgreSQL server")
    name = f"autotune_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(normalize_url(base), isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
    database = make_url(normalize_url(base)).set(database=name)
    session_engine = create_engine(database, isolation_level="AUTOCOMMIT")

    def create() -> str:
        schema = f"t_{uuid.uuid4().hex[:12]}"
        with session_engine.connect() as connection:
            connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        url = database.update_query_dict({"options": f"-csearch_path={schema}"})
        return url.render_as_string(hide_password=False)

    yield create
    session_engine.dispose()
    with admin.connect() as connection:
        connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database with no tables: a new SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'autotune.db'}"
    return request.getfixturevalue("postgres_databases")()


@pytest.fixture
def db_url(empty_db_url: str) -> str:
    """A new database at the current schema (``storage.upgrade``)."""
    from storage import upgrade

    upgrade(empty_db_url)
    return empty_db_url


@pytest.fixture
def store(db_url: str) -> Iterator[object]:
    """A ``storage.Store`` on ``db_url``, closed afterwards."""
    from storage import Store

    with Store(db_url) as opened:
        yield opened


@pytest.fixture
def sqlite_db_url(tmp_path: Path) -> str:
    """A new SQLite file at the current schema (for tests that need only one backend)."""
    from storage import upgrade

    url = f"sqlite:///{tmp_path / 'autotune.db'}"
    upgrade(url)
    return url


# --- servers ---


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    """A running ``autotune serve``: its base URL, database and token."""

    url: str
    db_url: str
    token: str | None
    process: subprocess.Popen = field(repr=False)
    log: Path = field(repr=False)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)


def wait_until_answering(process: subprocess.Popen, url: str, name: str,
                         output: Callable[[], str], timeout_s: float = 60) -> None:
    """Polls ``url`` until it answers 200; fails the test, showing ``output()``, when
    ``process`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            pytest.fail(f"{name} exited with {process.returncode}:\n{output()}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{name} did not answer {url} within {timeout_s:.0f} s:\n{output()}")
        time.sleep(0.1)


@contextmanager
def running_server(db_url: str, log_dir: Path, *, token: str | None = TOKEN,
                   args: tuple[str, ...] = (), settings: dict[str, str] | None = None,
                   max_open_files: int | None = None,
                   port: int | None = None) -> Iterator[Server]:
    """Starts ``autotune serve`` on ``db_url`` (already upgraded) and waits for /readyz;
    ``settings`` are extra environment variables, ``max_open_files`` its ``ulimit -n``,
    ``port`` its port (default: a free one)."""
    import resource

    port = port or free_port()
    log = log_dir / f"server-{port}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")}
    env.update(settings or {})
    if token:
        env["AUTOTUNE_API_TOKEN"] = token

    def limit_files() -> None:
        if max_open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, max_open_files))

    with log.open("w") as sink:
        process = subprocess.Popen(
            [*AUTOTUNE, "serve", "--db", db_url, "--port", str(port), *args],
            stdout=sink, stderr=subprocess.STDOUT, env=env, preexec_fn=limit_files)
    server = Server(f"http://127.0.0.1:{port}", db_url, token, process, log)
    try:
        wait_until_answering(process, f"{server.url}/readyz", "autotune serve", log.read_text)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def start_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Server]]:
    """A factory: ``start_server(db_url, token=..., args=(...))`` runs a server until the end
    of the session."""
    from contextlib import ExitStack

    log_dir = tmp_path_factory.mktemp("servers")
    with ExitStack() as stack:
        yield lambda db_url, **kwargs: stack.enter_context(
            running_server(db_url, log_dir, **kwargs))


@pytest.fixture(scope="session")
def server(start_server: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory) -> Server:
    """One server for the session on a SQLite file created by ``autotune db upgrade``, with a
    bearer token. Tests share it, so each uses its own device kind."""
    url = f"sqlite:///{tmp_path_factory.mktemp('server-db') / 'autotune.db'}"
    upgraded = run_cli("db", "upgrade", "--db", url)
    assert upgraded.returncode == 0, upgraded.stderr
    return start_server(url)
