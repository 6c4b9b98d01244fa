"""bench/chip/sharded_step.py on the CPU: a tiny Gemma-2-style step (a local and a global layer,
soft-capped) over a one-device mesh in MaxText's style (the drop-in in its shard_map) and in
jax.set_mesh's, each tuned with tune_model and run from its table; each attention problem must
run the kernel its choice names, the two styles compute the same loss, and the maxtext export's
outcome is recorded (no splash entry can be tuned on a CPU: its error). A problem that ran
another kernel than its choice names is a fallback line."""

from __future__ import annotations

import json
from types import SimpleNamespace

from bench.chip import sharded_step
from kernel import Problem


def test_both_styles_run_each_layer_type_with_the_kernel_its_choice_names(tmp_path):
    out = tmp_path / "step.json"
    report = sharded_step.main(["--interpret", "--out", str(out)])
    assert json.loads(out.read_text())["styles"] == report["styles"]
    assert report["fallbacks"] == []
    losses = []
    for style in sharded_step.STYLES:
        row = report["styles"][style]
        local, full = row["problems"]
        assert "window63,0 softcap50" in local and "window" not in full, row["problems"]
        assert {label: choice["kernel"] for label, choice in row["choices"].items()} == {
            local: "flash", full: "flash"}
        assert sorted(row["ran"]) == sorted(f"flash {label}" for label in (local, full))
        assert all(sharded_step.CHOSEN in why for why in row["ran"].values()), row["ran"]
        assert row["median_ms"] > 0
        losses.append(row["loss"])
    assert abs(losses[0] - losses[1]) < 1e-2 * abs(losses[1]), losses
    export = report["export"]
    assert export["shapes"] == report["styles"]["maxtext"]["problems"]
    assert export["exit_code"] == 1 and export["flags"] == []
    assert "no tuned configs of 'splash'" in export["lines"][-1], export["lines"]


def test_a_problem_run_by_another_kernel_than_its_choice_is_a_fallback():
    local, full = (Problem(1, 2, 1, 128, 128, 128, causal=True, window=window)
                   for window in ((63, 0), None))
    table = SimpleNamespace(choices=[SimpleNamespace(problem=local, kernel="splash")])
    ran = {f"flash {local.label()}": "default, config q128; kernel: next best (splash: tpu)",
           f"flash {full.label()}": "default, config q128"}
    lines = sharded_step.fallbacks(table, [local, full], ran)
    assert len(lines) == 2
    assert lines[0].startswith(f"{local.label()}: the choice names splash, it ran")
    assert "next best" in lines[0]
    assert lines[1].startswith(f"{full.label()}: the choice names no kernel")
