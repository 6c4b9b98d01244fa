"""The search engine on small synthetic landscapes: legality, no repeats, failures, budget,
resume, cooperating processes on one SQLite study, patience, seeds, restarts."""

from __future__ import annotations

import gzip
import json
import random
import sqlite3
import subprocess
import sys
import textwrap
import time
import types
import warnings
from pathlib import Path

import optuna
import pytest
from optuna.samplers import TPESampler

from autotune.landscape import load_landscape
from autotune.samplers import create_sampler
from autotune.samplers.engine import RESTART_AFTER, EngineSampler
from autotune.samplers.forest import ForestSurrogate
from autotune.samplers.plain_tpe import PlainTPEView
from autotune.search import search
from autotune.searchspace import _RANDOM_TRIES, Space
from autotune.trials import Measurement

optuna.logging.set_verbosity(optuna.logging.WARNING)

PARAMS = {"a": [1, 2, 4, 8, 16], "b": [1, 2, 3, 4], "c": [0, 1], "d": [7]}


def _time(a: int, b: int, c: int) -> float:
    return 1.0 + (a.bit_length() - 3) ** 2 + (b - 3) ** 2 + 0.5 * c


def write_landscape(path: Path) -> Path:
    """A landscape in the shared format: a*b > 32 is illegal (no record); two configs fail."""
    records = []
    for a in PARAMS["a"]:
        for b in PARAMS["b"]:
            for c in PARAMS["c"]:
                if a * b > 32:
                    continue
                config = {"a": a, "b": b, "c": c, "d": 7}
                if (a, b) == (16, 2):
                    records.append({"config": config, "status": "compile_error", "time_ms": None,
                                    "compile_s": 1.5, "benchmark_s": None})
                else:
                    records.append({"config": config, "status": "ok", "time_ms": _time(a, b, c),
                                    "compile_s": 0.5, "benchmark_s": 0.1})
    doc = {"name": "synthetic", "params": PARAMS, "records": records}
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return path


@pytest.fixture
def land(tmp_path):
    return load_landscape(write_landscape(tmp_path / "synthetic.json.gz"))


class Recorder:
    """A measure function over a landscape that remembers every call."""

    def __init__(self, land):
        self.land, self.calls = land, []

    def __call__(self, config):
        self.calls.append(self.land.key(config))
        return self.land.measure(config)


@pytest.mark.parametrize("sampler", ["tpe", "random", "grid", "plain-tpe"])
def test_enough_budget_finds_the_optimum_without_illegal_or_repeated_measurements(land, sampler):
    rec = Recorder(land)
    legal = len(land.records)
    result = search(land.space, rec, sampler=sampler, trials=legal, seed=1)
    assert result.best.value == land.optimum_ms
    assert len(rec.calls) == len(set(rec.calls)) == result.measured == legal
    assert all(key in land.records for key in rec.calls)
    assert result.stop_reason == "budget"
    assert result.curve[-1] == land.optimum_ms
    assert all(x is None or y <= x for x, y in zip(result.curve, result.curve[1:], strict=False))


def test_budget_counts_measured_configs_only_and_failures_count(land):
    rec = Recorder(land)
    result = search(land.space, rec, trials=25, seed=3)
    assert len(rec.calls) == 25 == result.measured == len(result.trials)
    statuses = {t.measurement.status for t in result.trials}
    assert statuses <= {"ok", "compile_error"}
    failed = [t for t in result.trials if not t.measurement.ok]
    assert all(t.value is None and t.measurement.attrs["compile_s"] == 1.5 for t in failed)


def test_exception_in_measure_is_a_runtime_error_and_the_study_goes_on(land):
    def measure(config):
        if config["c"] == 1:
            raise RuntimeError("kernel crashed")
        return land.measure(config)

    result = search(land.space, measure, trials=12, seed=0)
    assert result.measured == 12
    errors = [t for t in result.trials if t.measurement.status == "runtime_error"]
    assert errors and all("kernel crashed" in t.measurement.attrs["error"] for t in errors)
    assert result.best is not None and result.best.config["c"] == 0


def test_space_exhausted_stops_the_search(land):
    rec = Recorder(land)
    result = search(land.space, rec, trials=1000, seed=0)
    assert result.stop_reason == "exhausted"
    assert sorted(rec.calls) == sorted(land.records)


