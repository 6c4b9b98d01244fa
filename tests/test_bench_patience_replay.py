"""bench/search/patience_replay.py: what a patience costs a replayed search (the stop itself is the
search's own, tested in test_tune_patience.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_replay_reports_the_configs_a_patience_saves_and_the_score_it_loses(
        tmp_path: Path) -> None:
    """A real replay of our searcher on one measured landscape (pnpoly on an RTX 2080 Ti):
    a shorter patience never measures more configs nor loses less than a longer one, and a
    patience as long as the budget measures all of it and loses nothing."""
    folder = tmp_path / "lands"
    folder.mkdir()
    (folder / "pnpoly.json.gz").symlink_to(
        ROOT / "bench/search/landscapes/pnpoly-RTX_2080_Ti.json.gz")
    out = tmp_path / "patience.json"
    subprocess.run([sys.executable, str(ROOT / "bench/search/patience_replay.py"), "--landscapes",
                    str(folder), "--seeds", "2", "--budget", "16", "--patience", "3,16",
                    "--out", str(out)], check=True, capture_output=True, timeout=600, cwd=ROOT)
    short, whole = (json.loads(out.read_text())["patience"][p] for p in ("3", "16"))
    assert whole["measured_mean"] == 16 and whole["score_lost_mean"] == 0
    assert short["measured_mean"] < 16
    assert short["score_lost_mean"] >= whole["score_lost_mean"]
    assert short["runs"] == whole["runs"] == 2
