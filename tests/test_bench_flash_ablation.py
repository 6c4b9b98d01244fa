"""``bench/chip/flash_ablation.py`` on a tiny problem in interpret mode: every variant (a copy of
the kernel file, loaded as its own module) and splash get a finite step time and errors
within the kernels' bound; a missing variant file is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kernel.tolerance import max_relative_error
from tests.test_kernel_tuner_landscape import ROOT, _python

SCRIPT = str(ROOT / "bench/chip/flash_ablation.py")
KERNEL_FILE = ROOT / "kernel" / "backends" / "flash" / "pallas.py"
TINY = ("--batch", "1", "--heads", "2", "--seq", "256", "--head-dim", "64", "--block", "128",
        "--splash-block", "128", "--rounds", "2", "--calls", "2")


def test_each_variant_and_splash_get_a_time_and_errors_within_bound(tmp_path: Path) -> None:
    shutil.copy(KERNEL_FILE, tmp_path / "copy.py")
    out = tmp_path / "ablation.json"
    done = _python(SCRIPT, "--variant", f"now={KERNEL_FILE}", "--variant",
                   f"copy={tmp_path / 'copy.py'}", *TINY, "--out", str(out), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == ["now", "copy", "splash"]
    for name, row in rows.items():
        assert 0 < row["median_ms"] < float("inf"), name
        assert sorted(row["errors"]) == ["dk", "dq", "dv", "out"], name
        assert row["max_error"] <= max_relative_error("bfloat16"), (name, row["errors"])
    assert rows["now"]["errors"] == rows["copy"]["errors"]  # the same kernel, loaded twice


def test_a_missing_variant_file_is_refused_in_one_line(tmp_path: Path) -> None:
    done = _python(SCRIPT, "--variant", f"gone={tmp_path / 'gone.py'}", *TINY, timeout=300)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"--variant gone={tmp_path / 'gone.py'}: no such file; write it with git show "
        "REV:kernel/backends/flash/pallas.py > PATH"]


def test_unmasked_fused_rows_for_flash_and_splash(tmp_path: Path) -> None:
    """Issue 74: ``--full --fused both --splash-fused both`` times each backward both ways,
    over the fastest splash row."""
    out = tmp_path / "ablation.json"
    done = _python(SCRIPT, "--variant", f"now={KERNEL_FILE}", *TINY, "--full", "--fused", "both",
                   "--splash-fused", "both", "--out", str(out), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert list(rows) == ["now", "now fused", "splash", "splash fused"]
    assert "causal" not in report["problem"] and "fused" in report["flash_config"]
    assert all(row["max_error"] <= max_relative_error("bfloat16") for row in rows.values()), rows
    assert min(rows["splash"]["vs_splash"], rows["splash fused"]["vs_splash"]) == 1.0