@pytest.mark.parametrize("sampler", ["tpe", "plain-tpe", "random"])
def test_a_budget_beyond_the_legal_configs_stops_once_all_are_measured(sampler, tmp_path):
    """Eight legal configs and a budget of 50: once all eight are measured the search stops,
    without asking the sampler for thousands of proposals first (plain TPE stored each as a
    trial: 2000 before it counted as stuck)."""
    space = Space({"a": list(range(4)), "b": list(range(4))}, lambda c: (c["a"] + c["b"]) % 2 == 0)
    url = f"sqlite:///{tmp_path / 'small.db'}"
    result = search(space, lambda c: Measurement(1.0 + c["a"]), storage=url, study_name="small",
                    sampler=sampler, trials=50, seed=0)
    assert result.stop_reason == "exhausted" and result.measured == 8
    assert len(optuna.load_study(study_name="small", storage=url).trials) < 200


def test_a_sparse_space_lists_its_legal_configs_once_for_all_random_picks():
    """Three legal configs in 10k: rejection sampling finds none, so the legal set is listed,
    once, and later picks (and the forest's candidates) reuse it instead of testing every
    combination again."""
    legal, tests = {(3, 7), (50, 2), (99, 99)}, []
    space = Space({"a": list(range(100)), "b": list(range(100))},
                  lambda c: tests.append(1) or (c["a"], c["b"]) in legal)
    rng, taken = random.Random(0), set()
    for _ in legal:
        taken.add(space.key(space.random_legal(rng, taken)))
    assert taken == legal and space.random_legal(rng, taken) is None
    assert len(tests) <= 4 * _RANDOM_TRIES + space.size


def test_a_canonical_form_keeps_a_flag_s_branch_from_shrinking_to_its_legal_sliver():
    """A flag that leaves a parameter unused: legal only at None under the flag as a rule, the
    flag's branch is a third of the draws; made canonical, half of them, each config once."""
    params = {"flag": [False, True], "a": [None, 1, 2], "b": [1, 2]}

    def legal(c):
        return (c["a"] is None) == c["flag"]

    def canonical(c):
        return {**c, "a": None} if c["flag"] else c

    for space, low, high in ((Space(params, legal), 0.25, 0.42),
                             (Space(params, legal, canonical=canonical), 0.5, 0.7)):
        rng = random.Random(0)
        share = sum(space.random_legal(rng, set())["flag"] for _ in range(600)) / 600
        assert low < share < high
    space = Space(params, legal, canonical=canonical)
    assert space.key({"flag": True, "a": 2, "b": 1}) == space.key({"flag": True, "a": None, "b": 1})
    assert len(space.legal_configs()) == 6  # 4 unflagged, 2 flagged: each canonical config once
    # one step: the flag set (its unused value made canonical); a draw of the unused value
    # alone is no step
    assert {space.key(n) for n in space.neighbours({"flag": False, "a": 1, "b": 1})} == {
        (False, 2, 1), (False, 1, 2), (True, None, 1)}
    assert {space.key(n) for n in space.neighbours({"flag": True, "a": None, "b": 1})} == {
        (True, None, 2)}


def test_patience_stops_after_that_many_measurements_without_improvement():
    space = Space({"x": list(range(50))})
    result = search(space, lambda c: Measurement(10.0 + c["x"] % 3), trials=50, patience=5,
                    seeds=[{"x": 0}], seed=0)
    # The seed (x=0, 10 ms) is already the best possible value: nothing can improve on it.
    assert result.stop_reason == "patience"
    assert result.measured == 6
    assert result.trials[0].config == {"x": 0}


def test_seeds_are_measured_first_in_order_skipping_illegal_and_duplicate_ones(land):
    rec = Recorder(land)
    seeds = [{"a": 4, "b": 3, "c": 1, "d": 7}, {"a": 16, "b": 4, "c": 0, "d": 7},  # illegal
             {"a": 4, "b": 3, "c": 1, "d": 7, "extra": "ignored"}, {"a": 1, "b": 1, "c": 0, "d": 7}]
    search(land.space, rec, trials=5, seeds=seeds, seed=0)
    assert rec.calls[:2] == [(4, 3, 1, 7), (1, 1, 0, 7)]
    assert len(set(rec.calls)) == 5


def test_a_seed_missing_a_parameter_is_a_clear_error(land):
    with pytest.raises(ValueError, match=r"lacks parameter\(s\) \['d'\]"):
        search(land.space, land.measure, trials=3, seeds=[{"a": 1, "b": 1, "c": 0}])


