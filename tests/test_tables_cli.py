"""The table and database commands as a user runs them (``autotune`` in a subprocess, SQLite
files): ``db upgrade``, ``export`` and ``import`` round trip, keep-better and ``--force`` on
import, and clean failures (exit status, message naming the bad entry, no traceback, nothing
written) for bad files, missing schemas and ambiguous exports."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import problem_flags, run_cli
from kernel import FlashConfig, LookupTable, TableError
from kernel.problem import Problem
from storage import Store, TunedResult

DEVICE = "TPU v5 lite"


def seed(url: str, device_kind: str = DEVICE, median_ms: float = 1.0) -> None:
    with Store(url) as store:
        for q_len in (256, 512):
            store.publish(TunedResult(
                device_kind=device_kind, median_ms=median_ms, default_median_ms=2.0,
                problem=Problem(batch=1, q_heads=8, kv_heads=8, q_len=q_len, kv_len=q_len,
                                head_dim=128),
                config=FlashConfig(block_q=256, block_kv=256), trials=4, method="replay"))


def assert_clean_failure(done, status: int, *phrases: str) -> None:
    assert done.returncode == status, (done.stdout, done.stderr)
    assert "Traceback" not in done.stdout + done.stderr
    for phrase in phrases:
        assert phrase in done.stderr


def count(url: str) -> int:
    with Store(url) as store:
        return store.list()[1]


def test_db_upgrade_creates_and_is_idempotent(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new.db'}"
    for _ in range(2):
        done = run_cli("db", "upgrade", "--db", url)
        assert done.returncode == 0, done.stderr
        assert "(current)" in done.stdout
    assert count(url) == 0


def test_db_upgrade_reports_an_unreachable_database_or_a_bad_url() -> None:
    done = run_cli("db", "upgrade", "--db", "postgresql+psycopg://nobody@127.0.0.1:1/none")
    assert_clean_failure(done, 1, "Connection refused")
    assert_clean_failure(run_cli("db", "upgrade", "--db", "foo://x"), 2, "no driver for 'foo'")


def test_export_then_import_round_trip(sqlite_db_url: str, tmp_path: Path) -> None:
    seed(sqlite_db_url)
    table_path = tmp_path / "table.json"
    done = run_cli("export", "--db", sqlite_db_url, "-o", str(table_path))
    assert done.returncode == 0, done.stderr
    table = json.loads(table_path.read_text())
    assert (table["device_kind"], len(table["entries"])) == (DEVICE, 2)

    other = f"sqlite:///{tmp_path / 'other.db'}"
    assert run_cli("db", "upgrade", "--db", other).returncode == 0
    done = run_cli("import", str(table_path), "--db", other)
    assert done.returncode == 0, done.stderr
    assert "2 inserted" in done.stdout
    with Store(other) as store:
        assert store.export_table(DEVICE).to_dict() == table

    # The same table again is a no-op, even forced; slower timings replace only with --force.
    assert "2 kept" in run_cli("import", str(table_path), "--db", other, "--force").stdout
    for entry in table["entries"]:
        entry["time_ms"] *= 5
    table_path.write_text(json.dumps(table))
    assert "2 kept" in run_cli("import", str(table_path), "--db", other).stdout
    assert "2 replaced" in run_cli("import", str(table_path), "--db", other, "--force").stdout


@pytest.mark.parametrize("bad_entry, phrase", [
    ({"problem": {"batch": 1, "q_heads": 8, "q_len": 512, "head_dim": 128, "dtype": "int4"},
      "config": {}}, "entry 1: dtype"),
    ({"problem": {"batch": 1, "q_heads": 8, "q_len": 512, "head_dim": 128},
      "config": {"block_q": 384}}, "block_divides"),
    ({"problem": {"batch": 1, "q_heads": 8, "q_len": 512, "head_dim": 128},
      "config": {}, "provenance": {"method": "guess"}}, "entry 1"),
    ({"problem": {"batch": 1, "q_heads": 8, "q_len": 512, "head_dim": 128},
      "config": {}, "provenance": {"trials": 2**64}}, "trials must be an integer"),
])
def test_a_bad_entry_imports_nothing(sqlite_db_url: str, tmp_path: Path, bad_entry: dict,
                                     phrase: str) -> None:
    good = {"problem": {"batch": 1, "q_heads": 8, "q_len": 256, "head_dim": 128},
            "config": {"block_q": 256, "block_kv": 256}, "time_ms": 1.0}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"schema_version": 1, "kernel": "flash", "kernel_version": "1",
                                "device_kind": DEVICE, "entries": [good, bad_entry]}))
    done = run_cli("import", str(path), "--db", sqlite_db_url)
    assert_clean_failure(done, 2, phrase, "nothing was imported")
    assert count(sqlite_db_url) == 0


@pytest.mark.parametrize("content, phrase", [
    ("{not json", "not valid JSON"),
    ('{"schema_version": 99}', "schema_version"),
    (None, "does not exist"),  # issue 55 item 6: it said "is not valid JSON"
])
def test_an_unreadable_file_imports_nothing(sqlite_db_url: str, tmp_path: Path,
                                            content: str | None, phrase: str) -> None:
    path = tmp_path / "table.json"
    if content is not None:
        path.write_text(content)
    assert_clean_failure(run_cli("import", str(path), "--db", sqlite_db_url), 2, phrase)
    assert count(sqlite_db_url) == 0


GOOD_ENTRY = {"problem": {"batch": 1, "q_heads": 8, "q_len": 256, "head_dim": 128},
              "config": {"block_q": 256, "block_kv": 256}, "time_ms": 1.0}
SPLASH_ITEM = {"kernel": "splash", "kernel_version": "1", "entries": []}


def table_json(schema_version: int = 3, entries: list | None = None, **fields: object) -> str:
    """A flash table on DEVICE; a big integer is written out in digits, as a file holds it."""
    return json.dumps({"schema_version": schema_version, "kernel": "flash",
                       "kernel_version": "1", "device_kind": DEVICE,
                       "entries": entries or [GOOD_ENTRY], **fields})


@pytest.mark.parametrize("content, phrase", [
    # Issue 55 item 9: a TypeError and an OverflowError, printed as tracebacks.
    (table_json(others=[{**SPLASH_ITEM, "kernel": ["splash"]}]),
     "others[0]: field 'kernel' must be a non-empty string (a kernel's name), got ['splash']"),
    (table_json(others=[{**SPLASH_ITEM, "kernel": {"name": "splash"}}]),
     "others[0]: field 'kernel' must be a non-empty string"),
    (table_json(entries=[{**GOOD_ENTRY, "problem": {**GOOD_ENTRY["problem"],
                                                    "softcap": 10 ** 400}}]),
     "entry 0: softcap must be positive and finite (logits become softcap * tanh(logits / "
     "softcap)), got an integer too large for a float"),
    # Issue 55 item 15: kept silently.
    (table_json(others=[{**SPLASH_ITEM, "kernel": "flash"}]),
     "others[0] holds kernel 'flash' again"),
    (table_json(others=[SPLASH_ITEM, SPLASH_ITEM]), "others[1] holds kernel 'splash' again"),
    (table_json(2, entries=[{**GOOD_ENTRY, "problem": {**GOOD_ENTRY["problem"],
                                                       "window": [64, 0]}}]),
     "entry 0: problem field(s) window came with schema_version 3; a schema 2 table has none"),
    # Issue 75 item 11i: the service stored one, a pinned table ran the other.
    (table_json(entries=[GOOD_ENTRY, {**GOOD_ENTRY, "config": {"block_q": 128},
                                      "problem": {**GOOD_ENTRY["problem"], "kv_heads": 8}}]),
     "entry 1 repeats the problem of entry 0 (b1 h8/8 q256 kv256 d128"),
])
def test_a_malformed_table_imports_nothing_and_names_it(sqlite_db_url: str, tmp_path: Path,
                                                        content: str, phrase: str) -> None:
    path = tmp_path / "table.json"
    path.write_text(content)
    assert_clean_failure(run_cli("import", str(path), "--db", sqlite_db_url), 2, phrase,
                         "nothing was imported")
    assert count(sqlite_db_url) == 0


def test_a_pinned_table_with_a_problem_twice_is_refused(tmp_path: Path) -> None:
    """Issue 75 item 11i: as ``AUTOTUNE_TABLE``, the same table as ``import`` refuses."""
    path = tmp_path / "table.json"
    choice = {"problem": GOOD_ENTRY["problem"], "kernel": "xla", "config": {},
              "candidates": {"xla": {"median_ms": 1.0}}}
    path.write_text(table_json(choices=[choice, choice]))
    with pytest.raises(TableError, match=r"choice 1 repeats the problem of choice 0 \(b1 h8"):
        LookupTable.load(path)


def test_import_names_the_kernels_it_leaves_out(sqlite_db_url: str, tmp_path: Path) -> None:
    """Issue 55 item 15: entries of a kernel this build does not install were dropped without a
    word."""
    path = tmp_path / "table.json"
    path.write_text(table_json(others=[{**SPLASH_ITEM, "kernel": "future", "entries": [{}]}]))
    done = run_cli("import", str(path), "--db", sqlite_db_url)
    assert done.returncode == 0, done.stderr
    assert "1 inserted" in done.stdout
    assert ("the entries of kernel(s) future are left out: this build does not install them"
            in " ".join(done.stderr.split())), done.stderr


def test_export_refuses_a_database_without_schema(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    done = run_cli("export", "-o", str(tmp_path / "out.json"), "--db", url)
    assert_clean_failure(done, 1, f"autotune db upgrade --db {url}")


def test_import_creates_the_database_as_tune_does(sqlite_db_url: str, tmp_path: Path) -> None:
    """Issue 46 item 8: import said "create it with `autotune db upgrade`"."""
    seed(sqlite_db_url)
    table = tmp_path / "table.json"
    assert run_cli("export", "-o", str(table), "--db", sqlite_db_url).returncode == 0
    url = f"sqlite:///{tmp_path / 'new.db'}"
    done = run_cli("import", str(table), "--db", url)
    assert done.returncode == 0, done.stderr
    assert count(url) == 2


def test_export_needs_a_device_kind_when_several_are_stored(sqlite_db_url: str,
                                                            tmp_path: Path) -> None:
    seed(sqlite_db_url)
    seed(sqlite_db_url, device_kind="TPU v6 lite")
    out = tmp_path / "out.json"
    done = run_cli("export", "--db", sqlite_db_url, "-o", str(out))
    assert_clean_failure(done, 2, "--device-kind", "TPU v6 lite")
    assert not out.exists()
    done = run_cli("export", "--db", sqlite_db_url, "-o", str(out), "--device-kind",
                   "TPU v6 lite")
    assert done.returncode == 0 and json.loads(out.read_text())["device_kind"] == "TPU v6 lite"


def test_db_url_comes_from_the_environment(sqlite_db_url: str, tmp_path: Path) -> None:
    seed(sqlite_db_url)
    out = tmp_path / "out.json"
    done = run_cli("export", "-o", str(out), env={"AUTOTUNE_DB_URL": sqlite_db_url})
    assert done.returncode == 0, done.stderr
    assert len(json.loads(out.read_text())["entries"]) == 2


def test_export_of_an_empty_database_says_there_is_nothing_to_export(
        sqlite_db_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    done = run_cli("export", "--db", sqlite_db_url, "-o", str(out))
    assert_clean_failure(done, 1, "nothing to export: the database holds no tuned configs")
    assert "--device-kind" not in done.stderr
    assert not out.exists()


@pytest.mark.parametrize("command", [("export",), ("report",)])
def test_a_write_that_fails_half_way_leaves_the_old_file(sqlite_db_url: str, tmp_path: Path,
                                                         command: tuple[str, ...]) -> None:
    """``export`` and ``report`` write a temporary file and rename it: a write that fails (here
    past a file size limit, as on a full disk) leaves the old file whole, not truncated."""
    import resource
    import signal
    import sqlite3
    import subprocess
    from contextlib import closing

    from conftest import AUTOTUNE

    seed(sqlite_db_url)
    out = tmp_path / "out"
    out.write_text("old")

    def limit_file_size() -> None:  # writes past 512 bytes fail with EFBIG, no signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))

    # An open connection keeps the -wal and -shm files, which the command then need not grow.
    with closing(sqlite3.connect(sqlite_db_url.removeprefix("sqlite:///"))) as connection:
        connection.execute("SELECT count(*) FROM sqlite_master").fetchall()
        done = subprocess.run([*AUTOTUNE, *command, "--db", sqlite_db_url, "-o", str(out)],
                              capture_output=True, text=True, timeout=120,
                              preexec_fn=limit_file_size)
    assert_clean_failure(done, 1, f"cannot write {out}")
    assert out.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_export_carries_every_kernel_a_choice_names(sqlite_db_url: str, tmp_path: Path) -> None:
    """Issue 46 item 9: with no --kernel, the table holds the configs of each kernel a stored
    choice names (here splash, beside flash's), so a pinned table runs that choice at its tuned
    config on a shape it borrows; --kernel still exports one kernel."""
    import jax
    import jax.numpy as jnp

    import kernel
    from kernel import LookupTable, get_kernel
    from kernel.table import KernelChoice, KernelTiming

    seed(sqlite_db_url, device_kind="cpu")
    splash = get_kernel("splash")
    tuned = Problem(batch=1, q_heads=2, kv_heads=2, q_len=512, kv_len=512, head_dim=128,
                    dtype="float32", causal=True)
    config = splash.default_config(tuned).replace(block_kv_compute=256)
    with Store(sqlite_db_url) as store:
        store.publish(TunedResult(device_kind="cpu", median_ms=1.0, default_median_ms=2.0,
                                  problem=tuned, config=config, trials=4, method="replay",
                                  kernel="splash"))
        store.publish_choice("cpu", KernelChoice(
            tuned, "splash", config, {"splash": KernelTiming(1.0, 0.1)},
            {"kernel_version": splash.version}))
    path = tmp_path / "table.json"
    done = run_cli("export", "-o", str(path), "--db", sqlite_db_url)
    assert done.returncode == 0, done.stderr
    assert "(2 flash, 1 splash)" in done.stdout
    table = LookupTable.load(path)
    assert [(t.kernel, len(t.entries)) for t in table.kernel_tables()] == [("flash", 2),
                                                                          ("splash", 1)]
    borrowed = dict(tuned.to_dict(), q_len=1024, kv_len=1024)
    q = jax.ShapeDtypeStruct((1, 2, 1024, 128), jnp.float32)
    with kernel.tables(path):
        jax.eval_shape(lambda q: kernel.flash_attention(q, q, q, causal=True), q)
        sources = {key: how for key, how in kernel.resolution_sources().items()
                   if how.startswith("scoped table")}  # not what other tests traced before
    [(key, how)] = sources.items()
    assert key[0] == "splash" and key[2] == Problem.from_dict(borrowed), sources
    assert f"nearest (from {tuned.label()}), config {config.label(tuned.mode)}" in how, how

    only = tmp_path / "flash.json"
    done = run_cli("export", "-o", str(only), "--kernel", "flash", "--db", sqlite_db_url)
    assert done.returncode == 0, done.stderr
    assert LookupTable.load(only).others == ()
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    done = run_cli("import", str(path), "--db", fresh)
    assert done.returncode == 0, done.stderr
    with Store(fresh) as store:
        assert sorted(e.result.kernel for e in store.list(limit=None)[0]) == [
            "flash", "flash", "splash"]


# A fresh process traces one call of ``CHOSEN`` under AUTOTUNE_TABLE and prints how each key
# resolved: (kernel, source) pairs as JSON.
FRESH_TRACE = """
import json, jax, jax.numpy as jnp, kernel
q = jax.ShapeDtypeStruct((1, 2, 256, 128), jnp.float32)
jax.eval_shape(lambda q: kernel.flash_attention(q, q, q, causal=True), q)
print(json.dumps([[key[0], how] for key, how in kernel.resolution_sources().items()]))
"""
CHOSEN = Problem(batch=1, q_heads=2, kv_heads=2, q_len=256, kv_len=256, head_dim=128,
                 dtype="float32", causal=True)


def test_a_default_export_pinned_in_a_fresh_process_runs_an_xla_choice(
        sqlite_db_url: str, tmp_path: Path) -> None:
    """Issue 46 item 9: a stored choice names xla, beside configs of flash and xla; the
    default export (no --kernel) carries both kernels' entries, and pinned by AUTOTUNE_TABLE
    in a fresh process it runs xla for the chosen problem, saying the table chose it."""
    import os
    import subprocess
    import sys

    from kernel import LookupTable, get_kernel
    from kernel.table import KernelChoice, KernelTiming

    seed(sqlite_db_url, device_kind="cpu")
    xla = get_kernel("xla")
    config = xla.default_config(CHOSEN)
    with Store(sqlite_db_url) as store:
        store.publish(TunedResult(device_kind="cpu", median_ms=1.0, default_median_ms=1.0,
                                  problem=CHOSEN, config=config, trials=1, method="replay",
                                  kernel="xla"))
        store.publish_choice("cpu", KernelChoice(
            CHOSEN, "xla", config, {"xla": KernelTiming(1.0, 0.1), "flash": KernelTiming(2.0)},
            {"kernel_version": xla.version}))
    path = tmp_path / "table.json"
    done = run_cli("export", "-o", str(path), "--db", sqlite_db_url)
    assert done.returncode == 0, done.stderr
    assert [(t.kernel, len(t.entries)) for t in LookupTable.load(path).kernel_tables()] == [
        ("flash", 2), ("xla", 1)]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_")},
           "AUTOTUNE_TABLE": str(path)}
    run = subprocess.run([sys.executable, "-c", FRESH_TRACE], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    [(ran, how)] = json.loads(run.stdout.strip().splitlines()[-1])
    assert ran == "xla", how
    # xla has no tunable field: its one config runs ("default"); the table chose the kernel.
    assert how == "xla (no tunable config); kernel: chosen (exact choice in pinned table)"


def test_export_of_another_kernel_s_configs_only_names_the_kernel_flag(
        sqlite_db_url: str, tmp_path: Path) -> None:
    """Issue 55 item 15: a database holding only splash entries exported nothing (exit 1)
    without saying that ``--kernel splash`` exports them."""
    from kernel import get_kernel

    problem = Problem(batch=1, q_heads=2, kv_heads=2, q_len=512, kv_len=512, head_dim=128)
    with Store(sqlite_db_url) as store:
        store.publish(TunedResult(device_kind=DEVICE, median_ms=1.0, problem=problem,
                                  config=get_kernel("splash").default_config(problem),
                                  kernel="splash"))
    path = tmp_path / "table.json"
    done = run_cli("export", "-o", str(path), "--db", sqlite_db_url)
    assert_clean_failure(done, 1, "export them with --kernel splash")
    assert not path.exists()
    done = run_cli("export", "-o", str(path), "--db", sqlite_db_url, "--kernel", "splash")
    assert done.returncode == 0, done.stderr



def test_export_of_one_kernel_chooses_that_kernel(sqlite_db_url: str, tmp_path: Path) -> None:
    """Issue 75 item 3: a CPU tune of every kernel chose xla; ``export --kernel flash`` still
    wrote that choice, so the pinned table ran xla, not the flash config the user tuned. A
    table of one kernel now chooses it wherever it has a config (a stored choice of it kept as
    it is), and holds no other kernel's choice."""
    import jax
    import jax.numpy as jnp

    import kernel
    from kernel import LookupTable, get_kernel
    from kernel.table import KernelChoice, KernelTiming

    problem = Problem(batch=1, q_heads=2, kv_heads=2, q_len=256, kv_len=256, head_dim=128,
                      dtype="float32", causal=True, mode="fwd")
    tuned = FlashConfig(block_q=128, block_kv=128, block_kv_compute=128)
    with Store(sqlite_db_url) as store:
        store.publish(TunedResult(device_kind="cpu", problem=problem, config=tuned,
                                  median_ms=2.0, method="interpret", timing="wallclock"))
        store.publish_choice("cpu", KernelChoice(
            problem, "xla", get_kernel("xla").default_config(problem),
            {"xla": KernelTiming(1.0, 0.1), "flash": KernelTiming(2.0, 0.1)},
            {"kernel_version": get_kernel("xla").version}))
    path = tmp_path / "flash.json"
    done = run_cli("export", "-o", str(path), "--kernel", "flash", "--db", sqlite_db_url)
    assert done.returncode == 0, done.stderr
    [choice] = LookupTable.load(path).choices
    assert (choice.kernel, choice.config, choice.times_ms()) == ("flash", tuned, {"flash": 2.0})
    assert choice.provenance["method"] == "interpret"  # the tune's, as its entry says
    q = jax.ShapeDtypeStruct((1, 2, 256, 128), jnp.float32)
    with kernel.tables(path):
        jax.eval_shape(lambda q: kernel.flash_attention(q, q, q, causal=True), q)
        [(key, how)] = [(key, how) for key, how in kernel.resolution_sources().items()
                        if key[2] == problem]
    assert key[0] == "flash" and f"config {tuned.label('fwd')}" in how, how
    assert "kernel: chosen (exact choice in scoped table" in how, how
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"  # and it imports as it reads
    assert run_cli("import", str(path), "--db", fresh).returncode == 0
    with Store(fresh) as store:
        assert [c.choice.kernel for c in store.list_choices(limit=None)[0]] == ["flash"]

def _splash_study(url: str, problem: Problem, times: dict[int, float],
                  device: str = DEVICE) -> None:
    """A splash study of ``problem`` on ``device`` that measured ``block_kv_compute`` = each key
    of ``times`` (ms), every other field the default, and its winner stored as the entry."""
    import optuna
    from optuna.distributions import CategoricalDistribution

    from kernel import device_target, get_kernel

    name = f"splash study of {problem.label()}"
    study = optuna.create_study(study_name=name, storage=url)
    choices = CategoricalDistribution([128, 256, 512])
    for compute, ms in times.items():
        study.add_trial(optuna.trial.create_trial(
            params={"block_kv_compute": compute}, distributions={"block_kv_compute": choices},
            value=ms, user_attrs={"status": "ok"}))
    best = min(times, key=times.get)
    platform = "cpu" if device == "cpu" else "tpu"
    base = get_kernel("splash").default_config(problem, device_target(platform, device))
    with Store(url) as store:
        store.publish(TunedResult(device_kind=device, problem=problem, median_ms=times[best],
                                  config=base.replace(block_kv_compute=best), kernel="splash",
                                  study=name, timing="step_profile" if platform == "tpu" else
                                  "wallclock", trials=len(times)))


LOCAL = Problem(batch=2, q_heads=8, kv_heads=4, q_len=512, kv_len=512, head_dim=128,
                causal=True, window=(255, 0), mode="fwd_bwd")
GLOBAL = dataclasses.replace(LOCAL, window=None)


def test_export_maxtext_prints_the_sa_flags_of_one_tuned_shape(
        sqlite_db_url: str, tmp_path: Path) -> None:
    """Issue 55 item 7: MaxText takes splash's BlockSizes as sa_* flags, which the README
    printed with curl and jq; ``export --format maxtext`` prints them for the shape given.
    Issue 71 item 5: MaxText's local sliding-window layers read local_sa_* (a shape with a
    window), the others sa_*."""
    _splash_study(sqlite_db_url, LOCAL, {128: 2.0, 256: 1.0, 512: 1.5})
    done = run_cli("export", "--format", "maxtext", *problem_flags(LOCAL), "--db",
                   sqlite_db_url)
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    assert line.startswith("local_sa_block_q=512 local_sa_block_kv=512 "
                           "local_sa_block_kv_compute=256 ")
    assert "local_sa_use_fused_bwd_kernel=false" in line
    assert "local_sa_q_layout=HEAD_DIM_MINOR" in line
    assert all(flag.startswith("local_sa_") for flag in line.split())
    assert "None" not in line and "null" not in line
    path = tmp_path / "flags.txt"
    done = run_cli("export", "--format", "maxtext", *problem_flags(LOCAL), "-o", str(path),
                   "--db", sqlite_db_url)
    assert done.returncode == 0 and path.read_text() == line + "\n"
    other = run_cli("export", "--format", "maxtext", *problem_flags(GLOBAL), "--db",
                    sqlite_db_url)
    assert_clean_failure(other, 1, "no tuned splash entry for", "autotune tune --kernel splash")
    _splash_study(sqlite_db_url, GLOBAL, {128: 1.0, 512: 1.5})
    other = run_cli("export", "--format", "maxtext", *problem_flags(GLOBAL), "--db",
                    sqlite_db_url)
    assert other.returncode == 0, other.stderr
    assert other.stdout.startswith("sa_block_q=512 sa_block_kv=512 sa_block_kv_compute=128 ")


# A model's local and global attention layers, tuned as two problems.
SMALL_LOCAL, SMALL_GLOBAL = (Problem(batch=1, q_heads=1, kv_heads=1, q_len=256, kv_len=256,
                                     head_dim=128, causal=True, window=window)
                             for window in ((127, 0), None))


def _export_two_shapes(url: str, tmp_path: Path, local_times: dict[int, float],
                       full_times: dict[int, float]) -> subprocess.CompletedProcess[str]:
    """``export --format maxtext`` of ``SMALL_LOCAL`` and ``SMALL_GLOBAL`` on the CPU, their
    splash studies' trials timed as given (block_kv_compute -> ms); it must succeed."""
    _splash_study(url, SMALL_LOCAL, local_times, device="cpu")
    _splash_study(url, SMALL_GLOBAL, full_times, device="cpu")
    shapes = tmp_path / "model.yaml"
    shapes.write_text(json.dumps([SMALL_LOCAL.to_dict(), SMALL_GLOBAL.to_dict()]))
    done = run_cli("export", "--format", "maxtext", "--shapes", str(shapes), "--db", url,
                   env={"COLUMNS": "250"}, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def test_export_maxtext_of_two_shapes_confirms_the_config_against_maxtext_s_default(
        sqlite_db_url: str, tmp_path: Path) -> None:
    """Issue 62 item 9: a model's sa_* flags were chosen by single search-trial times (a config
    one search timed fastest was slower than the default when timed again). The candidates are
    now confirmed on this device against MaxText's default, interleaved as a tune confirms,
    and the flags printed are those of the config whose confirmed times sum lowest; the
    figures printed are the confirmed ones. Issue 71 item 5: so for each layer type, the
    global layer's config as sa_*, the local sliding-window layer's as local_sa_*."""
    from autotune.maxtext import sa_flags
    from kernel import get_kernel

    # The searches' single trials claim block_kv_compute=128 is far the fastest in both.
    done = _export_two_shapes(sqlite_db_url, tmp_path, {128: 0.001, 256: 1.0},
                              {128: 0.002, 256: 2.0})
    lines = done.stderr.splitlines()
    heads = [n for n, line in enumerate(lines) if "confirmed on cpu against MaxText's default: "
             "the median ms of 5 interleaved rounds a shape, timed by wallclock" in line]
    assert [lines[n].split(":")[0] for n in heads] == [
        "global attention layers (sa_*)", "local sliding-window layers (local_sa_*)"]
    assert lines[heads[0] + 1] == f"  shape 1: {SMALL_GLOBAL.label()}"
    assert lines[heads[1] + 1] == f"  shape 1: {SMALL_LOCAL.label()}"
    flags = []
    for head, end, problem, prefix in ((heads[0], heads[1], SMALL_GLOBAL, "sa_"),
                                       (heads[1], len(lines), SMALL_LOCAL, "local_sa_")):
        rows = [line.split() for line in lines[head:end] if line.startswith("      ")]
        assert len(rows) == 2  # the default, and the one candidate that is not the default
        assert all(float(row[1]) == float(row[0]) > 0.1 for row in rows)  # confirmed times
        [chosen] = [row for row in rows if row[-1] == "chosen"]
        default = get_kernel("splash").default_config(problem)
        flags.append(sa_flags(default if chosen[2:4] == ["MaxText's", "default"] else
                              default.replace(block_kv_compute=128), prefix))
        assert chosen is rows[0] or "MaxText's default stays" in "".join(lines[head:end])
    assert done.stdout.strip() == " ".join(flags)
    assert "not expressed" not in done.stderr  # each layer type has its own flags


def _fake_confirmation(monkeypatch: pytest.MonkeyPatch,
                       times: dict[Problem, dict[int, float]]) -> None:
    """The export's confirmation, in this process, timing each config of a problem at
    ``times[problem][its block_kv_compute]`` ms every round (no device time)."""
    import autotune.maxtext
    from autotune.measure import Timing

    class Timed:
        def __init__(self, problem: Problem, *_: object, **__: object) -> None:
            self.times = times[problem]

        def confirm(self, configs: list, rounds: int) -> dict:
            return {c: Timing((self.times[c.block_kv_compute],) * rounds) for c in configs}

        def close(self) -> None:
            pass

    monkeypatch.setattr(autotune.maxtext, "Measurer", Timed)


def _export_in_process(url: str, tmp_path: Path, problems: list[Problem]) -> Any:
    """``export --format maxtext --shapes`` of ``problems`` on ``url``, run in this process
    (where ``_fake_confirmation`` reaches); it must succeed."""
    from typer.testing import CliRunner

    from autotune.cli import app

    shapes = tmp_path / "model.yaml"
    shapes.write_text(json.dumps([p.to_dict() for p in problems]))
    done = CliRunner().invoke(app, ["export", "--format", "maxtext", "--shapes", str(shapes),
                                    "--db", url], env={"COLUMNS": "250"})
    assert done.exit_code == 0, (done.stdout, done.stderr)
    return done


def test_export_maxtext_gives_the_local_sliding_window_layers_their_own_flags(
        sqlite_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 71 item 5: MaxText's local sliding-window layers read local_sa_* flags (since
    2026-06; each inherits its sa_* flag when unset). A local layer faster at
    block_kv_compute=128 and a global one at MaxText's default (256 at q256) get each its own:
    sa_* the default, local_sa_* 128. Before: one sa_* set for both, the default (the two
    shapes' sums tie)."""
    from autotune.maxtext import sa_flags
    from kernel import get_kernel

    _splash_study(sqlite_db_url, SMALL_LOCAL, {128: 1.0, 256: 2.0}, device="cpu")
    _splash_study(sqlite_db_url, SMALL_GLOBAL, {128: 2.0, 256: 1.0}, device="cpu")
    _fake_confirmation(monkeypatch, {SMALL_LOCAL: {128: 1.0, 256: 2.0},
                                     SMALL_GLOBAL: {128: 2.0, 256: 1.0}})
    done = _export_in_process(sqlite_db_url, tmp_path, [SMALL_LOCAL, SMALL_GLOBAL])
    splash = get_kernel("splash")
    local = splash.default_config(SMALL_LOCAL).replace(block_kv_compute=128)
    assert done.stdout.split() == [*sa_flags(splash.default_config(SMALL_GLOBAL)).split(),
                                   *("local_" + flag for flag in sa_flags(local).split())]
    chosen = [line for line in done.stderr.splitlines() if line.endswith("<- chosen")]
    assert len(chosen) == 2 and "MaxText's default" in chosen[0], chosen
    assert local.label(SMALL_LOCAL.mode) in chosen[1], chosen


def test_export_maxtext_names_the_per_layer_configs_its_one_flag_set_cannot_express(
        sqlite_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 71 item 5: two global layers tuned as different problems, with different
    winners: MaxText has one set of sa_* flags for all its global layers, so the export says
    which shape's own best config the flags could not express, and why; no local_sa_* flags
    (the model has no local layer)."""
    other = dataclasses.replace(SMALL_GLOBAL, batch=2)
    _splash_study(sqlite_db_url, SMALL_GLOBAL, {128: 1.0, 256: 3.0}, device="cpu")
    _splash_study(sqlite_db_url, other, {128: 2.0, 256: 1.0}, device="cpu")
    _fake_confirmation(monkeypatch, {SMALL_GLOBAL: {128: 1.0, 256: 3.0},
                                     other: {128: 2.0, 256: 1.0}})
    done = _export_in_process(sqlite_db_url, tmp_path, [SMALL_GLOBAL, other])
    assert "sa_block_kv_compute=128" in done.stdout.split()  # 128 sums 3.0, the default 4.0
    assert not any(flag.startswith("local_sa_") for flag in done.stdout.split())
    [line] = [line for line in done.stderr.splitlines() if line.startswith("not expressed")]
    assert "one set of sa_* flags for all its global attention layers" in line
    assert "(tuned alone: shape 2 q256 kv256/256 " in line


def test_export_maxtext_of_two_shapes_measures_on_their_device_kind(
        sqlite_db_url: str, tmp_path: Path) -> None:
    """Issue 62 item 9: the shared config is confirmed by measuring it, so entries tuned on
    another device kind are refused, naming where to export them."""
    _splash_study(sqlite_db_url, LOCAL, {128: 1.0, 256: 1.4, 512: 1.1})
    _splash_study(sqlite_db_url, GLOBAL, {128: 3.0, 512: 2.5})
    shapes = tmp_path / "model.yaml"
    shapes.write_text(json.dumps([LOCAL.to_dict(), GLOBAL.to_dict()]))
    done = run_cli("export", "--format", "maxtext", "--shapes", str(shapes), "--db",
                   sqlite_db_url, env={"COLUMNS": "250"})
    assert_clean_failure(done, 1, "this machine's device is 'cpu', not 'TPU v5 lite': export "
                                  "on a 'TPU v5 lite' machine")
    assert done.stdout == ""


def test_export_refuses_a_shape_without_the_maxtext_format(sqlite_db_url: str,
                                                           tmp_path: Path) -> None:
    seed(sqlite_db_url)
    done = run_cli("export", "-o", str(tmp_path / "t.json"), "--q-len", "512", "--db",
                   sqlite_db_url, env={"COLUMNS": "250"})
    assert_clean_failure(done, 2, "a table holds every tuned shape; --q-len pick(s) the shape")
    done = run_cli("export", "--db", sqlite_db_url, env={"COLUMNS": "250"})
    assert_clean_failure(done, 2, "give the file to write the table to")
