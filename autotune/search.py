"""The claim-and-measure loop of the tuner's search, independent of any kernel.

``search(space, measure, ...)`` runs (or resumes) an Optuna study in an RDB storage given by URL
(or in memory) and returns the best config found. It measures only legal configs that the study
has not measured yet, so several workers (processes or machines) pointing at the same database
cooperate on one study, and a killed job resumes where it stopped.

The parts it composes: the samplers (:mod:`autotune.samplers`), the trial and measurement
contract (:mod:`autotune.trials`), the claims of a shared study (:mod:`autotune.claims`:
heartbeats, racing claims, dead and interrupted workers' claims), the storage opener and trial
layout (:mod:`storage.studies`). Each trial also carries the user attrs ``measure_s`` (seconds in
``measure``), ``worker`` and every attr of its :class:`Measurement`. A failed measurement is
stored PRUNED (TPE ranks pruned trials below every completed one, so it learns to avoid the
region; FAIL trials it ignores).
"""

from __future__ import annotations

import json
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage, RDBStorage, fail_stale_trials
from optuna.trial import FrozenTrial, TrialState

import autotune.claims as claims
from autotune.failures import ChipStateCorrupted
from autotune.samplers import SamplerName, create_sampler
from autotune.samplers.engine import EngineSampler
from autotune.samplers.plain_tpe import STALL, quiet_create_study
from autotune.searchspace import Config, Key, Space
from autotune.trials import (
    FINISHED,
    OK,
    SEED_ATTR,
    Measure,
    Measurement,
    OnTrial,
    TrialResult,
    is_measurement,
    trial_result,
    trial_status,
)
from kernel import AutotuneError
from storage.studies import get_storage

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


@dataclass
class _View:
    """The study as one worker sees it before asking for its next trial."""

    measured: list[FrozenTrial]  # finished measurements, by trial number
    running: list[FrozenTrial]  # claims that hold a slot of the budget
    orphans: list[FrozenTrial]  # RUNNING trials whose worker died inside ``ask`` (orphan)
    waiting: int
    keys: set[Key]  # configs measured, being measured or queued

    @classmethod
    def read(cls, study: optuna.Study, space: Space) -> _View:
        trials = study.get_trials(deepcopy=False)
        names = set(space.names)
        running: list[FrozenTrial] = []
        orphans: list[FrozenTrial] = []
        for t in trials:  # one orphan test per trial: its age must not change between lists
            if t.state == TrialState.RUNNING:
                (orphans if claims.orphan(t, names) else running).append(t)
        orphaned = {t.number for t in orphans}  # their configs are free to claim
        return cls(
            measured=[t for t in trials if is_measurement(t)],
            running=running,
            orphans=orphans,
            waiting=sum(t.state == TrialState.WAITING for t in trials),
            keys={space.key(t.params) for t in trials if t.state != TrialState.FAIL
                  and t.params.keys() >= names and t.number not in orphaned},
        )

    def best(self) -> FrozenTrial | None:
        return _best_measurement(self.measured)

    def since_best(self) -> int:
        return measured_since_best(self.measured)

    def curve(self) -> list[float | None]:
        out: list[float | None] = []
        best = None
        for t in self.measured:
            if trial_status(t) == OK and (best is None or t.value < best):
                best = t.value
            out.append(best)
        return out


def _best_measurement(measured: Iterable[FrozenTrial]) -> FrozenTrial | None:
    """The fastest ok one of ``measured`` (the earlier of equal times), or None."""
    ok = [t for t in measured if trial_status(t) == OK]
    return min(ok, key=lambda t: (t.value, t.number)) if ok else None


def measured_since_best(measured: list[FrozenTrial]) -> int:
    """How many of ``measured`` came after the fastest (all of them without an ok one): what
    ``patience`` is compared with."""
    best = _best_measurement(measured)
    return len(measured) if best is None else sum(t.number > best.number for t in measured)


def _measure(measure: Measure, config: Config) -> Measurement:
    """Calls ``measure``; an exception becomes a ``runtime_error`` measurement, except a
    corrupt chip, which ends the search."""
    try:
        result = measure(dict(config))
    except ChipStateCorrupted:
        raise
    except Exception as exc:  # noqa: BLE001 - a failing config must not end the study
        return Measurement.failure("runtime_error", error=f"{type(exc).__name__}: {exc}")
    if not isinstance(result, Measurement):
        raise TypeError(f"measure() must return a Measurement, got {type(result).__name__}")
    return result