def test_a_study_of_other_parameters_is_refused_before_anything_is_written(land, tmp_path):
    """A replay's study given to a tune (their ``of`` values share no name, so they did not
    clash): refused in one line, the study's trials and attributes as they were (a KeyError
    from the sampler before, and a claim left RUNNING without params)."""
    from autotune.search import StudyMismatchError

    url = f"sqlite:///{tmp_path / 'shared.db'}"
    search(land.space, land.measure, storage=url, study_name="shared", trials=4, seed=0,
           of={"landscape": "synthetic"})
    before = optuna.load_study(study_name="shared", storage=url)
    other = Space({"block_q": [128, 256], "block_kv": [128, 256]})
    with pytest.raises(StudyMismatchError, match="searches other parameters"):
        search(other, lambda c: Measurement(1.0), storage=url, study_name="shared", trials=8,
               seed=0, of={"problem": {"q_len": 256}, "kernel": "flash"})
    after = optuna.load_study(study_name="shared", storage=url)
    assert after.user_attrs == before.user_attrs
    assert [t.state for t in after.trials] == [t.state for t in before.trials]


def test_resumes_queue_each_warm_start_seed_once(land, tmp_path):
    """More seeds than the budget, resumed three times: the seeds not yet measured stay queued
    once, not once more per resume (each copy a wasted claim later)."""
    url = f"sqlite:///{tmp_path / 'seeds.db'}"
    seeds = [land.space.config(dict(zip(land.space.names, key, strict=True)))
             for key in list(land.records)[:4]]
    for _ in range(3):
        search(land.space, land.measure, storage=url, study_name="seeds", trials=2, seed=0,
               seeds=seeds)
    states = [t.state for t in optuna.load_study(study_name="seeds", storage=url).trials]
    assert states.count(optuna.trial.TrialState.COMPLETE) == 2
    assert states.count(optuna.trial.TrialState.WAITING) == 2


