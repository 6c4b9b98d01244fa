"""The claim-and-measure loop of the tuner's search, independent of any kernel.

``search(space, measure, ...)`` runs (or resumes) an Optuna study in an RDB storage given by URL
(or in memory) and returns the best config found. It measures only legal configs that the study
has not measured yet, so several workers (processes or machines) pointing at the same database
cooperate on one study, and a killed job resumes where it stopped.

The parts it composes: the samplers (:mod:`autotune.samplers`), the trial and measurement
contract (:mod:`autotune.trials`), the storage opener and trial layout
(:mod:`storage.studies`). Each trial also carries the user attrs ``measure_s`` (seconds in
``measure``), ``worker`` and every attr of its :class:`Measurement`. A failed measurement is
stored PRUNED (TPE ranks pruned trials below every completed one, so it learns to avoid the
region; FAIL trials it ignores).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage, RDBStorage, fail_stale_trials
from optuna.trial import FrozenTrial, TrialState

from autotune.samplers import SamplerName, create_sampler
from autotune.samplers.engine import EngineSampler
from autotune.samplers.plain_tpe import STALL
from autotune.searchspace import Config, Key, Space
from autotune.trials import (
    FINISHED,
    LIVE,
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

_CLAIM_WAIT_S = 2.0  # longest wait for an earlier trial's params to be written
PROCESS_ATTR = "process"  # a claim's process (process_identity), to tell whether it is gone
_INTERRUPTED = "interrupted"  # status of this worker's claims given back on Ctrl-C


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
    orphans: list[FrozenTrial]  # RUNNING trials whose worker died inside ``ask`` (_orphan)
    waiting: int
    keys: set[Key]  # configs measured, being measured or queued

    @classmethod
    def read(cls, study: optuna.Study, space: Space) -> _View:
        trials = study.get_trials(deepcopy=False)
        names = set(space.names)
        running: list[FrozenTrial] = []
        orphans: list[FrozenTrial] = []
        for t in trials:  # one _orphan test per trial: its age must not change between lists
            if t.state == TrialState.RUNNING:
                (orphans if _orphan(t, names) else running).append(t)
        return cls(
            measured=[t for t in trials if is_measurement(t)],
            running=running,
            orphans=orphans,
            waiting=sum(t.state == TrialState.WAITING for t in trials),
            keys={space.key(t.params) for t in trials
                  if t.state != TrialState.FAIL and t.params.keys() >= names},
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
    of: Mapping[str, Any] | None = None,
) -> SearchResult:
    """Runs or resumes the study ``study_name`` until one of the stop rules holds.

    ``storage``: a URL (``sqlite:///autotune.db``, ``postgresql+psycopg://...``), a storage
    from :func:`storage.studies.get_storage`, or None (in memory). ``trials``: the study-wide number of
    measured configs to reach (a resumed study counts what it already has; cooperating workers
    share it). ``timeout``: wall seconds of this call. ``patience``: stop when that many
    measured configs in a row brought no improvement. ``seeds``: configs measured first
    (illegal or already-known ones are skipped). ``on_trial(result, best)`` runs after each
    measurement of this call. Illegal and repeated configs never reach ``measure`` and never
    count. An exception in ``measure`` is recorded as a ``runtime_error``. ``prepare(config)``,
    when given, is called for each config as soon as it is claimed, and the next config is
    claimed before the current one is measured, so that slow preparation (an ahead-of-time
    compile) of the next config overlaps the measurement of this one.

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
    optuna_storage = storage if isinstance(storage, BaseStorage) else get_storage(storage)
    engine = create_sampler(sampler, space, seed)
    distributions = space.distributions
    study = optuna.create_study(storage=optuna_storage, study_name=study_name,
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
    process = process_identity()
    _release_dead_claims(study, process)
    worker = worker_name()
    start = time.perf_counter()
    measure_total = 0.0
    own: list[TrialResult] = []
    stalled = 0
    view = _View.read(study, space)
    _enqueue_seeds(study, space, seeds, view)
    beats = isinstance(optuna_storage, RDBStorage) and bool(
        optuna_storage.get_heartbeat_interval())
    # Optuna's own default grace: two heartbeat intervals.
    grace_s = beats and (optuna_storage.grace_period
                         or 2 * optuna_storage.get_heartbeat_interval())
    own_claims: set[int] = set()  # numbers of the trials this call created
    # Known exhaustion: asking a sampler when no legal config is left costs it thousands of
    # proposals (plain TPE stores each as a trial) before it gives up.
    listed = space.legal_configs()
    legal = None if listed is None else {space.key(c) for c in listed}

    def ask() -> optuna.Trial:
        """A new trial, recorded as this call's claim, with a first heartbeat (so that it is
        failed as stale if this worker dies before measuring it). Called within claim()'s
        held-back Ctrl-C, so no interrupt falls between creating the trial and recording it."""
        with warnings.catch_warnings():
            # heartbeats are sent by _heartbeat, not optimize()
            warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
            trial = study.ask(distributions)
            own_claims.add(trial.number)
            if process is not None:  # first: what release_claims and a rerun go by
                trial.set_user_attr(PROCESS_ATTR, process)
            trial.set_user_attr("worker", worker)
            if beats:
                optuna_storage.record_heartbeat(trial._trial_id)
        return trial

    def claim() -> tuple[optuna.Trial, Config] | str:
        """The next config this worker may measure, claimed in the study and prepared, or a
        stop reason. A trial claimed but not yet measured counts as running, so within the
        budget. A Ctrl-C waits for the study's reads and writes: one that stopped a read half
        way once left the SQLite file locked for the release that followed; it can still land
        in ``prepare`` (a compile), as in a measurement."""
        with _interrupt_deferred():
            claimed = claim_in_study()
        if prepare is not None and not isinstance(claimed, str):
            prepare(claimed[1])
        return claimed

    def claim_in_study() -> tuple[optuna.Trial, Config] | str:
        nonlocal view, stalled
        while True:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                fail_stale_trials(study)
            view = _View.read(study, space)
            if beats and _fail_orphans(study, view.orphans, set(space.names), grace_s):
                view = _View.read(study, space)
            reason = _stop_reason(view, trials, patience, timeout, start, stalled)
            if reason:
                return reason
            if legal is not None and legal <= view.keys:  # every legal config taken
                # The marker a landscape export looks for, as the dropped claim below; added,
                # not asked, since asking would ask the sampler first.
                study.add_trial(optuna.trial.create_trial(
                    state=TrialState.FAIL, user_attrs={"status": "exhausted"}))
                return "exhausted"
            trial = ask()
            config = space.config(trial.params)
            key = space.key(config)
            if isinstance(engine, EngineSampler) and engine.exhausted:  # a space too large to list
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
                with _interrupt_deferred():  # as in claim()
                    view = _View.read(study, space)
                    # The trial claimed ahead is already counted as running, within the budget.
                    reason = _stop_reason(view, trials + 1, patience, timeout, start, stalled)
                    if reason:
                        _drop(study, claimed[0], "surplus")
                if reason:
                    break
            trial, config = claimed
            if prepare is not None:
                ahead = claim()
                pending = None if isinstance(ahead, str) else ahead
            t0 = time.perf_counter()
            with _heartbeat(optuna_storage, trial._trial_id), (
                    _heartbeat(optuna_storage, pending[0]._trial_id) if pending
                    else nullcontext()):
                measurement = _measure(measure, config)
            measure_s = time.perf_counter() - t0
            measure_total += measure_s
            with _interrupt_deferred():  # as in claim()
                recorded = _record(study, trial, measurement, measure_s, worker)
            if not recorded:  # another worker took the claim for a dead one's and failed it
                continue
            result = TrialResult(trial.number, config, measurement, measure_s)
            own.append(result)
            if on_trial is not None:
                best = view.best()
                best_result = trial_result(space, best) if best is not None else None
                if measurement.ok and (best_result is None
                                       or measurement.value < best_result.value):
                    best_result = result
                on_trial(result, best_result)
    except BaseException:
        with _interrupt_deferred():  # a second Ctrl-C must not stop the release half way
            _release(study, own_claims)
        raise
    view = _View.read(study, space)
    best = view.best()
    return SearchResult(
        study_name=study_name,
        best=trial_result(space, best) if best is not None else None,
        measured=len(view.measured),
        curve=view.curve(),
        trials=own,
        stop_reason=reason,
        overhead_s=time.perf_counter() - start - measure_total,
    )


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


def _conflict(study: optuna.Study, space: Space, number: int, key: Key, trials: int) -> str:
    """Why this freshly claimed trial must not be measured, or "" when it may.

    Workers claim a config by writing all its params, then re-read the study: a config that is
    finished, or claimed by a trial with a lower number, belongs to the other trial; a trial
    beyond the study-wide budget is surplus. An earlier trial whose params are still being
    written is waited for (briefly: its worker may have died), so of two racing claims the
    later-numbered one always sees the earlier one and no config is measured twice.

    A claim whose params took longer than half that wait to be written (a slow sampler on a
    loaded machine) may have been taken for an orphan by later claims that went on: it also
    yields to a later claim of its config, and counts the later claims against the budget.
    Half, so that clocks of two machines up to ``_CLAIM_WAIT_S / 2`` apart still agree on which
    yields (at worst both do, and the config or the slot stays free).
    """
    names = set(space.names)
    written = datetime.now()
    deadline = time.monotonic() + _CLAIM_WAIT_S
    while True:
        live = study._get_trials(deepcopy=False, states=LIVE, use_cache=False)
        earlier = [t for t in live
                   if t.number != number and (t.state != TrialState.RUNNING or t.number < number)]
        # A trial still without params after the wait is an orphan: do not wait for it again.
        if time.monotonic() > deadline or not any(
                not t.params.keys() >= names and not _orphan(t, names) for t in earlier):
            break
        time.sleep(0.01)

    def holds_key(t: FrozenTrial) -> bool:
        return t.params.keys() >= names and space.key(t.params) == key

    count = 0
    for t in earlier:
        if t.state == TrialState.RUNNING and _orphan(t, names):
            continue
        if t.state == TrialState.RUNNING or is_measurement(t):
            count += 1
            if holds_key(t):
                return "duplicate"
    [own] = [t for t in live if t.number == number]
    if own.datetime_start < written - timedelta(seconds=_CLAIM_WAIT_S / 2):
        later = [t for t in live if t.number > number and t.state == TrialState.RUNNING
                 and t.params.keys() >= names]
        if any(holds_key(t) for t in later):
            return "duplicate"
        count += len(later)
    return "surplus" if count >= trials else ""


def _orphan(trial: FrozenTrial, names: set[str], age_s: float = _CLAIM_WAIT_S) -> bool:
    """A RUNNING trial still without params ``age_s`` after it started: its worker died inside
    ``ask``. It holds no config and no slot of the budget (``_fail_orphans`` fails it after
    the heartbeat's grace period)."""
    return not trial.params.keys() >= names and (
        trial.datetime_start < datetime.now() - timedelta(seconds=age_s))


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
    _drop(study, trial, "duplicate")  # the other claim is still running


def worker_name(pid: int | None = None) -> str:
    """The ``worker`` user attr of the trials a process claims: host and process id."""
    return f"{socket.gethostname()}:{os.getpid() if pid is None else pid}"


def process_identity(pid: int | None = None) -> str | None:
    """The process ``pid`` (default: this one) as ``boot:pid namespace:pid:start time``,
    unique where ``worker_name`` is not: across containers that share a hostname (host
    networking; each counts its pids from 1), reboots and reused pids. None where ``/proc``
    does not say (not Linux, or no such process)."""
    pid = os.getpid() if pid is None else pid
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    start = stat.rpartition(")")[2].split()[19]  # field 22, counted after the command's name
    return f"{boot}:{namespace}:{pid}:{start}"


def release_claims(storage: BaseStorage, study_name: str, worker: str,
                   process: str | None) -> int:
    """Fails (status ``orphan``) the RUNNING trials a process claimed, after it died: those of
    ``process`` (:func:`process_identity`), or where ``/proc`` gave none, of ``worker``
    (:func:`worker_name`). Their configs and budget slots go back to the study at once, not
    after the heartbeat's grace period. Returns how many."""
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:
        return 0
    attr, value = (PROCESS_ATTR, process) if process else ("worker", worker)
    mine = [t for t in study._get_trials(deepcopy=False, states=(TrialState.RUNNING,),
                                         use_cache=False) if t.user_attrs.get(attr) == value]
    for t in mine:
        _fail(study, t._trial_id, "orphan")
    return len(mine)


def _release_dead_claims(study: optuna.Study, process: str | None) -> None:
    """Fails (status ``orphan``) the RUNNING trials of gone processes that ran on this
    machine's boot and in this process's pid namespace, where their pids can be checked
    (``process``: ours, :func:`process_identity`): a run killed by SIGTERM or SIGKILL had no
    time to give its claims back, and its rerun measures their configs and fills the budget at
    once. A claim of another container or machine is left to the heartbeat's grace period: its
    process cannot be seen from here."""
    if process is None:
        return
    here = process.split(":")[:2]
    for t in study._get_trials(deepcopy=False, states=(TrialState.RUNNING,), use_cache=False):
        claimed = t.user_attrs.get(PROCESS_ATTR)
        parts = claimed.split(":") if isinstance(claimed, str) else []
        if len(parts) == 4 and parts[:2] == here and parts[2].isdigit() \
                and process_identity(int(parts[2])) != claimed:
            _fail(study, t._trial_id, "orphan")


def _fail_orphans(study: optuna.Study, orphans: list[FrozenTrial], names: set[str],
                  grace_s: int) -> bool:
    """Fails (status ``orphan``) those of ``orphans`` (see :func:`_orphan`) older than
    ``grace_s``: their workers died while Optuna created them, before their first heartbeat,
    so ``fail_stale_trials`` never sees them. True when there were any."""
    expired = [t for t in orphans if _orphan(t, names, grace_s)]
    for orphan in expired:
        _fail(study, orphan._trial_id, "orphan")
    return bool(expired)


def _release(study: optuna.Study, numbers: set[int]) -> None:
    """Gives back this worker's trials among ``numbers`` that are still RUNNING."""
    for t in study._get_trials(deepcopy=False, states=(TrialState.RUNNING,), use_cache=False):
        if t.number in numbers:
            _fail(study, t._trial_id, _INTERRUPTED)


def _fail(study: optuna.Study, trial_id: int, status: str) -> None:
    """Fails a trial of any worker with ``status``; one another worker finished is left."""
    try:
        study._storage.set_trial_user_attr(trial_id, "status", status)
        study._storage.set_trial_state_values(trial_id, TrialState.FAIL)
    except UpdateFinishedTrialError:
        pass


@contextmanager
def _interrupt_deferred():  # noqa: ANN202
    """Holds a Ctrl-C (SIGINT) back until the block is done (in the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple[Any, ...]] = []
    previous = signal.signal(signal.SIGINT, lambda *args: caught.append(args))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(*caught[0])


def _drop(study: optuna.Study, trial: optuna.Trial, status: str) -> None:
    trial.set_user_attr("status", status)
    study.tell(trial, state=TrialState.FAIL)


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
