"""``autotune replay`` on a synthetic landscape and on a real one (bench/landscapes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autotune.cli import app
from autotune.landscape import load_landscape
from tests.test_search import write_landscape

REAL = Path(__file__).resolve().parent.parent / "bench" / "landscapes" / "convolution-A100.json.gz"


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


def test_replay_bad_input_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(app, ["replay", str(tmp_path / "missing.json.gz")])
    assert result.exit_code == 2 and "does not exist" in result.output
    (tmp_path / "bad.json.gz").write_text("not gzip")
    result = CliRunner().invoke(app, ["replay", str(tmp_path / "bad.json.gz")])
    assert result.exit_code == 2 and "not gzip-compressed JSON" in result.output
    path = write_landscape(tmp_path / "synthetic.json.gz")
    result = CliRunner().invoke(app, ["replay", str(path), "--sampler", "annealing"])
    assert result.exit_code == 2 and "unknown sampler" in result.output


def test_replay_a_real_landscape_measures_only_recorded_configs():
    land = load_landscape(REAL)
    out = _replay(str(REAL), "--budget", "30", "--seed", "1")
    assert out["measured"] == 30
    assert land.key(out["best_config"]) in land.records
    assert out["best_time_ms"] == land.records[land.key(out["best_config"])]["time_ms"]
    assert 0 < out["score"] <= 1
    assert all(b <= a for a, b in zip(out["curve"], out["curve"][1:]) if a is not None)
