"""The tuner's search engine, independent of any kernel.

``search(space, measure, ...)`` runs (or resumes) an Optuna study in an RDB storage given by URL
(or in memory) and returns the best config found. It measures only legal configs that the study
has not measured yet, so several workers (processes or machines) pointing at the same database
cooperate on one study, and a killed job resumes where it stopped.

Samplers (``SAMPLERS``):

- ``tpe`` (default): our searcher, plain TPE's proposals made free plus a forest surrogate.
  Three proposals in five are what Optuna's plain ``TPESampler`` would ask next, but its illegal
  and already-measured proposals are answered in memory (pruned, or the measured outcome)
  instead of costing a trial (``_PlainTPEView``). The other two are the untaken legal
  config of lowest confidence bound under a random forest fitted to the measurements
  (:mod:`autotune.surrogate`): it exploits interactions (tile x vector width, flags that only
  pay together) that TPE's independent per-parameter densities cannot see, while TPE keeps
  exploring. The mix was chosen on the measured landscapes (bench/search.py, 20 seeds):
  forest-only and half-forest searches stall in the deceptive plateaus of the convolution
  landscapes (a flag whose typical configs are slow but whose best config is the optimum), a
  third of forest picks is too few to help on gemm; two in five did best overall.
- ``random``: uniformly random legal unmeasured configs.
- ``grid``: every legal config in lexicographic order of the declared values.
- ``plain-tpe``: the baseline, Optuna's ``TPESampler`` over one categorical per parameter; an
  illegal proposal is told as pruned and a repeated one is answered from the study, both free.

Trial layout (what optuna-dashboard shows): params are the config's real values; user attrs
``status`` (``ok`` or a failure class), ``measure_s`` (seconds in ``measure``), ``worker`` and
every attr of the :class:`Measurement`. A failed measurement is stored PRUNED (TPE ranks pruned
trials below every completed one, so it learns to avoid the region; FAIL trials it ignores).
"""

from __future__ import annotations

import math
import os
import random
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import optuna
from optuna.samplers import BaseSampler, TPESampler
from optuna.storages import BaseStorage, InMemoryStorage, RDBStorage, fail_stale_trials
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import event
from sqlalchemy.engine import make_url

from autotune.space import Config, Key, Space
from autotune.surrogate import ForestSurrogate
from storage.engine import sqlite_pragmas

SamplerName = Literal["tpe", "random", "grid", "plain-tpe"]
SAMPLERS: tuple[str, ...] = ("tpe", "random", "grid", "plain-tpe")

OK = "ok"
# Failure classes a measure function reports; any other non-"ok" string is accepted too.
FAILURES = ("compile_error", "vmem_oom", "runtime_error", "wrong_result", "timeout")
# Trial statuses that are not measurements (never count against the budget).
NOT_MEASURED = frozenset({"illegal", "repeat", "duplicate", "surplus", "exhausted"})

_FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
_LIVE = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
_PLAIN_TPE_STALL = 2000  # consecutive free proposals after which plain TPE counts as stuck
_FOREST_PICKS, _FOREST_CYCLE = 2, 5  # ``tpe``: two proposals in five are the forest's
_FOREST_AFTER = 5  # measured configs before the forest's first pick
_CLAIM_WAIT_S = 2.0  # longest wait for an earlier trial's params to be written


@dataclass(frozen=True)
class Measurement:
    """The outcome of measuring one config: ``value`` (time in ms, lower is better) when
    ``status`` is ``"ok"``, else ``value`` is None and ``status`` names the failure class.
    ``attrs`` (JSON-serialisable: compile_s, spread, error, ...) are stored on the trial."""

    value: float | None = None
    status: str = OK
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status == OK:
            if self.value is None or not math.isfinite(self.value):
                raise ValueError(f"an ok measurement needs a finite value, got {self.value!r}")
        elif self.value is not None:
            raise ValueError(f"a failed measurement ({self.status}) carries no value")
        if self.status in NOT_MEASURED:
            raise ValueError(f"status {self.status!r} is reserved for configs never measured")

    @property
    def ok(self) -> bool:
        return self.status == OK

    @classmethod
    def failure(cls, status: str, **attrs: Any) -> Measurement:
        return cls(None, status, attrs)


