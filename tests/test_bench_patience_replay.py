"""bench/patience_replay.py: where a patience stops a replayed search, and what it costs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.patience_replay import stopped_at

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("curve", "patience", "measured"), [
    ([5.0, 4.0, 4.0, 4.0, 4.0, 4.0], 2, 4),  # the 2nd config after the last new best (index 1)
    ([5.0, 4.0, 4.0, 3.0, 3.0, 3.0], 2, 6),  # a new best at index 3 restarts the count
    ([None, None, 5.0, 5.0], 3, 4),  # no best yet counts from the start, never past the end
    ([5.0, 4.0, 3.0], 1, 3)])
def test_a_patience_stops_after_that_many_configs_without_a_new_best(
        curve: list, patience: int, measured: int) -> None:
    assert stopped_at(curve, patience) == measured


def test_a_replay_reports_the_configs_a_patience_saves_and_the_score_it_loses(
        tmp_path: Path) -> None:
    """A real replay of our searcher on one measured landscape (pnpoly on an RTX 2080 Ti):
    a shorter patience never measures more configs nor loses less than a longer one, and a
    patience as long as the budget measures all of it and loses nothing."""
    folder = tmp_path / "lands"
    folder.mkdir()
    (folder / "pnpoly.json.gz").symlink_to(ROOT / "bench/landscapes/pnpoly-RTX_2080_Ti.json.gz")
    out = tmp_path / "patience.json"
    subprocess.run([sys.executable, str(ROOT / "bench/patience_replay.py"), "--landscapes",
                    str(folder), "--seeds", "2", "--budget", "16", "--patience", "3,16",
                    "--out", str(out)], check=True, capture_output=True, timeout=600, cwd=ROOT)
    short, whole = (json.loads(out.read_text())["patience"][p] for p in ("3", "16"))
    assert whole["measured_mean"] == 16 and whole["score_lost_mean"] == 0
    assert short["measured_mean"] < 16
    assert short["score_lost_mean"] >= whole["score_lost_mean"]
    assert short["runs"] == whole["runs"] == 2
