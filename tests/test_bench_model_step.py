"""bench/chip/model_step.py on the CPU: a tiny Gemma-2-style step (a local and a global layer,
soft-capped), tuned with tune_model, then run from the tuned table, from each candidate's own
tuned configs, from a hand-set splash table and from an XLA table; each variant must run the
kernel its table chose, the report must carry the tune's figures and each variant's device time
broken down by op, and a variant that does not fit the device's memory must be a row with its
error while the others still run."""

from __future__ import annotations

import json
import math

import pytest

from bench.chip import model_step


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One tuned run (its database kept, so a second run measures nothing again)."""
    folder = tmp_path_factory.mktemp("model_step")
    db = f"sqlite:///{folder}/model.db"
    report = model_step.main(["--interpret", "--model", "gemma2", "--db", db, "--out",
                              str(folder / "step.json")])
    return report, db, folder


def test_each_variant_runs_the_kernel_its_table_chose(run):
    report, _, folder = run
    assert len(report["problems"]) == 2  # the local and the global layer
    assert all("softcap50" in label for label in report["problems"]), \
        report["problems"]
    expected = {"tuned": ("flash", "xla"), "flash tuned": ("flash",),
                model_step.MAXTEXT: ("splash",), "xla": ("xla",)}
    assert list(report["variants"]) == list(expected)  # xla has no config of its own to tune
    for name, kernels in expected.items():
        variant = report["variants"][name]
        assert "error" not in variant, variant
        assert math.isfinite(variant["median_ms"]) and variant["median_ms"] > 0
        assert 0 < variant["memory_gib"] < 1, variant["memory_gib"]
        assert len(variant["ran"]) == 2, variant["ran"]
        for key, why in variant["ran"].items():
            assert key.split()[0] in kernels, (name, key)
            assert "chosen" in why and "scoped table" in why, why
    written = json.loads((folder / "step.json").read_text())
    assert list(written["variants"]) == list(expected)


def test_report_has_the_tune_figures_of_each_problem(run):
    report, _, _ = run
    assert list(report["tune"]) == report["problems"]
    for label, figures in report["tune"].items():
        assert figures["chosen"] in ("flash", "xla"), figures
        assert set(figures["kernels_ms"]) == {"flash", "xla"}, figures
        assert all(ms > 0 for ms in figures["kernels_ms"].values()), figures
        assert figures["failures"] == {}
        assert figures["configs"]["flash"].startswith("q"), figures["configs"]
        assert figures["defaults_ms"]["flash"] > 0, figures
        assert figures["maxtext_default_ms"] is None  # splash was no candidate
        assert report["variants"]["flash tuned"]["ran"][f"flash {label}"].split(
            "config ")[1].startswith(figures["configs"]["flash"]), figures


def test_each_variant_has_its_device_time_by_op(run):
    report, _, _ = run
    for name, variant in report["variants"].items():
        breakdown = variant["device_time"]
        assert breakdown["step_ms"] > 0, (name, breakdown)
        ops = breakdown["other_ops"]
        assert 0 < len(ops) <= 10, (name, ops)
        assert all(op["op"] and 0 <= op["ms"] <= breakdown["step_ms"] for op in ops), ops
        assert [op["ms"] for op in ops] == sorted((op["ms"] for op in ops), reverse=True)
        kernels_ms = breakdown["kernels_ms"]  # interpreted kernels run as XLA loops: unnamed
        assert kernels_ms is None or 0 < kernels_ms < breakdown["step_ms"], breakdown
        assert breakdown["outside_kernels_ms"] == (
            None if kernels_ms is None else breakdown["step_ms"] - kernels_ms), breakdown
        assert variant["attention_share"] == breakdown["attention_share"]
        assert any("dot_general" in op["source"] for op in ops), ops  # the MLP's matmuls


def test_a_variant_that_does_not_fit_is_an_error_row_and_the_rest_run(run):
    """The same step again from the same database (nothing tuned again), under a memory limit
    between the hand-set splash step's and the XLA step's needs (the two quickest to compile):
    the larger is refused with one line, the other still runs, and the report is written."""
    report, db, folder = run
    need = {name: report["variants"][name]["memory_gib"]
            for name in (model_step.MAXTEXT, "xla")}
    assert len(set(need.values())) == 2, need
    larger, smaller = sorted(need, key=need.get, reverse=True)
    out = folder / "limited.json"
    limited = model_step.main(["--interpret", "--model", "gemma2", "--db", db,
                               "--variants", ",".join(need), "--memory-gib",
                               str(sum(need.values()) / 2), "--out", str(out)])
    failed = limited["variants"][larger]
    assert set(failed) == {"error"}, failed
    assert failed["error"].startswith(f"{larger}: out of device memory compiling the step ("), \
        failed
    assert "--memory-gib" in failed["error"] and "\n" not in failed["error"], failed
    assert limited["variants"][smaller]["median_ms"] > 0
    written = json.loads(out.read_text())
    assert written["variants"][larger] == failed
    assert limited["tune"] == report["tune"]  # read back, not tuned again


def test_an_unknown_variant_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        model_step.parse_args(["--variants", "tuned,splash tunned"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "unknown variant 'splash tunned'" in error and "splash tuned" in error, error


def test_report_says_which_table_the_step_confirmation_returned(run):
    report, _, _ = run
    confirmation = report["step_confirmation"]
    assert set(confirmation["variants"]) == {"tuned", "flash", "xla"}
    assert confirmation["chosen"] in confirmation["variants"]
    assert all(v["median_ms"] > 0 for v in confirmation["variants"].values())
    assert confirmation["rounds"] == 2 and confirmation["timing"] == "wallclock"
    ran = report["variants"]["tuned"]["ran"]  # the tuned variant is the confirmed table
    assert set(confirmation["kernels"]) == set(report["problems"])
    assert all(f"{name} {label}" in ran for label, name in confirmation["kernels"].items())