def _enqueue_seeds(study: optuna.Study, space: Space, seeds: Iterable[Mapping[str, Any]],
                   view: _View) -> None:
    """Queues the legal ``seeds`` not measured, being measured or queued (by an earlier run:
    a resume, or another worker joining, would queue them again)."""
    waiting = study._get_trials(deepcopy=False, states=(TrialState.WAITING,), use_cache=False)
    fixed = [t.system_attrs.get("fixed_params", {}) for t in waiting]
    queued = set(view.keys) | {space.key(f) for f in fixed if f.keys() >= set(space.names)}
    for seed in seeds:
        missing = [n for n in space.names if n not in seed]
        if missing:
            raise ValueError(f"seed config {dict(seed)} lacks parameter(s) {missing}")
        config = {n: seed[n] for n in space.names}
        key = space.key(config)
        if key in queued or not space.is_legal(config):
            continue
        queued.add(key)
        study.enqueue_trial(config, user_attrs={SEED_ATTR: True})


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
    ahead: int = 1,
    of: Mapping[str, Any] | None = None,
) -> SearchResult:
    """Runs or resumes the study ``study_name`` until one of the stop rules holds.

    ``storage``: a URL (``sqlite:///autotune.db``, ``postgresql+psycopg://...``), a storage
    from :func:`storage.studies.get_storage`, or None (in memory). ``trials``: the study-wide number of
    measured configs to reach (a resumed study counts what it already has; cooperating workers
    share it). ``timeout``: wall seconds of this call. ``patience``: stop when that many
    measured configs in a row brought no improvement (None: off). ``seeds``: configs measured first
    (illegal or already-known ones are skipped). ``on_trial(result, best)`` runs after each
    measurement of this call. Illegal and repeated configs never reach ``measure`` and never
    count. An exception in ``measure`` is recorded as a ``runtime_error``. ``prepare(config)``,
    when given, is called for each config as soon as it is claimed, and the next ``ahead``
    configs are claimed before the current one is measured, so that slow preparation (an
    ahead-of-time compile, several at once) of the next configs overlaps the measurement of
    this one.

    ``of``: what the study searches (tune: the problem and kernel; replay: the landscape), JSON
    values kept on the study; a study made for other values raises ``StudyMismatchError`` (a
    reused study name would mix two searches). The space is not compared: a resume after a
    JAX upgrade may declare other pipeline depths.

    When the call ends with an exception (Ctrl-C, a failing ``on_trial``), this worker's
    unfinished claims are given back (FAIL, status ``interrupted``), so a rerun measures their
    configs at once; a Ctrl-C while Optuna creates a trial waits until the trial is claimed.
    """
    if trials < 0:
        raise ValueError(f"trials must be >= 0, got {trials}")
    if ahead < 1:
        raise ValueError(f"ahead must be >= 1, got {ahead}")
    optuna_storage = storage if isinstance(storage, BaseStorage) else get_storage(storage)
    engine = create_sampler(sampler, space, seed)
    study = quiet_create_study(storage=optuna_storage, study_name=study_name,
                               direction="minimize", sampler=engine, load_if_exists=True)
    declared = study.user_attrs.get("params")
    if declared is None:
        study.set_user_attr("params", space.params)
        study.set_user_attr("sampler", sampler)
    elif list(declared) != space.names:  # a tune study given to replay, or the reverse
        raise StudyMismatchError(
            f"study {study_name!r} searches other parameters ({', '.join(declared)}) than this "
            f"one ({', '.join(space.names)}); name another study (--study), or leave --study "
            "out for the default name")
    _claim_study(study, of or {})
    process = claims.process_identity()
    claims.release_dead_claims(study, process)
    view = _View.read(study, space)
    _enqueue_seeds(study, space, seeds, view)
    return _Search(study, optuna_storage, space, measure, sampler=sampler, trials=trials,
                   timeout=timeout, patience=patience, on_trial=on_trial, prepare=prepare,
                   ahead=ahead, process=process, view=view).run()