def test_resumed_study_measures_only_new_configs(land, tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    first, second = Recorder(land), Recorder(land)
    assert search(land.space, first, storage=url, study_name="s", trials=10, seed=0).measured == 10
    result = search(land.space, second, storage=url, study_name="s", trials=20, seed=0)
    assert len(second.calls) == 10 and not set(first.calls) & set(second.calls)
    assert result.measured == 20 and len(result.curve) == 20
    study = optuna.load_study(study_name="s", storage=url)
    assert study.user_attrs["params"]["a"] == PARAMS["a"]
    trial = study.best_trial
    assert trial.user_attrs["status"] == "ok" and "measure_s" in trial.user_attrs
    assert trial.params == result.best.config


def test_stale_trial_of_a_killed_worker_is_failed_and_its_config_measured_again(land, tmp_path):
    from storage.studies import get_storage

    url = f"sqlite:///{tmp_path / 'study.db'}"
    storage = get_storage(url, heartbeat_interval=1, grace_period=1)
    study = optuna.create_study(storage=storage, study_name="s")
    study.enqueue_trial(dict(zip(land.params, next(iter(land.records)), strict=True)))
    killed = study.ask(land.space.distributions)  # a worker claimed a legal config, then died
    storage.record_heartbeat(killed._trial_id)
    lost = land.space.key(killed.params)
    import time
    time.sleep(2.5)
    rec = Recorder(land)
    result = search(land.space, rec, storage=storage, study_name="s", trials=len(land.records))
    assert optuna.load_study(study_name="s", storage=url).trials[0].state.name == "FAIL"
    assert lost in rec.calls and result.measured == len(land.records)


def test_an_orphan_claim_without_params_neither_delays_claims_nor_holds_the_budget(
        land, tmp_path, monkeypatch):
    """A worker killed inside ``ask`` (its trial created, its params not yet written) leaves a
    RUNNING trial without params and without a heartbeat. Later claims do not wait for its
    params, and once it is older than the grace period it is failed, freeing its budget slot."""
    import datetime

    from optuna.trial import FrozenTrial, TrialState

    from autotune import claims
    from storage.studies import get_storage

    url = f"sqlite:///{tmp_path / 'study.db'}"
    storage = get_storage(url, heartbeat_interval=1, grace_period=60)
    study = optuna.create_study(storage=storage, study_name="s")
    started = datetime.datetime.now() - datetime.timedelta(minutes=5)
    storage.create_new_trial(study._study_id, template_trial=FrozenTrial(
        number=0, state=TrialState.RUNNING, value=None, datetime_start=started,
        datetime_complete=None, params={}, distributions={}, user_attrs={}, system_attrs={},
        intermediate_values={}, trial_id=0))
    waits: list[float] = []  # a claim's waits for earlier params (counted: a time load flips)
    monkeypatch.setattr(claims, "time", types.SimpleNamespace(
        monotonic=time.monotonic, sleep=lambda seconds: waits.append(seconds)))
    result = search(land.space, Recorder(land), storage=storage, study_name="s", trials=6)
    assert result.measured == 6 and result.stop_reason == "budget"
    assert waits == []  # none waited for the orphan's params
    orphan = optuna.load_study(study_name="s", storage=url).trials[0]
    assert orphan.state == TrialState.FAIL and orphan.user_attrs["status"] == "orphan"



def test_an_orphan_claim_within_its_grace_period_holds_no_slot_of_the_budget(land, tmp_path):
    """A worker killed inside ``ask`` minutes ago, but within the heartbeat's grace period: the
    worker that takes the study over still measures the whole budget (it used to stop one
    short, counting the orphan as a running claim)."""
    import datetime

    from optuna.trial import FrozenTrial, TrialState

    from storage.studies import get_storage

    storage = get_storage(f"sqlite:///{tmp_path / 'study.db'}", heartbeat_interval=1,
                          grace_period=3600)
    study = optuna.create_study(storage=storage, study_name="s")
    storage.create_new_trial(study._study_id, template_trial=FrozenTrial(
        number=0, state=TrialState.RUNNING, value=None,
        datetime_start=datetime.datetime.now() - datetime.timedelta(seconds=30),
        datetime_complete=None, params={}, distributions={}, user_attrs={}, system_attrs={},
        intermediate_values={}, trial_id=0))
    rec = Recorder(land)
    result = search(land.space, rec, storage=storage, study_name="s", trials=6)
    assert result.measured == 6 == len(set(rec.calls)) and result.stop_reason == "budget"


@pytest.mark.parametrize("params_after_s, yields", [(0.0, False), (3.0, True)])
def test_a_claim_whose_params_came_late_yields_its_config_to_a_later_claim(land, params_after_s,
                                                                           yields):
    """Claim 0's sampler took seconds (a loaded machine) before its params were written, so
    claim 1, of another worker, took it for an orphan and claimed the same config: claim 0
    yields, and the config is measured once. A claim written at once keeps its config (the
    lower number wins, and claim 1 yields to it)."""
    import datetime

    from optuna.trial import FrozenTrial, TrialState

    from autotune import claims

    space = land.space
    config = dict(zip(land.params, next(iter(land.records)), strict=True))
    study = optuna.create_study()
    now = datetime.datetime.now()
    for number, started in enumerate((now - datetime.timedelta(seconds=params_after_s), now)):
        study.add_trial(FrozenTrial(
            number=number, state=TrialState.RUNNING, value=None, datetime_start=started,
            datetime_complete=None, params=config, distributions=space.distributions,
            user_attrs={"worker": f"w{number}"},  # each claim's, written right after its ask
            system_attrs={}, intermediate_values={}, trial_id=number))
    conflict = claims.conflict(study, space, 0, space.key(config), trials=10)
    assert conflict == ("duplicate" if yields else "")
    assert claims.conflict(study, space, 1, space.key(config), trials=10) == "duplicate"


@pytest.mark.parametrize("params_after_s, conflict", [(0.0, ""), (3.0, "surplus")])
def test_a_claim_whose_params_came_late_counts_later_claims_against_the_budget(
        land, params_after_s, conflict):
    """The last slot of the budget: claim 1, of another worker, took the slow claim 0 for an
    orphan and claimed another config. Claim 0 yields the slot, so the study measures no more
    than its budget; a claim written at once keeps the slot (claim 1 sees it, and yields)."""
    import datetime

    from optuna.trial import FrozenTrial, TrialState

    from autotune import claims

    space = land.space
    configs = [dict(zip(land.params, values, strict=True)) for values in list(land.records)[:2]]
    study = optuna.create_study()
    now = datetime.datetime.now()
    for number, (config, started) in enumerate(
            zip(configs, (now - datetime.timedelta(seconds=params_after_s), now), strict=True)):
        study.add_trial(FrozenTrial(
            number=number, state=TrialState.RUNNING, value=None, datetime_start=started,
            datetime_complete=None, params=config, distributions=space.distributions,
            user_attrs={"worker": f"w{number}"},  # each claim's, written right after its ask
            system_attrs={}, intermediate_values={}, trial_id=number))
    assert claims.conflict(study, space, 0, space.key(configs[0]), trials=1) == conflict
    assert claims.conflict(study, space, 1, space.key(configs[1]), trials=1) == "surplus"


def test_a_ctrl_c_during_a_claim_waits_for_its_storage_calls_then_releases_the_claims(
        land, tmp_path, monkeypatch):
    """A Ctrl-C that arrives while a claim reads the study (CI once saw one stop a read half
    way, and the release that followed found the SQLite file locked) is raised when the
    claim's storage calls are done; the search then gives its claims back."""
    import os
    import signal

    from autotune import claims

    conflict, finished = claims.conflict, []

    def interrupted_conflict(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if len(finished) == 3:  # the fourth claim
            os.kill(os.getpid(), signal.SIGINT)
        result = conflict(*args, **kwargs)
        finished.append(result)
        return result

    monkeypatch.setattr(claims, "conflict", interrupted_conflict)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    rec = Recorder(land)
    with pytest.raises(KeyboardInterrupt):
        search(land.space, rec, storage=url, study_name="s", trials=10, seed=0,
               prepare=lambda config: None)
    assert len(finished) == 4  # the interrupted claim's read ran to its end
    trials = optuna.load_study(study_name="s", storage=url).get_trials(deepcopy=False)
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    released = [t for t in trials if t.user_attrs.get("status") == "interrupted"]
    assert len(released) == 2 and len(rec.calls) == 2  # 0 and 1 measured; 2 and 3 given back


def test_a_second_ctrl_c_during_the_release_still_gives_every_claim_back(land, tmp_path,
                                                                          monkeypatch):
    """A Ctrl-C that lands while the claims of an interrupted search are given back waits
    until all are released: a claim left RUNNING would hold a slot of the rerun's budget."""
    import os
    import signal

    from autotune import claims

    fail = claims.fail

    def interrupted_fail(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, at the first release
        fail(*args, **kwargs)

    calls = []

    def measure(config):  # noqa: ANN001, ANN202
        calls.append(config)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the first Ctrl-C, with this claim and the next held
        return land.measure(config)

    monkeypatch.setattr(claims, "fail", interrupted_fail)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    with pytest.raises(KeyboardInterrupt):
        search(land.space, measure, storage=url, study_name="s", trials=10, seed=0,
               prepare=lambda config: None)
    trials = optuna.load_study(study_name="s", storage=url).get_trials(deepcopy=False)
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    assert len([t for t in trials if t.user_attrs.get("status") == "interrupted"]) == 2


WORKER = textwrap.dedent("""
    import json, pathlib, sys, time
    import optuna
    from autotune.landscape import load_landscape
    from autotune.search import search
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    land = load_landscape(sys.argv[1])
    ready = pathlib.Path(sys.argv[4])  # both workers start searching once both have imported
    (ready / sys.argv[3]).touch()
    deadline = time.monotonic() + 60
    while len(list(ready.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    calls = []
    def measure(config):
        calls.append(list(land.key(config)))
        time.sleep(0.01)
        return land.measure(config)
    result = search(land.space, measure, storage=sys.argv[2], study_name="shared", trials=30,
                    seed=int(sys.argv[3]))
    print(json.dumps({"calls": calls, "measured": result.measured}))
""")


def test_two_processes_share_one_sqlite_study_without_locks_or_duplicates(land, tmp_path):
    path = write_landscape(tmp_path / "synthetic.json.gz")
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    optuna.create_study(storage=url, study_name="shared")  # both workers then load it
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(path), url, str(seed), str(ready)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in (1, 2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
        assert "locked" not in err
    calls = [tuple(c) for out, _ in outputs for c in json.loads(out)["calls"]]
    assert len(calls) == len(set(calls)) == 30
    assert all(json.loads(out)["calls"] for out, _ in outputs)  # both workers measured
    measured = [t for t in optuna.load_study(study_name="shared", storage=url).trials
                if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(measured) == 30


SLOW_WORKER = textwrap.dedent("""
    import json, sys, time
    import optuna
    from autotune.search import search
    from autotune.searchspace import Space
    from autotune.trials import Measurement
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    def measure(config):
        time.sleep(float(sys.argv[2]))
        return Measurement(1.0 + config["x"])
    result = search(Space({"x": list(range(8))}), measure, storage=sys.argv[1],
                    study_name="shared", trials=4, seed=int(sys.argv[3]))
    print(json.dumps({"measured": result.measured}))
""")


def test_a_worker_in_another_pid_namespace_leaves_a_live_claim_alone(tmp_path):
    """Two containers of one hostname (host networking) share a study: each counts its pids
    from 1, so a claim's pid says nothing in the other. The second must not take the first's
    live claim for a dead process's (the first then crashed writing its measurement)."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    optuna.create_study(storage=url, study_name="shared")
    first = subprocess.Popen([sys.executable, "-c", SLOW_WORKER, url, "4", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    study = optuna.load_study(study_name="shared", storage=url)
    deadline = time.monotonic() + 60
    while not study.get_trials(states=(optuna.trial.TrialState.RUNNING,)):
        assert time.monotonic() < deadline and first.poll() is None, first.communicate()
        time.sleep(0.1)
    isolated = ["unshare", "--pid", "--fork", "--mount-proc"]
    probe = subprocess.run([*isolated, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        first.kill()
        pytest.skip(f"cannot start a pid namespace here (needs root): {probe.stderr.strip()}")
    second = subprocess.run([*isolated, sys.executable, "-c", SLOW_WORKER, url, "0", "2"],
                            capture_output=True, text=True, timeout=120)
    out, err = first.communicate(timeout=120)
    assert second.returncode == 0, second.stderr
    assert first.returncode == 0, err
    statuses = [t.user_attrs.get("status") for t in
                optuna.load_study(study_name="shared", storage=url).trials]
    assert "orphan" not in statuses, statuses


def test_measurement_rejects_inconsistent_outcomes():
    with pytest.raises(ValueError, match="finite value"):
        Measurement(None)
    with pytest.raises(ValueError, match="carries no value"):
        Measurement(1.0, "compile_error")
    assert not Measurement.failure("vmem_oom", compile_s=2.0).ok


def test_space_rejects_bad_declarations():
    with pytest.raises(ValueError, match="repeats a value"):
        Space({"a": [1, 1]})
    with pytest.raises(ValueError, match="no values"):
        Space({"a": []})


def test_sqlite_study_is_kept_in_wal_mode_and_an_in_memory_url_still_works(tmp_path):
    space = Space({"a": [1, 2, 3]})
    path = tmp_path / "study.db"
    result = search(space, lambda c: Measurement(float(c["a"])), storage=f"sqlite:///{path}",
                    trials=3, seed=0)
    assert result.measured == 3
    with sqlite3.connect(path) as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    memory = search(space, lambda c: Measurement(float(c["a"])), storage="sqlite://",
                    trials=3, seed=0)
    assert memory.measured == 3 and memory.best.value == 1.0


def test_warm_seeds_are_a_hedge_the_search_after_them_is_the_cold_search(land):
    """Seeds are measured first, but neither model learns from them: what follows is exactly
    the cold search (same seed), so a misleading seed costs its own trials and no more."""
    cold = Recorder(land)
    search(land.space, cold, trials=len(land.records), seed=3)
    seeds = [dict(zip(land.params, key, strict=True)) for key in cold.calls[-2:]]
    warm = Recorder(land)
    search(land.space, warm, trials=17, seeds=seeds, seed=3)
    assert warm.calls[:2] == cold.calls[-2:]
    assert warm.calls[2:] == cold.calls[:15]


def test_tpe_view_is_multivariate_with_the_constant_liar_on_every_optuna_version():
    """The searcher's TPE and the plain-TPE baseline run with Optuna 5's defaults, set
    explicitly: Optuna 4's defaults (independent per parameter) make another, worse searcher
    (see tpe_sampler). On Optuna 5 the two are the same, so the samplers' own settings are
    asserted, and then that the view asks exactly what such a sampler asks in a plain study of
    the same objective."""
    space = Space(PARAMS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no experimental-feature warning reaches the user
        view = PlainTPEView(space, seed=0)
    for sampler in (view._study.sampler, create_sampler("plain-tpe", space, 0)):  # and baseline
        assert (sampler._multivariate, sampler._constant_liar) == (True, True)

    def fresh_configs(sampler) -> list:
        """The first 25 distinct configs a plain study of ``_time`` asks, repeats told."""
        study, seen = optuna.create_study(sampler=sampler), []
        while len(seen) < 25:
            trial = study.ask(space.distributions)
            key = space.key(trial.params)
            study.tell(trial, _time(trial.params["a"], trial.params["b"], trial.params["c"]))
            if key not in seen:
                seen.append(key)
        return seen

    outcomes, asked = {}, []
    for _ in range(25):
        config = view.propose(outcomes, set(outcomes))
        asked.append(space.key(config))
        outcomes[asked[-1]] = _time(config["a"], config["b"], config["c"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # Optuna 4
        assert asked == fresh_configs(TPESampler(seed=0, multivariate=True, constant_liar=True))
        assert asked != fresh_configs(TPESampler(seed=0, multivariate=False))  # the choice shows


def test_tpe_restarts_after_restart_after_measurements_without_a_new_best():
    space = Space({"x": list(range(200))})
    sampler = EngineSampler(space, "tpe", seed=0)
    study = optuna.create_study(sampler=sampler)
    study.optimize(lambda t: 1.0 + 0 * t.suggest_categorical("x", space.params["x"]),
                   n_trials=3 * (RESTART_AFTER + 5) + 1)
    # All tie, so the first config of each restart stays its best. After it, 30 configs, then
    # its (at most four: x +- 1, 2x, x/2) untaken neighbours are polished, then the view
    # restarts: three times within 3 * (1 + 30 + 4) trials, a fourth not before 4 * 31.
    assert sampler.restarts == 3
    improving = EngineSampler(space, "tpe", seed=0)
    optuna.create_study(sampler=improving).optimize(
        lambda t: 1000.0 - t.number + 0 * t.suggest_categorical("x", space.params["x"]),
        n_trials=RESTART_AFTER + 10)
    assert improving.restarts == 0
    assert len({t.params["x"] for t in study.trials}) == len(study.trials)  # no repeats


def test_a_stalled_search_polishes_the_best_config_to_a_local_optimum_before_restarting():
    space = Space({"x": list(range(100)), "mode": ["a", "b", "c"]})
    sampler = EngineSampler(space, "tpe", seed=0)
    study = optuna.create_study(sampler=sampler)
    # A stalled history: the first config is the best, and RESTART_AFTER configs (none of its
    # neighbours) brought nothing better.
    history = [(50, "a", 1.0)] + [(x, "b", 2.0) for x in range(RESTART_AFTER)]
    for x, mode, value in history:
        study.add_trial(optuna.trial.create_trial(
            params={"x": x, "mode": mode}, distributions=space.distributions, value=value))
    asked, restarts = [], []

    def objective(trial: optuna.Trial) -> float:
        x, mode = trial.suggest_categorical("x", list(range(100))), trial.suggest_categorical(
            "mode", ["a", "b", "c"])
        asked.append((x, mode))
        restarts.append(sampler.restarts)
        return 0.9 if (x, mode) == (51, "a") else 3.0  # one neighbour is faster

    study.optimize(objective, n_trials=7)
    # Neighbours of 50/a until 51/a wins, then those of 51/a (50/a is taken); then the view
    # restarts, and only then.
    assert asked[:5] == [(49, "a"), (51, "a"), (52, "a"), (51, "b"), (51, "c")]
    assert restarts == [0, 0, 0, 0, 0, 1, 1]


def test_after_a_restart_the_search_polishes_the_best_config_of_the_new_basin():
    space = Space({"x": list(range(100)), "mode": ["a", "b", "c"]})
    sampler = EngineSampler(space, "tpe", seed=0)
    study = optuna.create_study(sampler=sampler)
    # A stalled history whose best, 50/a, is already a local optimum (every neighbour measured):
    # the first ask restarts at once, and what follows is the new basin's search.
    best_neighbours = [(49, "a"), (51, "a"), (25, "a"), (50, "b"), (50, "c")]
    history = [(50, "a", 1.0)] + [(x, m, 2.5) for x, m in best_neighbours] + [
        (x, "b", 2.5) for x in range(RESTART_AFTER)]
    for x, mode, value in history:
        study.add_trial(optuna.trial.create_trial(
            params={"x": x, "mode": mode}, distributions=space.distributions, value=value))
    asked, restarts, values = [], [], {}

    def objective(trial: optuna.Trial) -> float:
        x, mode = trial.suggest_categorical("x", list(range(100))), trial.suggest_categorical(
            "mode", ["a", "b", "c"])
        asked.append((x, mode))
        restarts.append(sampler.restarts)
        # No gradient for the search to follow, and never better than 50/a.
        values[x, mode] = 2.0 + (x * 37 + ord(mode)) % 101 / 1000
        return values[x, mode]

    study.optimize(objective, n_trials=RESTART_AFTER + 1)
    assert restarts[:RESTART_AFTER] == [1] * RESTART_AFTER
    # The new basin stalled too: its own best is polished (50/a has no untaken neighbour
    # left), before the next restart.
    x, mode = min(asked[:RESTART_AFTER], key=values.__getitem__)
    neighbours = {(c["x"], c["mode"]) for c in space.neighbours({"x": x, "mode": mode})}
    assert asked[RESTART_AFTER] in neighbours
    assert restarts[RESTART_AFTER] == 1


def test_a_restarted_tpe_view_models_the_forest_picks_made_after_the_restart(monkeypatch):
    # The restart's new view starts empty but is told what the forest (fitted to the whole
    # history) measures from then on: a view that modelled only its own proposals lost
    # convolution-A100's 10th percentile at 200 configs, 0.931 -> 0.685 (see EngineSampler).
    space = Space({"x": list(range(200))})
    sampler = EngineSampler(space, "tpe", seed=0)
    picks: list[tuple[int, int, int]] = []  # (own measurements, restarts, x) per forest pick
    original = ForestSurrogate.propose

    def recording(self, outcomes, taken):
        pick = original(self, outcomes, taken)
        if pick is not None:
            picks.append((len(outcomes), sampler.restarts, pick["x"]))
        return pick

    monkeypatch.setattr(ForestSurrogate, "propose", recording)
    trials = 2 * RESTART_AFTER  # the second restart comes after 1 + 30 + (0 to 4) + 30
    optuna.create_study(sampler=sampler).optimize(  # all tie: a restart after the first stall
        lambda t: 1.0 + 0 * t.suggest_categorical("x", space.params["x"]), n_trials=trials)
    assert sampler.restarts == 1
    # A pick is told to TPE at TPE's next proposal, at most two configs later.
    after = {x for n, restarts, x in picks if restarts == 1 and n <= trials - 3}
    modelled = {t.params["x"] for t in sampler._tpe._study.trials
                if t.state == optuna.trial.TrialState.COMPLETE}
    assert len(after) >= 4 and after <= modelled


def test_neighbours_move_one_parameter_one_step():
    space = Space({"tile": [128, 256, 512], "mode": ["a", "b", "c"], "flag": [False, True]},
                  is_legal=lambda c: (c["tile"], c["mode"]) != (512, "a"))
    moves = [{k: v for k, v in c.items() if c[k] != {"tile": 256, "mode": "a", "flag": False}[k]}
             for c in space.neighbours({"tile": 256, "mode": "a", "flag": False})]
    # Numbers move to the adjacent declared value (the illegal 512/a is left out), choices
    # and flags to each other value.
    assert moves == [{"tile": 128}, {"mode": "b"}, {"mode": "c"}, {"flag": True}]
    # A number also moves to its double and its half where they are declared, as declared.
    sizes = Space({"block": [16, 32, 48, 64, 96, 128]})
    assert [c["block"] for c in sizes.neighbours({"block": 64})] == [48, 96, 32, 128]
    assert [c["block"] for c in sizes.neighbours({"block": 48})] == [32, 64, 96]
    assert all(type(c["block"]) is int for c in sizes.neighbours({"block": 64}))
    assert [c["stages"] for c in Space({"stages": [0, 1, 2]}).neighbours({"stages": 0})] == [1]


@pytest.mark.parametrize("ahead", [1, 3])
def test_configs_are_prepared_ahead_measured_in_claim_order_and_the_budget_holds(
        land, tmp_path, ahead):
    """With ``ahead`` the search claims (and prepares) that many configs past the one it
    measures: the compiles of several overlap a measurement. Every prepared config is measured
    in the order prepared, within the budget, and no claim is left running."""
    prepared: list = []
    rec = Recorder(land)

    def measure(config):  # noqa: ANN001, ANN202
        # When config i is measured, configs up to i + ahead are prepared (the budget allowing).
        assert len(prepared) == min(len(rec.calls) + 1 + ahead, 7)
        return rec(config)

    url = f"sqlite:///{tmp_path / 'study.db'}"
    result = search(land.space, measure, storage=url, study_name="s", trials=7, seed=0,
                    prepare=lambda config: prepared.append(land.key(config)), ahead=ahead)
    assert result.measured == 7 and rec.calls == prepared
    trials = optuna.load_study(study_name="s", storage=url).get_trials(deepcopy=False)
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]


def test_a_stop_rule_gives_back_every_claim_made_ahead(land, tmp_path):
    """A search stopped by its patience while three configs are claimed ahead gives all three
    back (status ``surplus``) instead of leaving them running in the study."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    rec = Recorder(land)
    result = search(land.space, rec, storage=url, study_name="s", trials=40, seed=0,
                    patience=1, prepare=lambda config: None, ahead=3)
    assert result.stop_reason == "patience"
    trials = optuna.load_study(study_name="s", storage=url).get_trials(deepcopy=False)
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    assert len([t for t in trials if t.user_attrs.get("status") == "surplus"]) == 3
