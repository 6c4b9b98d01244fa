"""``bench/chip/step_time.py --interpret`` (issue 60, item 1): the chip check of the tuner's figure
against the wall time of back-to-back calls runs end to end on this CPU and writes its JSON:
a row per kernel and problem, measured or skipped, with the ratio and the kernels' part."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_step_time_writes_a_row_per_kernel_and_problem(tmp_path: Path) -> None:
    out = tmp_path / "step-time.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench/chip/step_time.py"), "--interpret", "--problems",
         "2", "--kernels", "xla,cudnn", "--rounds", "4", "--timing", "step_profile",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    xla, cudnn = report["rows"]
    assert cudnn == {"problem": xla["problem"], "kernel": "cudnn",
                     "skipped": "runs on gpu, not cpu"}
    assert xla["timing"] == "step_profile" and xla["tuner_ms"] > 0 and xla["wall_ms"] > 0
    assert xla["tuner_over_wall"] == pytest.approx(xla["tuner_ms"] / xla["wall_ms"], rel=1e-2)
    # xla names no pallas_call: no kernels' part to show.
    assert xla["kernels_ms"] is None and xla["kernels_share"] is None
    assert report["all_within_goal"] == xla["within_goal"]
