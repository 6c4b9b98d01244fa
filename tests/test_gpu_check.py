"""``bench/chip/gpu_check.py --interpret``: the GPU check's CPU dry run honours its budget and
writes the JSON and HTML a Hopper GPU would (pallas_gpu interpreted stands in for mosaic_gpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_writes_every_section_within_its_budget(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench/chip/gpu_check.py"), "--interpret", "--seqs", "128",
         "--modes", "fwd", "--trials", "2", "--rounds", "1", "--landscape-seq", "128",
         "--budget-s", "25", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "interpret (CPU dry run)" and report["tuned_kernel"] == "pallas_gpu"
    assert report["elapsed_s"] < 25 + 60  # the budget, plus at most the step that crossed it
    [checked] = report["problems"]
    rows = {row["name"]: row for row in checked["contenders"]}
    assert {"pallas_gpu tuned", "pallas_gpu default", "xla"} <= rows.keys()
    assert rows["mosaic_gpu"]["error"] == rows["cudnn"]["error"] == "runs on gpu, not cpu"
    assert checked["winner"] in rows and rows["xla"]["median_ms"] > 0
    smem = report["smem"]
    assert smem["rows"] and all(r["predicted_fit"] == (r["estimate_kib"] <= 227)
                                for r in smem["rows"])
    assert smem["false_admits"] == 0 and "not compiled" in smem["note"]
    assert "<h2>Shared-memory estimate" in (tmp_path / "gpu_check.html").read_text()
