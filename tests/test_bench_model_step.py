"""bench/model_step.py on the CPU: a tiny Gemma-2-style step (a local and a global layer,
soft-capped), tuned with tune_model, then run from the tuned table, from a hand-set splash
table and from an XLA table; each variant must run the kernel its table chose."""

from __future__ import annotations

import math

from bench import model_step


def test_each_variant_runs_the_kernel_its_table_chose(tmp_path):
    report = model_step.main(["--interpret", "--model", "gemma2", "--out",
                              str(tmp_path / "step.json")])
    assert len(report["problems"]) == 2  # the local and the global layer
    assert all("softcap50" in label for label in report["problems"]), \
        report["problems"]
    expected = {"tuned": ("flash", "xla"), model_step.MAXTEXT: ("splash",), "xla": ("xla",)}
    for name, kernels in expected.items():
        variant = report["variants"][name]
        assert math.isfinite(variant["median_ms"]) and variant["median_ms"] > 0
        share = variant["attention_share"]  # interpreted kernels run as XLA loops: unnamed
        assert share is None or 0 < share < 1, share
        assert len(variant["ran"]) == 2, variant["ran"]
        for key, why in variant["ran"].items():
            assert key.split()[0] in kernels, (name, key)
            assert "chosen" in why and "scoped table" in why, why
    assert (tmp_path / "step.json").stat().st_size > 0
