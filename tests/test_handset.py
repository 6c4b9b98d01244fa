"""``bench/chip/handset.py`` (issue 56, goals 1 and 2): the hand-set baselines it times against the
tuned, and the goals' ratios it reads from one problem's timed rows."""

from __future__ import annotations

import pytest

from bench.chip.handset import MAXTEXT, handset, ratios, same_as_tuned
from kernel import Problem


def test_the_handset_baselines_are_maxtext_s_and_the_kernels_defaults() -> None:
    """At 2048 tokens every hand-set splash is legal, so each runs; at 256 the uniform 1024 and
    2048 blocks are refused with the rule that refuses them, not dropped in silence."""
    long = Problem(1, 2, 2, 2048, 2048, 128, "float32", True, "fwd_bwd")
    contenders, refused = handset(long, interpret=True)
    assert {MAXTEXT, "splash every block 1024", "splash every block 2048",
            "flash default", "flash default, fused", "xla default"} <= contenders.keys()
    assert contenders["flash default, fused"][1].fused_bwd
    assert any(name.startswith("splash recipe") for name in contenders)
    short = Problem(1, 2, 2, 256, 256, 128, "float32", True, "fwd_bwd")
    contenders, refused = handset(short, interpret=True)
    why = {row["name"]: row["error"] for row in refused}
    assert "splash every block 1024" not in contenders
    assert "block_q=1024 is larger than q_len=256" in why["splash every block 1024"]


def test_the_goals_ratios_compare_the_tuned_with_the_fastest_handset() -> None:
    rows = [{"name": "tuned: splash", "median_ms": 10.0},
            {"name": "flash tuned", "median_ms": 12.0},
            {"name": "splash tuned", "median_ms": 10.0},
            {"name": MAXTEXT, "median_ms": 12.5},
            {"name": "splash every block 1024", "median_ms": 9.0},
            {"name": "xla default", "error": "out of memory"}]
    got = ratios(rows)
    assert got["tuned_vs_fastest_handset"] == pytest.approx(0.9)  # goal 1 missed here
    assert got["over_maxtext"] == pytest.approx(1.25)
    assert got["flash_over_splash"] == pytest.approx(1.2)


def test_the_hand_set_configs_the_tune_kept_are_named() -> None:
    """When the published choice is a hand-set config itself (on the chip, flash's default at
    causal fwd), the report names it, so a ratio of 0.9997 to it reads as noise, not a loss."""
    problem = Problem(1, 2, 2, 2048, 2048, 128, "float32", True, "fwd")
    contenders, _ = handset(problem, interpret=True)
    flash, default = contenders["flash default"]
    chosen = {"tuned: flash": (flash, default), "flash tuned": (flash, default)}
    assert same_as_tuned(chosen, contenders) == ["flash default"]
    other = {"tuned: flash": (flash, default.replace(block_q=256))}
    assert same_as_tuned(other, contenders) == []
