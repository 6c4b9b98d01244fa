"""``bench/chip/tpu_check.py --interpret``: the one-command TPU check runs end to end on this CPU
and writes the JSON (and HTML) a TPU VM would, section by section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tpu_check_writes_every_section(tmp_path: Path) -> None:
    out, html = tmp_path / "check.json", tmp_path / "check.html"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench/chip/tpu_check.py"), "--interpret", "--shapes", "1",
         "--trials", "2", "--rounds", "1", "--precheck-limit", "1", "--kernels", "flash,cudnn",
         "--out", str(out), "--html", str(html)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["platform"] == "cpu" and report["mode"] == "interpret (CPU)"
    assert {"jax", "jaxlib", "libtpu"} <= report["versions"].keys()

    numerics = {(n["kernel"], n["mode"]): n for n in report["numerics"]}
    assert numerics[("flash", "fwd")]["status"] == numerics[("flash", "fwd_bwd")]["status"] == "ok"
    assert numerics[("cudnn", None)]["status"] == "skipped: runs on gpu, not cpu"

    [timed] = report["timing"]
    assert list(timed["methods"]) == ["step_profile", "loop", "wallclock"]
    # Every method times the interpreted kernel's step: step_profile reads its host-side ops.
    for method in ("step_profile", "loop", "wallclock"):
        assert timed["methods"][method]["timing"] == method
        assert timed["methods"][method]["best_ms"] > 0 and timed["default_ms"][method] > 0
    # On a CPU the methods' winners depend on the noise: only the field is checked.
    assert timed["default_over_profile"]["step_profile"] == 1.0
    assert list(timed["default_over_profile"]) == ["step_profile", "loop", "wallclock"]
    assert isinstance(timed["winners_agree"], bool)

    [compared] = report["comparison"]
    rows = {row["name"]: row for row in compared["contenders"]}
    assert set(rows) == {"default", "tuned", "jax_tpu_flash", "xla"}
    assert compared["timing"] == "wallclock"
    for row in rows.values():
        assert row["median_ms"] > 0 and row["max_error"] < 2e-3
        assert row["achieved_tflops"] is row["roofline_fraction"] is None  # a CPU: none

    [splash] = report["splash"]  # tuned against MaxText's default and its two recipes
    rows = {row["name"]: row for row in splash["contenders"]}
    assert set(rows) == {"splash tuned", "splash MaxText default",
                         "splash recipe all 2048, fused", "splash recipe q1024 dkv2048, seq-minor"}
    for row in rows.values():
        assert row["median_ms"] > 0 and row["max_error"] < 2e-3, row

    precheck = report["precheck"]
    assert precheck["compiled_on"] == "v5e (deviceless AOT)"
    [row] = precheck["rows"]
    assert row["status"] == "ok" and row["predicted_fit"] is True and precheck["agree"] == 1

    page = html.read_text()
    assert "<h2>Timing methods</h2>" in page and "jax_tpu_flash" in page
    assert "splash recipe all 2048, fused" in page
