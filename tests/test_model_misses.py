"""kernel.untuned(): the problems a process ran on a default config, with the reason; the
AUTOTUNE_RECORD_MISSES file, appended at exit by several processes at once."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import kernel
from autotune.problem_options import load_shapes
from kernel import LookupTable, Problem, TableEntry, get_kernel
from kernel.misses import ILLEGAL, NO_ENTRY, STALE, Borrowed
from kernel.resolve import ResolverSettings, reset_resolver
from kernel.shapesfile import MAX_SHAPES_BYTES, append_shapes

ROOT = Path(__file__).resolve().parents[1]


def problem(q_len: int, mode: str = "fwd") -> Problem:
    """Batch 3: no other test's problem (the misses are the process's)."""
    return Problem(batch=3, q_heads=1, kv_heads=1, q_len=q_len, kv_len=q_len, head_dim=128,
                   dtype="float32", mode=mode)


def trace(p: Problem, differentiated: bool) -> None:
    """Traces one flash_attention call of ``p``'s shape (abstractly: nothing runs)."""
    x = jax.ShapeDtypeStruct((p.batch, p.q_heads, p.q_len, p.head_dim), jnp.float32)

    def attend(q):
        return kernel.flash_attention(q, q, q).sum()

    jax.eval_shape(jax.grad(attend) if differentiated else attend, x)


def write_table(path: Path, entries: list[TableEntry], kernel_version: str) -> Path:
    table = LookupTable(kernel="flash", kernel_version=kernel_version, device_kind="cpu",
                        entries=tuple(entries))
    path.write_text(json.dumps(table.to_dict()))
    return path


def test_untuned_names_each_miss_once_with_its_reason(tmp_path):
    flash = get_kernel("flash")
    stale, illegal, tuned, missing = (problem(256 + 128 * i) for i in range(4))
    # block_q 1024 is larger than the illegal problem's 640 queries
    broken = flash.default_config(illegal).replace(block_q=1024)
    current = write_table(tmp_path / "current.json", [
        TableEntry(illegal, broken), TableEntry(tuned, flash.default_config(tuned))],
        flash.version)
    old = write_table(tmp_path / "old.json", [TableEntry(stale, flash.default_config(stale))],
                      "0")
    before = kernel.untuned()
    reset_resolver(ResolverSettings(table_paths=(str(current),)))
    try:
        for p in (illegal, tuned, missing, missing):
            trace(p, differentiated=False)
        reset_resolver(ResolverSettings(table_paths=(str(old),)))
        trace(stale, differentiated=False)
    finally:
        reset_resolver(ResolverSettings())
    new = [miss for miss in kernel.untuned() if miss not in before]
    assert [(m.problem, m.kernel, m.reason) for m in new] == [
        (illegal, "flash", ILLEGAL), (missing, "flash", NO_ENTRY), (stale, "flash", STALE)]
    assert "illegal here" in new[0].detail


def test_a_differentiated_call_misses_in_fwd_bwd_only():
    """Its primal, traced first under jax.checkpoint, never runs: no fwd miss."""
    p = problem(1152)
    before = kernel.untuned()
    x = jax.ShapeDtypeStruct((3, 1, 1152, 128), jnp.float32)
    jax.eval_shape(jax.grad(jax.checkpoint(lambda q: kernel.flash_attention(q, q, q).sum())), x)
    new = [miss.problem for miss in kernel.untuned() if miss not in before]
    assert new == [dataclasses.replace(p, mode="fwd_bwd")]


def test_a_nearest_entry_s_config_is_recorded_as_borrowed_apart_from_the_misses(tmp_path):
    """Issue 62 item 10: a problem served by the nearest entry (a training run whose sequence
    length changed) was neither in untuned() nor anywhere else, so nothing said to tune it."""
    flash = get_kernel("flash")
    tuned, near, far = problem(1536), problem(3072), dataclasses.replace(problem(3072),
                                                                          head_dim=64)
    table = write_table(tmp_path / "t.json", [TableEntry(tuned, flash.default_config(tuned))],
                        flash.version)
    before_missed, before_lent = kernel.untuned(), kernel.borrowed()
    reset_resolver(ResolverSettings(table_paths=(str(table),)))
    try:
        for p in (tuned, near, far):
            trace(p, differentiated=False)
    finally:
        reset_resolver(ResolverSettings())
    lent = [b for b in kernel.borrowed() if b not in before_lent]
    assert lent == [Borrowed(near, "flash", "table", tuned)]
    assert lent[0].note() == f"borrowed from {tuned.label()} (the nearest table entry)"
    assert [m.problem for m in kernel.untuned() if m not in before_missed] == [far]


BORROWER = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    import kernel

    for q_len, head_dim in ((256, 128), (256, 64)):
        x = jax.ShapeDtypeStruct((1, 1, q_len, head_dim), jnp.float32)
        jax.eval_shape(jax.grad(lambda q: kernel.flash_attention(q, q, q).sum()), x)
