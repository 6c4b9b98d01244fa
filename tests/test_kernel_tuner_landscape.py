"""``bench/search/kernel_tuner_landscape.py``: a Kernel Tuner cache file becomes a landscape that
``autotune replay`` reads, and a file that is not such a cache is refused in one line."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from autotune.landscape import load_landscape

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench/search/kernel_tuner_landscape.py"


def _cache() -> dict[str, Any]:
    """A small cache in Kernel Tuner's format: two parameters, each kind of entry."""
    times = {(16, 1): 2.0, (16, 2): "RuntimeFailedConfig", (32, 1): 1.0,
             (32, 2): "CompilationFailedConfig", (64, 1): "InvalidConfig", (64, 2): 4.0}
    entries = {f"{b},{t}": {"block": b, "tile": t, "time": time, "compile_time": 1500.0,
                            "benchmark_time": 20.0} for (b, t), time in times.items()}
    return {"tune_params": {"block": [16, 32, 64], "tile": [1, 2]},
            "tune_params_keys": ["block", "tile"], "kernel_name": "toy", "device_name": "",
            "problem_size": [1024], "cache": entries}


def _python(*args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], check=False, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _convert(cache_file: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return _python(str(SCRIPT), str(cache_file), "-o", str(out), *extra, timeout=120)


def test_a_cache_becomes_a_landscape_that_replays(tmp_path: Path) -> None:
    cache_file = tmp_path / "toy.json.gz"
    cache_file.write_bytes(gzip.compress(json.dumps(_cache()).encode()))
    out = tmp_path / "toy-X1.json.gz"
    done = _convert(cache_file, out, "--device", "X1")
    assert done.returncode == 0, done.stderr
    land = load_landscape(out)
    assert land.name == "toy-X1"
    statuses = {key: record["status"] for key, record in land.records.items()}
    # InvalidConfig has no record (illegal); the two failures are legal and cost a measurement.
    assert statuses == {(16, 1): "ok", (16, 2): "runtime_error", (32, 1): "ok",
                        (32, 2): "compile_error", (64, 2): "ok"}
    assert land.optimum_ms == 1.0
    assert land.records[(16, 1)]["compile_s"] == 1.5
    assert land.records[(16, 1)]["benchmark_s"] == 0.02
    assert not land.space.is_legal({"block": 64, "tile": 1})
    document = json.loads(gzip.decompress(out.read_bytes()))
    assert document["device"] == "X1" and document["kernel"] == "toy"

    replay = _python("-m", "autotune", "replay", str(out), "--budget", "5", "--json", timeout=300)
    assert replay.returncode == 0, replay.stderr[-2000:]
    result = json.loads(replay.stdout)
    # Five configs measure the whole legal space, and the replay knows it.
    assert result["score"] == 1.0 and result["best_config"] == {"block": 32, "tile": 1}
    assert result["measured"] == 5


def test_a_file_that_is_not_a_cache_is_refused_in_one_line(tmp_path: Path) -> None:
    unknown = _cache()
    unknown["cache"]["16,1"]["time"] = "TimeoutConfig"
    lacking = _cache()
    del lacking["cache"]["32,1"]["tile"]
    whole = gzip.compress(json.dumps(_cache()).encode())
    cases = {
        "missing.json": (None, "No such file"),
        "truncated.json.gz": (whole[:len(whole) // 2], "Compressed file ended"),
        "text.json": (b"not json", "not a JSON file"),
        "other.json": (json.dumps({"a": 1}).encode(), "not a Kernel Tuner cache file: it lacks"),
        "unknown.json": (json.dumps(unknown).encode(), "unknown cache time 'TimeoutConfig'"),
        "lacking.json": (json.dumps(lacking).encode(), "lacks its time or a parameter"),
    }
    for name, (content, message) in cases.items():
        cache_file = tmp_path / name
        if content is not None:
            cache_file.write_bytes(content)
        out = tmp_path / "out.json.gz"
        done = _convert(cache_file, out)
        assert done.returncode == 1, (name, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr, (name, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, (name, done.stderr)
        assert not out.exists(), name