class _Search:
    """One worker's pass over an opened study: claims the next config (and, when ``prepare``
    is given, the ``ahead`` after it), measures it under a heartbeat, records it, until a stop
    rule holds; on an exception, gives its unfinished claims back."""

    def __init__(self, study: optuna.Study, storage: BaseStorage, space: Space,
                 measure: Measure, *, sampler: SamplerName, trials: int,
                 timeout: float | None, patience: int | None, on_trial: OnTrial | None,
                 prepare: Callable[[Config], None] | None, ahead: int, process: str | None,
                 view: _View) -> None:
        self.study, self.storage, self.space, self.measure = study, storage, space, measure
        self.sampler, self.trials, self.timeout, self.patience = sampler, trials, timeout, patience
        self.on_trial, self.prepare, self.process, self.view = on_trial, prepare, process, view
        self.ahead = ahead if prepare is not None else 0
        self.worker = claims.worker_name()
        self.start = time.perf_counter()
        self.measure_total = 0.0
        self.own: list[TrialResult] = []
        self.stalled = 0
        self.own_claims: set[int] = set()  # numbers of the trials this call created
        self.beats = isinstance(storage, RDBStorage) and bool(storage.get_heartbeat_interval())
        # Optuna's own default grace: two heartbeat intervals.
        self.grace_s = self.beats and (storage.grace_period
                                       or 2 * storage.get_heartbeat_interval())
        # Known exhaustion: asking a sampler when no legal config is left costs it thousands of
        # proposals (plain TPE stores each as a trial) before it gives up.
        listed = space.legal_configs()
        self.legal = None if listed is None else {space.key(c) for c in listed}
        self.distributions = space.distributions

    def run(self) -> SearchResult:
        try:
            reason = self._loop()
        except BaseException:
            with claims.interrupt_deferred():  # a second Ctrl-C must not stop the release
                claims.release(self.study, self.own_claims)
            raise
        view = _View.read(self.study, self.space)
        best = view.best()
        return SearchResult(
            study_name=self.study.study_name,
            best=trial_result(self.space, best) if best is not None else None,
            measured=len(view.measured),
            curve=view.curve(),
            trials=self.own,
            stop_reason=reason,
            overhead_s=time.perf_counter() - self.start - self.measure_total,
        )

    def _loop(self) -> str:
        """Measures claimed configs until a stop rule holds; its stop reason."""
        pending: deque[tuple[optuna.Trial, Config]] = deque()  # claimed ahead, measured next
        while True:
            if not pending:
                claimed = self._claim()
                if isinstance(claimed, str):
                    return claimed
            else:
                claimed = pending.popleft()
                reason = self._still_wanted()
                if reason:
                    self._drop_surplus([claimed[0], *(trial for trial, _ in pending)])
                    return reason
            while len(pending) < self.ahead:
                ahead = self._claim()
                if isinstance(ahead, str):
                    break
                pending.append(ahead)
            self._measure_and_record(*claimed, ahead=[trial for trial, _ in pending])

    def _still_wanted(self) -> str:
        """Whether a config claimed ahead is still to be measured: "" if so, else the stop
        reason."""
        with claims.interrupt_deferred():  # as in _claim()
            self.view = _View.read(self.study, self.space)
            # The trial claimed ahead is already counted as running, within the budget.
            return _stop_reason(self.view, self.trials + 1, self.patience, self.timeout,
                                self.start, self.stalled)

    def _drop_surplus(self, trials: list[optuna.Trial]) -> None:
        """Gives back claims made ahead that a stop rule left unmeasured."""
        with claims.interrupt_deferred():  # as in _claim()
            for trial in trials:
                claims.drop(self.study, trial, "surplus")

    def _measure_and_record(self, trial: optuna.Trial, config: Config,
                            ahead: list[optuna.Trial]) -> None:
        """Measures ``config`` (heartbeats for it and the claims ``ahead``), records it on its
        trial and tells ``on_trial``."""
        t0 = time.perf_counter()
        with ExitStack() as beating:
            for claimed in (trial, *ahead):
                beating.enter_context(claims.heartbeat(self.storage, claimed._trial_id))
            measurement = _measure(self.measure, config)
        measure_s = time.perf_counter() - t0
        self.measure_total += measure_s
        with claims.interrupt_deferred():  # as in _claim()
            recorded = _record(self.study, trial, measurement, measure_s, self.worker)
        if not recorded:  # another worker took the claim for a dead one's and failed it
            return
        result = TrialResult(trial.number, config, measurement, measure_s)
        self.own.append(result)
        if self.on_trial is not None:
            best = self.view.best()
            best_result = trial_result(self.space, best) if best is not None else None
            if measurement.ok and (best_result is None or measurement.value < best_result.value):
                best_result = result
            self.on_trial(result, best_result)

    def _claim(self) -> tuple[optuna.Trial, Config] | str:
        """The next config this worker may measure, claimed in the study and prepared, or a
        stop reason. A trial claimed but not yet measured counts as running, so within the
        budget. A Ctrl-C waits for the study's reads and writes: one that stopped a read half
        way once left the SQLite file locked for the release that followed; it can still land
        in ``prepare`` (a compile), as in a measurement."""
        with claims.interrupt_deferred():
            claimed = self._claim_in_study()
        if self.prepare is not None and not isinstance(claimed, str):
            self.prepare(claimed[1])
        return claimed

    def _claim_in_study(self) -> tuple[optuna.Trial, Config] | str:
        study, space = self.study, self.space
        while True:
            self._refresh_view()
            reason = _stop_reason(self.view, self.trials, self.patience, self.timeout,
                                  self.start, self.stalled)
            if reason:
                return reason
            if self.legal is not None and self.legal <= self.view.keys:  # every legal taken
                # The marker a landscape export looks for, as the dropped claim below; added,
                # not asked, since asking would ask the sampler first.
                study.add_trial(optuna.trial.create_trial(
                    state=TrialState.FAIL, user_attrs={"status": "exhausted"}))
                return "exhausted"
            trial = self._ask()
            config = space.config(trial.params)
            key = space.key(config)
            if isinstance(study.sampler, EngineSampler) and study.sampler.exhausted:
                claims.drop(study, trial, "exhausted")  # a space too large to list
                return "exhausted"
            if not space.is_legal(config):  # only plain TPE proposes these
                trial.set_user_attr("status", "illegal")
                study.tell(trial, state=TrialState.PRUNED)
                self.stalled += 1
                continue
            conflict = claims.conflict(study, space, trial.number, key, self.trials)
            if conflict == "duplicate" and self.sampler == "plain-tpe":
                _answer_from_study(study, space, trial, key)
                self.stalled += 1
                continue
            if conflict:
                claims.drop(study, trial, conflict)
                continue
            self.stalled = 0
            return trial, config

    def _refresh_view(self) -> None:
        """Reads the study afresh, after failing the stale claims and expired orphans of
        dead workers."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            fail_stale_trials(self.study)
        self.view = _View.read(self.study, self.space)
        if self.beats and claims.fail_orphans(self.study, self.view.orphans,
                                              set(self.space.names), self.grace_s):
            self.view = _View.read(self.study, self.space)

    def _ask(self) -> optuna.Trial:
        """A new trial, recorded as this call's claim, with a first heartbeat (so that it is
        failed as stale if this worker dies before measuring it). Called within _claim()'s
        held-back Ctrl-C, so no interrupt falls between creating the trial and recording it."""
        with warnings.catch_warnings():
            # heartbeats are sent by claims.heartbeat, not optimize()
            warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
            trial = self.study.ask(self.distributions)
            self.own_claims.add(trial.number)
            if self.process is not None:  # first: what release_claims and a rerun go by
                trial.set_user_attr(claims.PROCESS_ATTR, self.process)
            trial.set_user_attr("worker", self.worker)
            if self.beats:
                self.storage.record_heartbeat(trial._trial_id)
        return trial


class StudyMismatchError(AutotuneError):
    """A study name given to a search of other parameters, or of another problem, kernel or
    landscape, than the study's."""