Measure = Callable[[Config], Measurement]


@dataclass(frozen=True)
class TrialResult:
    """One measured config of the study."""

    number: int  # Optuna trial number
    config: Config
    measurement: Measurement
    measure_s: float  # wall seconds spent in ``measure``

    @property
    def value(self) -> float | None:
        return self.measurement.value


@dataclass
class SearchResult:
    """What one ``search`` call leaves: study-wide figures and this worker's own trials."""

    study_name: str
    best: TrialResult | None  # study-wide best ok measurement
    measured: int  # study-wide number of measured configs
    curve: list[float | None]  # study-wide best value after each measured config, in order
    trials: list[TrialResult]  # measured by this call
    stop_reason: str  # budget | patience | timeout | exhausted
    overhead_s: float  # wall seconds of this call not spent in ``measure``

    @property
    def overhead_per_trial_s(self) -> float:
        return self.overhead_s / max(1, len(self.trials))


OnTrial = Callable[[TrialResult, TrialResult | None], None]


def open_storage(
    url: str | None, *, heartbeat_interval: int = 10, grace_period: int = 120
) -> BaseStorage:
    """An Optuna storage: in memory for ``None`` (or a SQLite memory URL), else an RDB storage
    on ``url``.

    SQLite gets a 30 s busy timeout so concurrent workers wait for the write lock instead of
    failing with "database is locked", and WAL with ``synchronous = NORMAL`` (as the results
    tables in the same file) so Optuna's many small commits do not each wait for the disk.
    Trials send a heartbeat every ``heartbeat_interval`` s while measured; one silent for
    ``grace_period`` s (its worker was killed) is failed by the next worker, and its config
    becomes measurable again.
    """
    if url is None or (url.startswith("sqlite")
                       and make_url(url).database in (None, "", ":memory:")):
        # One process only; a SQLite memory database would also be one per thread, so the
        # heartbeat thread would not see the study's tables.
        return InMemoryStorage()
    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite"):
        engine_kwargs = {"connect_args": {"timeout": 30}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = RDBStorage(url, engine_kwargs=engine_kwargs,
                             heartbeat_interval=heartbeat_interval, grace_period=grace_period)
    if url.startswith("sqlite"):
        # Each Optuna write commits on its own; WAL without a sync per commit makes those cheap.
        event.listen(storage.engine, "connect", sqlite_pragmas)
        storage.engine.dispose()  # the connections that created the tables lack the pragmas
    return storage


def trial_status(trial: FrozenTrial) -> str:
    return trial.user_attrs.get("status", OK if trial.state == TrialState.COMPLETE else "")


def is_measurement(trial: FrozenTrial) -> bool:
    return trial.state in _FINISHED and trial_status(trial) not in NOT_MEASURED


def _result(space: Space, trial: FrozenTrial) -> TrialResult:
    attrs = {k: v for k, v in trial.user_attrs.items() if k not in ("status", "measure_s")}
    status = trial_status(trial)
    measurement = Measurement(trial.value if status == OK else None, status, attrs)
    return TrialResult(trial.number, space.config(trial.params), measurement,
                       trial.user_attrs.get("measure_s", 0.0))


@dataclass
class _View:
    """The study as one worker sees it before asking for its next trial."""

    measured: list[FrozenTrial]  # finished measurements, by trial number
    running: list[FrozenTrial]
    waiting: int
    keys: set[Key]  # configs measured, being measured or queued

    @classmethod
    def read(cls, study: optuna.Study, space: Space) -> _View:
        trials = study.get_trials(deepcopy=False)
        return cls(
            measured=[t for t in trials if is_measurement(t)],
            running=[t for t in trials if t.state == TrialState.RUNNING],
            waiting=sum(t.state == TrialState.WAITING for t in trials),
            keys={space.key(space.config(t.params)) for t in trials
                  if t.state != TrialState.FAIL and t.params.keys() >= set(space.names)},
        )

    def best(self) -> FrozenTrial | None:
        ok = [t for t in self.measured if trial_status(t) == OK]
        return min(ok, key=lambda t: (t.value, t.number)) if ok else None

    def since_best(self) -> int:
        best = self.best()
        return len(self.measured) if best is None else sum(
            t.number > best.number for t in self.measured)

    def curve(self) -> list[float | None]:
        out: list[float | None] = []
        best = None
        for t in self.measured:
            if trial_status(t) == OK and (best is None or t.value < best):
                best = t.value
            out.append(best)
        return out


class _PlainTPEView:
    """Plain TPE as it would run on this study, kept in this worker's memory.

    Optuna's ``TPESampler`` (independent, default settings) asks in a private in-memory study.
    A proposal that is illegal is told there as pruned, one already measured is told its
    measured outcome, one being measured elsewhere is failed (TPE ignores failed trials), and
    TPE is asked again: all of that is free, no real trial and no measurement. The first fresh
    legal proposal is returned; its real outcome is told when the study has it. Measurements
    that came from elsewhere (seeds, the forest, other workers, an earlier run of the study) are
    added as finished trials, so the view is rebuilt from the study on resume.
    """

    def __init__(self, space: Space, seed: int | None) -> None:
        self._space = space
        level = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "new study" line for a view
        try:
            self._study = optuna.create_study(direction="minimize",
                                              sampler=TPESampler(seed=seed))
        finally:
            optuna.logging.set_verbosity(level)
        self._told: set[Key] = set()
        self._asked: dict[Key, optuna.Trial] = {}

    def propose(self, outcomes: Mapping[Key, float | None], taken: set[Key]) -> Config | None:
        """A fresh legal config (not in ``taken``), or None when TPE keeps proposing known or
        illegal ones. ``outcomes``: every measured config's time, None for a failure."""
        space, study = self._space, self._study
        for key, value in outcomes.items():
            if key in self._told:
                continue
            self._told.add(key)
            trial = self._asked.pop(key, None)
            if trial is not None:
                study.tell(trial, value, state=_outcome_state(value))
            else:
                study.add_trial(optuna.trial.create_trial(
                    params=dict(zip(space.names, key, strict=True)),
                    distributions=space.distributions, value=value,
                    state=_outcome_state(value)))
        for _ in range(_PLAIN_TPE_STALL):
            trial = study.ask(space.distributions)
            config = space.config(trial.params)
            key = space.key(config)
            if not space.is_legal(config):
                study.tell(trial, state=TrialState.PRUNED)
            elif key in outcomes:
                study.tell(trial, outcomes[key], state=_outcome_state(outcomes[key]))
            elif key in taken:
                study.tell(trial, state=TrialState.FAIL)
            else:
                self._asked[key] = trial
                return config
        return None


def _outcome_state(value: float | None) -> TrialState:
    """How a measured outcome is told to TPE: a time completes, a failure (None) is pruned."""
    return TrialState.PRUNED if value is None else TrialState.COMPLETE


class _EngineSampler(BaseSampler):
    """Proposes legal configs the study has not taken: ``tpe``, ``random`` or ``grid``.

    ``tpe`` (see module doc): after ``_FOREST_AFTER`` measurements, ``_FOREST_PICKS`` proposals
    in every ``_FOREST_CYCLE`` are the forest surrogate's; the others are plain TPE's
    (``_PlainTPEView``).
    When TPE has no fresh proposal, a uniformly random legal one is taken.
    """

    def __init__(self, space: Space, mode: str, seed: int | None) -> None:
        self._space = space
        self._rand = random.Random(seed)
        self._grid = space.configs() if mode == "grid" else None
        self._tpe = _PlainTPEView(space, seed) if mode == "tpe" else None
        self._forest = ForestSurrogate(space, seed) if mode == "tpe" else None
        self.exhausted = False

    def infer_relative_search_space(self, study, trial):  # noqa: ANN001, ANN201
        return {n: d for n, d in self._space.distributions.items() if not d.single()}

    def sample_relative(self, study, trial, search_space):  # noqa: ANN001, ANN201
        if "fixed_params" in trial.system_attrs:  # an enqueued seed
            return {}
        others = [t for t in study._get_trials(deepcopy=False, states=_LIVE, use_cache=False)
                  if t.number != trial.number]
        names = set(self._space.names)  # a trial being claimed may lack some params yet
        taken = {self._space.key(t.params) for t in others if t.params.keys() >= names}
        config = self._propose(others, taken)
        self.exhausted = config is None
        return {} if config is None else {n: config[n] for n in search_space}

    def sample_independent(self, study, trial, param_name, param_distribution):  # noqa
        # Reached only for single-valued parameters or when the space is exhausted.
        return self._space.params[param_name][0]

    def _propose(self, others: list[FrozenTrial], taken: set[Key]) -> Config | None:
        space = self._space
        if self._grid is not None:
            for config in self._grid:
                if space.key(config) not in taken and space.is_legal(config):
                    return config
            return None
        if self._tpe is None or self._forest is None:
            return space.random_legal(self._rand, taken)
        outcomes = {space.key(t.params): t.value if trial_status(t) == OK else None
                    for t in others if is_measurement(t)}
        config = None
        if len(outcomes) >= _FOREST_AFTER and len(outcomes) % _FOREST_CYCLE < _FOREST_PICKS:
            config = self._forest.propose(outcomes, taken)
        return (config or self._tpe.propose(outcomes, taken)
                or space.random_legal(self._rand, taken))


def _make_sampler(name: str, space: Space, seed: int | None) -> optuna.samplers.BaseSampler:
    if name == "plain-tpe":
        return TPESampler(seed=seed)
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")
    return _EngineSampler(space, name, seed)


@contextmanager
def _heartbeat(storage: BaseStorage, trial_id: int):  # noqa: ANN202
    """Records the trial's heartbeat while its config is measured (RDB storages only)."""
    interval = storage.get_heartbeat_interval() if isinstance(storage, RDBStorage) else None
    if not interval:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while True:
            storage.record_heartbeat(trial_id)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _measure(measure: Measure, config: Config) -> Measurement:
    """Calls ``measure``; an exception becomes a ``runtime_error`` measurement."""
    try:
        result = measure(dict(config))
    except Exception as exc:  # noqa: BLE001 - a failing config must not end the study
        return Measurement.failure("runtime_error", error=f"{type(exc).__name__}: {exc}")
    if not isinstance(result, Measurement):
        raise TypeError(f"measure() must return a Measurement, got {type(result).__name__}")
    return result


def _enqueue_seeds(study: optuna.Study, space: Space, seeds: Iterable[Mapping[str, Any]],
                   view: _View) -> None:
    queued = set(view.keys)
    for seed in seeds:
        missing = [n for n in space.names if n not in seed]
        if missing:
            raise ValueError(f"seed config {dict(seed)} lacks parameter(s) {missing}")
        config = {n: seed[n] for n in space.names}
        key = space.key(config)
        if key in queued or not space.is_legal(config):
            continue
        queued.add(key)
        study.enqueue_trial(config, user_attrs={"seed": True})


def search(
    space: Space,
    measure: Measure,
    *,
    storage: str | BaseStorage | None = None,
    study_name: str = "search",
    sampler: SamplerName = "tpe",
    trials: int = 100,
    timeout: float | None = None,
    patience: int | None = None,
    seeds: Iterable[Mapping[str, Any]] = (),
    seed: int | None = None,
    on_trial: OnTrial | None = None,
    prepare: Callable[[Config], None] | None = None,
) -> SearchResult:
    """Runs or resumes the study ``study_name`` until one of the stop rules holds.

    ``storage``: a URL (``sqlite:///autotune.db``, ``postgresql+psycopg://...``), a storage
    from :func:`open_storage`, or None (in memory). ``trials``: the study-wide number of
    measured configs to reach (a resumed study counts what it already has; cooperating workers
    share it). ``timeout``: wall seconds of this call. ``patience``: stop when that many
    measured configs in a row brought no improvement. ``seeds``: configs measured first
    (illegal or already-known ones are skipped). ``on_trial(result, best)`` runs after each
    measurement of this call. Illegal and repeated configs never reach ``measure`` and never
    count. An exception in ``measure`` is recorded as a ``runtime_error``. ``prepare(config)``,
    when given, is called for each config as soon as it is claimed, and the next config is
    claimed before the current one is measured, so that slow preparation (an ahead-of-time
    compile) of the next config overlaps the measurement of this one.
    """
    if trials < 0:
        raise ValueError(f"trials must be >= 0, got {trials}")
    optuna_storage = storage if isinstance(storage, BaseStorage) else open_storage(storage)
    engine = _make_sampler(sampler, space, seed)
    distributions = space.distributions
    study = optuna.create_study(storage=optuna_storage, study_name=study_name,
                                direction="minimize", sampler=engine, load_if_exists=True)
    if "params" not in study.user_attrs:
        study.set_user_attr("params", space.params)
        study.set_user_attr("sampler", sampler)
    worker = f"{socket.gethostname()}:{os.getpid()}"
    start = time.perf_counter()
    measure_total = 0.0
    own: list[TrialResult] = []
    stalled = 0
    view = _View.read(study, space)
    _enqueue_seeds(study, space, seeds, view)

    def claim() -> tuple[optuna.Trial, Config] | str:
        """The next config this worker may measure, claimed in the study, or a stop reason.
        A trial claimed but not yet measured counts as running, so within the budget."""
        nonlocal view, stalled
        while True:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                fail_stale_trials(study)
            view = _View.read(study, space)
            reason = _stop_reason(view, trials, patience, timeout, start, stalled)
            if reason:
                return reason
            with warnings.catch_warnings():  # heartbeats are sent by _heartbeat, not optimize()
                warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
                trial = study.ask(distributions)
            config = space.config(trial.params)
            key = space.key(config)
            if isinstance(engine, _EngineSampler) and engine.exhausted:
                _drop(study, trial, "exhausted")
                return "exhausted"
            if not space.is_legal(config):  # only plain TPE proposes these
                trial.set_user_attr("status", "illegal")
                study.tell(trial, state=TrialState.PRUNED)
                stalled += 1
                continue
            conflict = _conflict(study, space, trial.number, key, trials)
            if conflict == "duplicate" and sampler == "plain-tpe":
                _answer_from_study(study, space, trial, key)
                stalled += 1
                continue
            if conflict:
                _drop(study, trial, conflict)
                continue
            stalled = 0
            if prepare is not None:
                prepare(config)
            return trial, config

    pending: tuple[optuna.Trial, Config] | None = None  # claimed ahead, to be measured next
    try:
        while True:
            if pending is None:
                claimed = claim()
                if isinstance(claimed, str):
                    reason = claimed
                    break
            else:
                claimed, pending = pending, None
                view = _View.read(study, space)
                # The trial claimed ahead is already counted as running, within the budget.
                reason = _stop_reason(view, trials + 1, patience, timeout, start, stalled)
                if reason:
                    _drop(study, claimed[0], "surplus")
                    break
            trial, config = claimed
            if prepare is not None:
                ahead = claim()
                pending = None if isinstance(ahead, str) else ahead
            t0 = time.perf_counter()
            try:
                with _heartbeat(optuna_storage, trial._trial_id), (
                        _heartbeat(optuna_storage, pending[0]._trial_id) if pending
                        else nullcontext()):
                    measurement = _measure(measure, config)
            except BaseException:
                study.tell(trial, state=TrialState.FAIL)
                raise
            measure_s = time.perf_counter() - t0
            measure_total += measure_s
            _record(study, trial, measurement, measure_s, worker)
            result = TrialResult(trial.number, config, measurement, measure_s)
            own.append(result)
            if on_trial is not None:
                best = view.best()
                best_result = _result(space, best) if best is not None else None
                if measurement.ok and (best_result is None
                                       or measurement.value < best_result.value):
                    best_result = result
                on_trial(result, best_result)
    finally:
        if pending is not None:  # claimed ahead but never measured: give the config back
            _drop(study, pending[0], "surplus")
    view = _View.read(study, space)
    best = view.best()
    return SearchResult(
        study_name=study_name,
        best=_result(space, best) if best is not None else None,
        measured=len(view.measured),
        curve=view.curve(),
        trials=own,
        stop_reason=reason,
        overhead_s=time.perf_counter() - start - measure_total,
    )


def _stop_reason(view: _View, trials: int, patience: int | None, timeout: float | None,
                 start: float, stalled: int) -> str:
    if len(view.measured) + len(view.running) >= trials:
        return "budget"
    if patience is not None and view.measured and view.since_best() >= patience:
        return "patience"
    if timeout is not None and time.perf_counter() - start >= timeout:
        return "timeout"
    if stalled >= _PLAIN_TPE_STALL:
        return "exhausted"
    return ""


def _conflict(study: optuna.Study, space: Space, number: int, key: Key, trials: int) -> str:
    """Why this freshly claimed trial must not be measured, or "" when it may.

    Workers claim a config by writing all its params, then re-read the study: a config that is
    finished, or claimed by a trial with a lower number, belongs to the other trial; a trial
    beyond the study-wide budget is surplus. An earlier trial whose params are still being
    written is waited for (briefly: its worker may have died), so of two racing claims the
    later-numbered one always sees the earlier one and no config is measured twice.
    """
    names = set(space.names)
    deadline = time.monotonic() + _CLAIM_WAIT_S
    while True:
        earlier = [t for t in study._get_trials(deepcopy=False, states=_LIVE, use_cache=False)
                   if t.number != number and (t.state != TrialState.RUNNING or t.number < number)]
        if all(t.params.keys() >= names for t in earlier) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    count = 0
    for t in earlier:
        if t.state == TrialState.RUNNING or is_measurement(t):
            count += 1
            if t.params.keys() >= names and space.key(t.params) == key:
                return "duplicate"
    return "surplus" if count >= trials else ""


def _answer_from_study(study: optuna.Study, space: Space, trial: optuna.Trial, key: Key) -> None:
    """Plain TPE: tells a repeated config the value it already has, without measuring."""
    for t in study.get_trials(deepcopy=False, states=_FINISHED):
        if is_measurement(t) and t.params.keys() >= set(space.names) and space.key(
                space.config(t.params)) == key:
            trial.set_user_attr("status", "repeat")
            if t.state == TrialState.COMPLETE:
                study.tell(trial, t.value)
            else:
                study.tell(trial, state=TrialState.PRUNED)
            return
    _drop(study, trial, "duplicate")  # the other claim is still running


def _drop(study: optuna.Study, trial: optuna.Trial, status: str) -> None:
    trial.set_user_attr("status", status)
    study.tell(trial, state=TrialState.FAIL)


def _record(study: optuna.Study, trial: optuna.Trial, measurement: Measurement,
            measure_s: float, worker: str) -> None:
    trial.set_user_attr("status", measurement.status)
    trial.set_user_attr("measure_s", round(measure_s, 6))
    trial.set_user_attr("worker", worker)
    for name, value in measurement.attrs.items():
        trial.set_user_attr(name, value)
    if measurement.ok:
        study.tell(trial, measurement.value)
    else:
        study.tell(trial, state=TrialState.PRUNED)
