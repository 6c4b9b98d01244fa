"""``autotune replay`` on a synthetic landscape and on a real one (bench/search/landscapes)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.landscape import MAX_LANDSCAPE_BYTES, load_landscape
from tests.test_search import write_landscape

LANDSCAPES = Path(__file__).resolve().parent.parent / "bench/search/landscapes"
REAL = LANDSCAPES / "convolution-A100.json.gz"
OWN = sorted((LANDSCAPES / "own").glob("*.json.gz"))  # measured by us (see their README)


def _replay(*args: str) -> dict:
    result = CliRunner().invoke(app, ["replay", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_replay_reports_best_optimum_score_and_curve(tmp_path):
    path = write_landscape(tmp_path / "synthetic.json.gz")
    land = load_landscape(path)
    out = _replay(str(path), "--budget", "15", "--seed", "4")
    assert out["measured"] == 15 == len(out["curve"])
    assert out["optimum_ms"] == land.optimum_ms
    assert out["best_time_ms"] == min(v for v in out["curve"] if v is not None)
    assert out["score"] == pytest.approx(land.optimum_ms / out["best_time_ms"])
    assert land.key(out["best_config"]) in land.records


def test_replay_grid_with_full_budget_scores_one_and_resumes_from_a_database(tmp_path):
    path = write_landscape(tmp_path / "synthetic.json.gz")
    legal = len(load_landscape(path).records)
    db = f"sqlite:///{tmp_path / 'replay.db'}"
    first = _replay(str(path), "--budget", "10", "--sampler", "grid", "--db", db)
    out = _replay(str(path), "--budget", str(legal), "--sampler", "grid", "--db", db)
    assert out["curve"][:10] == first["curve"]
    assert out["score"] == 1.0 and out["measured"] == legal


def test_replay_table_output(tmp_path):
    path = write_landscape(tmp_path / "synthetic.json.gz")
    result = CliRunner().invoke(app, ["replay", str(path), "--budget", "5"])
    assert result.exit_code == 0, result.output
    assert "best_time_ms" in result.output and "best-so-far curve" in result.output


def _other_device(tmp_path: Path, name: str = "other") -> Path:
    """The synthetic landscape measured on "another device": same space, other times (fastest
    at b=1), and one config that is illegal on the first device."""
    with gzip.open(write_landscape(tmp_path / "base.json.gz"), "rt") as f:
        doc = json.load(f)
    doc["name"] = name
    for record in doc["records"]:
        if record["status"] == "ok":
            record["time_ms"] = 1.0 + record["config"]["b"] + 0.1 * record["config"]["a"]
    doc["records"].append({"config": {"a": 16, "b": 4, "c": 0, "d": 7}, "status": "ok",
                           "time_ms": 0.5})  # the fastest here, illegal there (a*b > 32)
    path = tmp_path / f"{name}.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return path


def test_replay_warm_from_measures_the_other_landscapes_best_legal_configs_first(tmp_path):
    """The seeds are other's fastest configs legal here, skipping those one step from a seed
    already taken (near-duplicates), and they are measured first."""
    path = write_landscape(tmp_path / "synthetic.json.gz")
    land, other = load_landscape(path), load_landscape(_other_device(tmp_path))
    out = _replay(str(path), "--budget", "6", "--warm-from", str(tmp_path / "other.json.gz"),
                  "--warm-top", "2")
    seeds = [land.key(c) for c in out["warm_seeds"]]
    fastest = [other.key(c) for c in other.best_configs(len(other.records))]
    # other's fastest config is illegal here; its next one is the first seed.
    assert fastest[0] not in land.records and seeds[0] == fastest[1]
    near_first = {land.key(c) for c in land.space.neighbours(out["warm_seeds"][0])}
    # The second seed is the fastest legal config left that is not one step from the first,
    # and other's second-fastest legal config is one step from it: it was skipped.
    assert fastest[2] in near_first and seeds[1] not in near_first
    assert all(k in near_first or k not in land.records
               for k in fastest[2:fastest.index(seeds[1])])
    first = [land.measure(c).value for c in out["warm_seeds"]]
    assert out["curve"][:2] == [first[0], min(first)]
    cold = _replay(str(path), "--budget", "6")
    assert cold["warm_seeds"] == []


def test_replay_warm_start_needs_a_landscape_of_the_same_kernel(tmp_path):
    path = write_landscape(tmp_path / "synthetic.json.gz")
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    doc["params"] = {"x": [1, 2]}
    doc["records"] = [{"config": {"x": 1}, "status": "ok", "time_ms": 1.0}]
    with gzip.open(tmp_path / "unrelated.json.gz", "wt") as f:
        json.dump(doc, f)
    result = CliRunner().invoke(app, ["replay", str(path), "--warm-from",
                                      str(tmp_path / "unrelated.json.gz")])
    assert result.exit_code == 2 and "same kernel" in result.output
    result = CliRunner().invoke(app, ["replay", str(path), "--warm-top", "2"])
    assert result.exit_code == 2 and "--warm-top needs --warm-from" in result.output


def test_replay_bad_input_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(app, ["replay", str(tmp_path / "missing.json.gz")])
    assert result.exit_code == 2 and "does not exist" in result.output
    (tmp_path / "bad.json.gz").write_text("not gzip")
    result = CliRunner().invoke(app, ["replay", str(tmp_path / "bad.json.gz")])
    assert result.exit_code == 2 and "not gzip-compressed JSON" in result.output
    path = write_landscape(tmp_path / "synthetic.json.gz")
    result = CliRunner().invoke(app, ["replay", str(path), "--sampler", "annealing"])
    assert result.exit_code == 2 and "unknown sampler" in result.output


@pytest.mark.parametrize("path", [REAL, *OWN], ids=lambda p: p.name.split(".")[0])
def test_replay_a_real_landscape_measures_only_recorded_configs(path):
    land = load_landscape(path)
    out = _replay(str(path), "--budget", "30", "--seed", "1")
    assert out["measured"] == 30
    assert land.key(out["best_config"]) in land.records
    assert out["best_time_ms"] == land.records[land.key(out["best_config"])]["time_ms"]
    assert 0 < out["score"] <= 1
    assert all(b <= a for a, b in zip(out["curve"], out["curve"][1:]) if a is not None)


def _write_doc(path: Path, doc: dict) -> Path:
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return path


@pytest.mark.parametrize("sampler", ["tpe", "random", "grid", "plain-tpe"])
def test_replay_of_a_one_config_space_ends_exhausted(tmp_path, sampler):
    """Optuna fills single-valued parameters itself, so no sampler is asked for a second
    config: the search must see the space exhausted on its own."""
    path = _write_doc(tmp_path / "one.json.gz", {"params": {"a": [1], "b": [2]}, "records": [
        {"config": {"a": 1, "b": 2}, "status": "ok", "time_ms": 1.0}]})
    out = _replay(str(path), "--budget", "3", "--sampler", sampler)
    assert (out["measured"], out["stop_reason"], out["score"]) == (1, "exhausted", 1.0)


def test_replay_refuses_a_study_of_another_landscape(tmp_path):
    path = write_landscape(tmp_path / "synthetic.json.gz")
    other = _other_device(tmp_path)
    db = f"sqlite:///{tmp_path / 'replay.db'}"
    first = _replay(str(path), "--budget", "4", "--db", db, "--study", "shared")
    result = CliRunner().invoke(app, ["replay", str(other), "--budget", "6", "--db", db,
                                      "--study", "shared"])
    assert result.exit_code == 2 and "holds a search of another landscape" in result.output
    again = _replay(str(path), "--budget", "4", "--db", db, "--study", "shared")
    assert again["curve"] == first["curve"]  # nothing of the other landscape was written


@pytest.mark.parametrize("db, status, message", [
    ("notaurl", 2, "cannot parse database URL"),
    ("postgresql://tuner:s3cret@host:notaport/db", 2,
     "cannot parse database URL 'postgresql://tuner:***@host:notaport/db'"),
    ("sqlite:///replay.db?timeout=abc", 2, "a bad argument in database URL"),
    ("sqlite:////nonexistent-dir/replay.db", 1, "unable to open database file"),
])
def test_replay_names_a_bad_database(tmp_path, db, status, message):
    path = write_landscape(tmp_path / "synthetic.json.gz")
    result = CliRunner().invoke(app, ["replay", str(path), "--db", db])
    assert result.exit_code == status and message in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("params, time_ms, message", [
    ({"a": 5}, 1.0, "parameter 'a' must be a non-empty list"),
    ({"a": [[1], 2]}, 1.0, "parameter 'a' must be a non-empty list"),
    ({"a": [1, 1]}, 1.0, "repeats a value"),
    ({"a": [1]}, 0, "time_ms is not a positive number"),
    ({"a": [1]}, True, "time_ms is not a positive number"),
    ({"a": [1]}, float("nan"), "time_ms is not a positive number"),
])
def test_replay_refuses_a_malformed_landscape(tmp_path, params, time_ms, message):
    path = _write_doc(tmp_path / "bad.json.gz", {"params": params, "records": [
        {"config": {"a": 1}, "status": "ok", "time_ms": time_ms}]})
    result = CliRunner().invoke(app, ["replay", str(path)])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.parametrize("sampler", ["tpe", "random", "grid"])
def test_replay_of_a_sparse_landscape_walks_its_records(tmp_path, sampler):
    """2 records among 20^8 = 2.56e10 declared combinations: the legal configs are the records,
    drawn and listed from them (enumerating the combinations would take hours)."""
    params = {f"p{i}": list(range(20)) for i in range(8)}
    records = [{"config": dict.fromkeys(params, value), "status": "ok", "time_ms": 1.0 + value}
               for value in (0, 1)]
    path = _write_doc(tmp_path / "sparse.json.gz", {"params": params, "records": records})
    out = _replay(str(path), "--budget", "5", "--sampler", sampler)
    assert (out["measured"], out["stop_reason"], out["best_time_ms"]) == (2, "exhausted", 1.0)


def test_replay_refuses_a_landscape_that_inflates_past_the_limit(tmp_path):
    """A gzip bomb (a few hundred KB inflating past MAX_LANDSCAPE_BYTES) is refused in one
    line, read in chunks up to the limit, never whole."""
    path = tmp_path / "bomb.json.gz"
    zeros = bytes(1 << 20)
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(b'{"params": {"a": [1]}, "records": [], "pad": "')
        for _ in range((MAX_LANDSCAPE_BYTES >> 20) + 1):
            f.write(zeros)
    assert path.stat().st_size < 2 << 20
    result = CliRunner().invoke(app, ["replay", str(path)])
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert "decompresses to more than 256 MiB" in line