def _claim_study(study: optuna.Study, attrs: Mapping[str, Any]) -> None:
    """Writes ``attrs`` on a new study; raises ``StudyMismatchError`` when the study already
    holds other values for them."""
    for name, value in attrs.items():
        value = json.loads(json.dumps(value))  # as the storage keeps it (tuples are lists)
        stored = study.user_attrs.get(name)
        if stored is None:
            study.set_user_attr(name, value)
        elif stored != value:
            raise StudyMismatchError(
                f"study {study.study_name!r} holds a search of another {name} than this one; "
                "name another study (--study), or leave --study out for the default name")


def _stop_reason(view: _View, trials: int, patience: int | None, timeout: float | None,
                 start: float, stalled: int) -> str:
    if len(view.measured) + len(view.running) >= trials:
        return "budget"
    if patience is not None and view.measured and view.since_best() >= patience:
        return "patience"
    if timeout is not None and time.perf_counter() - start >= timeout:
        return "timeout"
    if stalled >= STALL:
        return "exhausted"
    return ""


def _answer_from_study(study: optuna.Study, space: Space, trial: optuna.Trial, key: Key) -> None:
    """Plain TPE: tells a repeated config the value it already has, without measuring."""
    for t in study.get_trials(deepcopy=False, states=FINISHED):
        if (is_measurement(t) and t.params.keys() >= set(space.names)
                and space.key(t.params) == key):
            trial.set_user_attr("status", "repeat")
            if t.state == TrialState.COMPLETE:
                study.tell(trial, t.value)
            else:
                study.tell(trial, state=TrialState.PRUNED)
            return
    claims.drop(study, trial, "duplicate")  # the other claim is still running


def _record(study: optuna.Study, trial: optuna.Trial, measurement: Measurement,
            measure_s: float, worker: str) -> bool:
    """Writes the measurement on its trial; False when the trial was failed meanwhile (a
    worker that could not see this process took it for a dead one's: its config is free for
    a new claim, and this result is dropped rather than ending the search)."""
    try:
        trial.set_user_attr("status", measurement.status)
        trial.set_user_attr("measure_s", round(measure_s, 6))
        trial.set_user_attr("worker", worker)
        for name, value in measurement.attrs.items():
            trial.set_user_attr(name, value)
        if measurement.ok:
            study.tell(trial, measurement.value)
        else:
            study.tell(trial, state=TrialState.PRUNED)
    except UpdateFinishedTrialError:
        return False
    return True
