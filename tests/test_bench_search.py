"""``bench/search.py``: warm start and cold compared at the same budget, and bad arguments or
landscapes refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.landscape import save_landscape
from tests.test_kernel_tuner_landscape import ROOT, _python

SCRIPT = str(ROOT / "bench" / "search.py")
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