""")


def test_the_misses_file_marks_the_borrowers_and_tune_names_them(tmp_path):
    """Issue 62 item 10: AUTOTUNE_RECORD_MISSES writes the borrowers too, each line marked
    with what it borrowed from; `autotune tune --shapes` on that file says so and tunes them."""
    from conftest import run_cli

    flash = get_kernel("flash")
    tuned = Problem(batch=1, q_heads=1, kv_heads=1, q_len=128, kv_len=128, head_dim=128,
                    dtype="float32", mode="fwd_bwd")
    table = write_table(tmp_path / "t.json", [TableEntry(tuned, flash.default_config(tuned))],
                        flash.version)
    path = tmp_path / "misses.yaml"
    env = {**os.environ, "AUTOTUNE_RECORD_MISSES": str(path), "AUTOTUNE_TABLE": str(table),
           "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", BORROWER], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    missed, borrower = load_shapes(path)
    assert (missed.head_dim, borrower.q_len, borrower.head_dim) == (64, 256, 128)
    header, missed_line, borrower_line = path.read_text().splitlines()
    assert borrower_line.endswith(f"}}  # borrowed from {tuned.label()} (the nearest table "
                                  "entry)")
    assert "#" not in missed_line
    assert append_shapes(path, [missed, borrower], {borrower: "another note"}) == 0  # known
    path.write_text(f"{header}\n{borrower_line}\n")  # the borrower alone: one quick tune
    done = run_cli("tune", "--shapes", str(path), "--kernel", "flash", "--trials", "1",
                   "--db", f"sqlite:///{tmp_path / 'tune.db'}", timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"note: {path}: 1 problem(s) ran on a config borrowed from the nearest tuned " \
           f"problem (borrowed from {tuned.label()} (the nearest table entry)): tuning gives " \
           "each its own" in " ".join(done.stderr.split())
    assert "published: inserted" in " ".join(done.stdout.split())


RECORDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import jax, jax.numpy as jnp
    import kernel

    for q_len in map(int, sys.argv[2:]):
        x = jax.ShapeDtypeStruct((1, 1, q_len, 128), jnp.float32)
        jax.eval_shape(jax.grad(lambda q: kernel.flash_attention(q, q, q).sum()), x)
    Path(sys.argv[1] + ".ready." + sys.argv[2]).touch()
    while len(list(Path(sys.argv[1]).parent.glob("*.ready.*"))) < 2:  # exit together
        time.sleep(0.01)
""")


def test_two_processes_record_their_misses_in_one_file_at_exit(tmp_path):
    path = tmp_path / "misses.yaml"
    env = {**os.environ, "AUTOTUNE_RECORD_MISSES": str(path), "PYTHONPATH": str(ROOT),
           "JAX_PLATFORMS": "cpu"}
    runs = [subprocess.Popen([sys.executable, "-c", RECORDER, str(path), *lens], env=env,
                             stderr=subprocess.PIPE, text=True)
            for lens in (["128", "256"], ["384", "256"])]
    for run in runs:
        _, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
    assert sorted(p.q_len for p in load_shapes(path)) == [128, 256, 384]
    assert {p.mode for p in load_shapes(path)} == {"fwd_bwd"}


APPENDER = textwrap.dedent("""
    import sys
    from kernel import Problem
    from kernel.shapesfile import append_shapes

    for i in range(int(sys.argv[2]), int(sys.argv[2]) + 40):
        append_shapes(sys.argv[1], [Problem(1, 1, 1, 128 * (1 + i % 60), 128, 128)])
""")


def test_concurrent_appends_keep_every_problem_once_and_every_line_whole(tmp_path):
    path = tmp_path / "shapes.yaml"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = [subprocess.Popen([sys.executable, "-c", APPENDER, str(path), start], env=env,
                             stderr=subprocess.PIPE, text=True) for start in ("0", "20", "40")]
    for run in runs:
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
    lines = path.read_text().splitlines()
    assert lines[0].startswith("#") and all(line.startswith("- {") for line in lines[1:])
    assert sorted(p.q_len for p in load_shapes(path)) == [128 * n for n in range(1, 61)]


ONE_MISS_UNDER_2_GIB = textwrap.dedent("""
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # the old read hit it at once
    from kernel import Problem
    from kernel.misses import note

    note(object(), Problem(1, 1, 1, 128, 128, 128), "flash", "default", "no entry", True)
""")


@pytest.mark.parametrize("device, logged", [("/dev/full", "No space left on device"),
                                            ("/dev/zero", None)])
def test_recording_into_a_device_writes_without_reading_it(device, logged):
    """Issue 55 item 8: the misses file was read whole before appending, so /dev/zero or
    /dev/full exhausted memory at exit; a device is written to, never read."""
    env = {**os.environ, "AUTOTUNE_RECORD_MISSES": device, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", ONE_MISS_UNDER_2_GIB], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert ("cannot record" in done.stderr) == bool(logged), done.stderr
    assert logged is None or logged in done.stderr


def test_a_shapes_file_past_the_bound_is_not_read_or_appended(tmp_path):
    path = tmp_path / "huge.yaml"
    with path.open("wb") as file:
        file.truncate(MAX_SHAPES_BYTES + 1)  # sparse: no disk used
    with pytest.raises(OSError, match="MiB a shapes file may have") as error:
        append_shapes(path, [problem(128)])
    assert error.value.errno == errno.EFBIG
    assert path.stat().st_size == MAX_SHAPES_BYTES + 1
