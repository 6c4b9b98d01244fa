"""``bench/chip/peers.py`` (issue 72) on a CPU, without the peers installed (as CI runs it): our
tune and the hand-set configs are timed, each missing peer is named with its install line, a peer's
saved result is read back without the peer, and the ratios count a winner over the error bound
as failed, not as a win."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bench.chip import handset, peers
from kernel import Problem, get_kernel


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("peers")
    return peers.main(["--interpret", "--problems", "0", "--kernels", "flash", "--trials", "2",
                       "--rounds", "1", "--results", str(folder / "results"),
                       "--out", str(folder / "peers.json")]), folder


def test_without_the_peers_installed_ours_and_the_hand_set_configs_still_run(report):
    got, folder = report
    problem = got["problems"][0]
    for peer in peers.PEERS:
        if peers.missing(peer):
            assert "pip install 'flash-autotune[peers]'" in problem["tuners"][peer]["error"]
    assert problem["tuners"]["ours"]["chosen_kernel"] == "flash"
    timed = {row["name"] for row in problem["contenders"] if row.get("median_ms")}
    assert {"tuned: flash", "splash MaxText default", "flash default"} <= timed
    assert json.loads((folder / "peers.json").read_text())["problems"][0]["problem"] == (
        problem["problem"])
    assert list((folder / "results").glob("*.db"))  # our study, kept for a rerun to resume


def test_a_saved_tune_jax_result_is_read_back_without_tune_jax(tmp_path):
    problem = Problem(1, 2, 2, 256, 256, 128, "float32", True, "fwd_bwd")
    saved = tmp_path / "tune_jax.json"
    settings = {"sa_block_q": 128, "sa_block_kv": 256, "sa_block_kv_compute": 128,
                "sa_use_fused_bwd_kernel": True}
    saved.write_text(json.dumps({"wall_s": 1.0, "configs": 8, "failed": 0,
                                 "settings": settings, "config": "x"}))
    args = peers.parse_args(["--interpret"])
    contenders, row = peers.run_tune_jax(problem, [], args, saved)
    kernel, config = contenders["tune-jax (splash)"]
    assert kernel is get_kernel("splash").discover() and row["settings"] == settings
    assert (config.block_q, config.block_kv, config.use_fused_bwd_kernel) == (128, 256, True)
    assert config.block_q_dq is None and config.block_kv_dq is None  # fused: no dQ kernel


def test_a_winner_over_the_error_bound_is_failed_not_faster():
    rows = [{"name": "tuned: flash", "median_ms": 10.0, "max_error": 1e-3},
            {"name": "tune-jax (splash)", "median_ms": 9.0, "max_error": 1e-3},
            {"name": "tokamax autotune", "median_ms": 8.0, "max_error": 0.5},
            {"name": "splash MaxText default", "median_ms": 12.5, "max_error": 1e-3}]
    got = peers.peer_ratios(rows, bound=2e-2)
    assert got["failed_check"] == ["tokamax autotune"]
    assert got["best_peer"] == "tune-jax (splash)"
    assert got["over_best_peer"] == pytest.approx(0.9)  # the peer ahead: below 1
    assert got["over_maxtext"] == pytest.approx(1.25)


@pytest.mark.parametrize("text", ["0/2", "3/2", "1", "a/b", "1/0"])
def test_a_tokamax_part_must_be_k_of_n(text):
    with pytest.raises(SystemExit):
        peers.parse_args(["--tokamax-part", text])
    assert peers.parse_args(["--tokamax-part", "2/4"]).tokamax_part == (2, 4)


def test_a_tokamax_sample_spans_its_space_evenly():
    configs = list(range(576))
    sample = peers.sampled(configs, 48)
    assert sample == configs[::12] and len(sample) == 48
    assert peers.sampled(configs[:18], 48) == configs[:18]  # a small space runs whole
    assert peers.sampled(configs, None) == configs


def test_the_chip_grid_s_problems_are_built_at_the_head_dim_asked():
    """A chip call (not --interpret) builds the grid's problems: the stage ran into an
    AttributeError there once --head-dim was handset's flag only."""
    chosen = handset.problems(peers.parse_args(["--problems", "9", "--head-dim", "64"]))
    assert [(p.batch, p.q_len, p.head_dim, p.causal) for p in chosen] == [(8, 2048, 64, False)]
    assert handset.problems(peers.parse_args(["--problems", "0"]))[0].head_dim == 128


def test_tune_jax_s_grid_holds_no_block_longer_than_the_sequence():
    """At s512 every sample of the full grid failed to compile on the chip (2026-12-07): a user
    writes no block longer than the sequence."""
    short = Problem(32, 16, 16, 512, 512, 128, "bfloat16", False, "fwd_bwd")
    grid = peers.tune_jax_grid(short, interpret=False)
    assert grid["sa_block_q"] == [256, 512] and grid["sa_block_kv"] == [512]
    assert grid["sa_use_fused_bwd_kernel"] == [False, True]
    forward = peers.tune_jax_grid(dataclasses.replace(short, mode="fwd"), interpret=False)
    assert forward == {"sa_block_q": [256, 512], "sa_block_kv": [512],
                       "sa_block_kv_compute": [128, 256, 512]}
    long = Problem(2, 16, 16, 8192, 8192, 128, "bfloat16", True, "fwd_bwd")
    assert peers.tune_jax_grid(long, interpret=False) == peers.TUNE_JAX_GRID
