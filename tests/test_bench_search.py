"""``bench/search/replay.py``: warm start and cold compared at the same budget, and bad arguments or
landscapes refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.landscape import save_landscape
from tests.test_kernel_tuner_landscape import ROOT, _python

SCRIPT = str(ROOT / "bench/search/replay.py")
FAST = ("--seeds", "1", "--jobs", "1", "--overhead-trials", "2")


def _landscapes(directory: Path) -> Path:
    """Two landscapes of one kernel (same parameters: a warm-start pair) of 144 configs, more
    than the warm start's largest budget; the optimum (1 ms) at another config in each."""
    directory.mkdir()
    params = {"a": list(range(12)), "b": list(range(12))}
    for name, (best_a, best_b) in {"one": (4, 7), "two": (5, 6)}.items():
        records = [{"config": {"a": a, "b": b}, "status": "ok",
                    "time_ms": 1.0 + abs(a - best_a) + abs(b - best_b)}
                   for a in params["a"] for b in params["b"]]
        save_landscape({"name": name, "params": params, "records": records},
                       directory / f"{name}.json.gz")
    return directory


def test_cold_runs_as_far_as_the_warm_start_it_is_compared_with(tmp_path: Path) -> None:
    """With --budgets 3 the cold runs still go to 50 measured configs, the warm runs' budget,
    and cold@50 is the score after 50 (the optimum), not the score after 3 clipped."""
    done = _python(SCRIPT, str(_landscapes(tmp_path / "lands")), "--budgets", "3", *FAST,
                   "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert list(report["scores"]["one"]) == ["3"]
    assert report["scores"]["one"]["3"]["ours"]["median"] < 1.0
    cold = report["warm_start"]["two -> one"]["budgets"]["50"]["cold"]
    assert cold == {"median": 1.0, "mean": 1.0, "p10": 1.0}


@pytest.mark.parametrize(("args", "expected"), [
    (("--seeds", "0"), "argument --seeds: 0 is not at least 1"),
    (("--budgets", "5,x"), "argument --budgets: 'x' is not an integer"),
    (("--budgets", "0,5"), "argument --budgets: 0 is not at least 1"),
    (("--overhead-landscape", "nope"), "--overhead-landscape 'nope' is none of one, two"),
    (("--kernel-tuner-python", "none"), "no interpreter 'none': give a Python with kernel_tuner"),
])
def test_bad_arguments_are_refused_in_one_line(tmp_path: Path, args: tuple[str, ...],
                                               expected: str) -> None:
    done = _python(SCRIPT, str(_landscapes(tmp_path / "lands")), *args, timeout=120)
    assert done.returncode == 2
    assert expected in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_malformed_landscape_is_refused_in_one_line(tmp_path: Path) -> None:
    lands = _landscapes(tmp_path / "lands")
    (lands / "broken.json.gz").write_bytes(b"not gzip")  # a traceback before
    done = _python(SCRIPT, str(lands), *FAST, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"error: {lands / 'broken.json.gz'} is not gzip-compressed JSON: "
        "Not a gzipped file (b'no')"], done.stderr


def test_fresh_seeds_are_the_seeds_after_the_first(tmp_path: Path) -> None:
    """--seeds 1 --fresh-seeds 1 scores seed 0, then seed 1 apart: their mean is the mean of
    --seeds 2 (a fresh table over the first seeds again, or over all, would not be)."""
    lands = str(_landscapes(tmp_path / "lands"))
    args = ("--budgets", "3", "--no-warm", "--jobs", "1", "--overhead-trials", "2", "--json")
    split = _python(SCRIPT, lands, "--seeds", "1", "--fresh-seeds", "1", *args, timeout=300)
    both = _python(SCRIPT, lands, "--seeds", "2", *args, timeout=300)
    assert split.returncode == 0 and both.returncode == 0, split.stderr + both.stderr
    split, both = json.loads(split.stdout), json.loads(both.stdout)
    for name in ("one", "two"):
        seed0, seed1 = (split[table][name]["3"]["ours"]["mean"]
                        for table in ("scores", "fresh_scores"))
        assert both["scores"][name]["3"]["ours"]["mean"] == pytest.approx((seed0 + seed1) / 2)
    assert split["fresh_seeds"] == 1 and "fresh_scores" in split


def test_on_fresh_seeds_kernel_tuner_is_the_strategy_chosen_on_the_first(tmp_path: Path) -> None:
    """The fresh table's Kernel Tuner row is the strategy best on the first seeds, scored on the
    fresh ones, even where another strategy is better on the fresh seeds."""
    import importlib.util

    from autotune.landscape import load_landscape

    spec = importlib.util.spec_from_file_location("bench_search", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    land = load_landscape(_landscapes(tmp_path / "lands") / "one.json.gz")  # optimum 1 ms
    lucky, steady = [[1.0]] * 2 + [[4.0]] * 2, [[2.0]] * 4  # seeds 0-1 choose, 2-3 are fresh
    curves = {(label, "p", None): [[1.0]] * 4 for label in bench.SAMPLERS}
    curves |= {("kernel tuner", "p", "lucky"): lucky, ("kernel tuner", "p", "steady"): steady}
    row = bench._table({"p": land}, curves, [1], slice(0, 2), slice(2, None))["one"][1]
    assert row["kernel tuner best of"] == {"median": "lucky", "mean": "lucky", "p10": "lucky"}
    assert row["kernel tuner best"]["mean"] == pytest.approx(0.25)  # lucky's fresh seeds
    assert row["kernel tuner"]["steady"]["mean"] == pytest.approx(0.5)
    assert row["ours short of"]["kernel tuner best"] == {}


def test_ours_with_configs_claimed_ahead_is_scored_against_ours(tmp_path: Path) -> None:
    """--ahead 4 also replays ours with four configs claimed ahead of each measurement (the
    search's side of that is tests/test_search.py's), and each cell says whether it holds
    ours's statistics."""
    done = _python(SCRIPT, str(_landscapes(tmp_path / "lands")), "--budgets", "8",
                   "--no-warm", "--ahead", "4", *FAST, "--json", timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    cell = report["scores"]["one"]["8"]
    assert 0 < cell["ahead"]["median"] <= 1.0
    assert set(cell["ahead short of ours"]) <= {"median", "mean", "p10"}
    # Pooled over both landscapes: the mean paired difference and its bootstrap lower bound.
    for pair in ("ours - plain TPE", "ahead - ours"):
        pooled = report["pooled"][pair]["8"]
        assert -1 < pooled["lower_95"] <= pooled["mean"] < 1
