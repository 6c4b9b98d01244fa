"""``bench/chip/context_parallel.py --interpret``: on one CPU device the context-parallel step and
the plain call's get a time each, the same gradients bit for bit, and resolve one problem."""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_kernel_tuner_landscape import ROOT, _python


def test_the_one_device_ring_runs_the_plain_calls_step(tmp_path: Path) -> None:
    out = tmp_path / "context-parallel.json"
    done = _python(str(ROOT / "bench" / "chip" / "context_parallel.py"), "--interpret", "--rounds", "2",
                   "--calls", "1", "--out", str(out), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert sorted(report["rows"]) == ["context_parallel", "plain"]
    assert all(0 < row["median_ms"] < float("inf") for row in report["rows"].values())
    assert report["identical"] and report["largest_grad_difference"] == 0.0
    assert list(report["resolved"]) == [f"flash {report['problem']}"]
