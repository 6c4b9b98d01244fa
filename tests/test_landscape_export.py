"""``autotune landscape``: a real tuning study on this CPU written as a landscape, replayed."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import optuna
import pytest

from autotune.landscape import LandscapeError, load_landscape, save_landscape, study_document
from autotune.search import search
from autotune.searchspace import Space
from autotune.trials import OK, Measurement
from kernel.problem import Problem
from tests.conftest import problem_flags, run_cli

# q_len 128: one legal tile per axis, so the space is the four pipeline depths.
WHOLE = Problem(1, 1, 1, 128, 128, 64, "float32", False, "fwd")
# q_len 256: two tiles per axis, more configs than the two trials a partial study measures.
PART = Problem(1, 1, 1, 256, 256, 64, "float32", False, "fwd")


def _tune(db: str, problem: Problem, *args: str) -> dict:
    done = run_cli("tune", "--kernel", "flash", *problem_flags(problem), "--db", db, "--json",
                   *args, timeout=300)
    assert done.returncode == 0, done.stderr
    [summary] = [json.loads(line) for line in done.stdout.splitlines()
                 if line.strip() and json.loads(line).get("summary")]
    return summary


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, dict]:
    """A SQLite file with two real studies: WHOLE measured to exhaustion by a grid search,
    PART measured two configs by the default search. Their summaries."""
    db = f"sqlite:///{tmp_path_factory.mktemp('landscape') / 'autotune.db'}"
    whole = _tune(db, WHOLE, "--sampler", "grid", "--trials", "50")
    part = _tune(db, PART, "--trials", "2")
    assert (whole["stop_reason"], part["stop_reason"]) == ("exhausted", "budget")
    return db, whole, part


def test_a_study_run_to_exhaustion_replays_as_the_measured_landscape(tuned, tmp_path):
    db, whole, _ = tuned
    out = tmp_path / "flash-cpu.json.gz"
    done = run_cli("landscape", whole["study"], "-o", str(out), "--db", db)
    assert done.returncode == 0, done.stderr
    assert f"{whole['measured']} configs" in done.stdout

    study = optuna.load_study(study_name=whole["study"], storage=db)
    trials = [t for t in study.trials if t.user_attrs.get("status") == "ok"]
    land = load_landscape(out)
    assert len(land.records) == whole["measured"] == len(trials) == 4
    assert land.optimum_ms == min(t.value for t in trials)
    for t in trials:
        record = land.records[land.key(t.params)]
        assert record["time_ms"] == t.value and record["iqr_ms"] == t.user_attrs["iqr_ms"]
        assert record["compile_s"] == t.user_attrs["compile_s"] > 0
        assert record["measure_s"] == t.user_attrs["measure_s"] > 0
    with gzip.open(out, "rt") as f:
        doc = json.load(f)
    assert (doc["kernel"], doc["device"], doc["complete"]) == ("flash", "cpu", True)
    assert Problem.from_dict(doc["problem"]) == WHOLE

    replayed = run_cli("replay", str(out), "--sampler", "grid", "--budget", "4", "--json")
    assert replayed.returncode == 0, replayed.stderr
    result = json.loads(replayed.stdout)
    assert result["score"] == 1.0 and result["measured"] == 4


def test_a_study_short_of_its_space_is_refused_unless_partial(tuned, tmp_path):
    db, _, part = tuned
    out = tmp_path / "part.json.gz"
    refused = run_cli("landscape", part["study"], "-o", str(out), "--db", db)
    assert refused.returncode == 1
    assert "--sampler grid" in refused.stderr and "--partial" in refused.stderr
    assert not out.exists()

    done = run_cli("landscape", part["study"], "-o", str(out), "--db", db, "--partial")
    assert done.returncode == 0, done.stderr
    assert "partial" in done.stdout
    land = load_landscape(out)
    assert len(land.records) == part["measured"] == 2
    assert len(land.space.params["block_q"]) == 2  # the declared space, not the values seen


def test_an_unknown_study_names_those_the_database_holds(tuned, tmp_path):
    db, whole, part = tuned
    done = run_cli("landscape", "flash/cpu/nope", "-o", str(tmp_path / "x.json.gz"), "--db", db)
    assert done.returncode == 1
    assert "no study 'flash/cpu/nope'" in done.stderr
    assert repr(whole["study"]) in done.stderr and repr(part["study"]) in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "x.json.gz").exists()


def test_bad_output_and_missing_database_are_named_without_touching_anything(tmp_path):
    missing = tmp_path / "none.db"
    done = run_cli("landscape", "any", "-o", str(tmp_path / "x.json.gz"),
                   "--db", f"sqlite:///{missing}")
    assert done.returncode == 1 and "does not exist" in done.stderr
    assert not missing.exists()
    wrong = run_cli("landscape", "any", "-o", str(tmp_path / "x.json"),
                    "--db", f"sqlite:///{missing}")
    assert wrong.returncode == 2 and "*.json.gz" in wrong.stderr
    assert "Traceback" not in done.stderr + wrong.stderr


def test_a_failed_write_leaves_the_earlier_file_whole(tmp_path):
    out = tmp_path / "kept.json.gz"
    save_landscape({"name": "first", "records": [1, 2, 3]}, out)
    with pytest.raises(TypeError):
        save_landscape({"name": "second", "records": [object()]}, out)  # fails mid-dump
    with gzip.open(out, "rt") as f:
        assert json.load(f) == {"name": "first", "records": [1, 2, 3]}
    assert [p.name for p in Path(tmp_path).iterdir()] == ["kept.json.gz"]


def test_a_study_not_made_by_the_search_is_refused():
    study = optuna.create_study()
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)
    with pytest.raises(LandscapeError, match="no declared search space"):
        study_document(study)


def test_a_trial_outside_the_declared_space_is_left_out():
    """A study resumed after its space changed may hold values the declared space lacks; the
    landscape keeps what load_landscape accepts."""
    study = optuna.create_study()
    study.set_user_attr("params", {"block": [128, 256]})
    wide = optuna.distributions.CategoricalDistribution([128, 256, 512])
    for block, status in ((128, "ok"), (512, "ok"), (256, "exhausted")):
        study.add_trial(optuna.trial.create_trial(
            params={"block": block}, distributions={"block": wide},
            value=float(block) if status == "ok" else None,
            user_attrs={"status": status},
            state=optuna.trial.TrialState.COMPLETE if status == "ok"
            else optuna.trial.TrialState.FAIL))
    document = study_document(study)
    assert document["complete"] and [r["config"] for r in document["records"]] == [{"block": 128}]


def test_a_grid_run_interrupted_at_its_last_config_is_not_complete(tmp_path):
    """The claim read ahead of the last measurement makes the search see its space exhausted;
    Ctrl-C gives that claim back unmeasured, so the study is short of its space until a rerun
    measures it."""
    space = Space({"a": [1, 2, 3]}, lambda config: True)
    storage = f"sqlite:///{tmp_path / 'grid.db'}"
    measured = []

    def measure(config):
        if len(measured) == 2:
            raise KeyboardInterrupt
        measured.append(config)
        return Measurement(float(config["a"]), OK, {})

    def run():
        return search(space, measure, storage=storage, study_name="grid", sampler="grid",
                      trials=10, prepare=lambda config: None)

    with pytest.raises(KeyboardInterrupt):
        run()
    study = optuna.load_study(study_name="grid", storage=storage)
    with pytest.raises(LandscapeError, match="did not measure its whole legal space"):
        study_document(study)
    assert not study_document(study, partial=True)["complete"]
    measured.clear()
    assert run().stop_reason == "exhausted"
    document = study_document(optuna.load_study(study_name="grid", storage=storage))
    assert document["complete"] and len(document["records"]) == 3
