"""Claims of configs in a study that several workers share: who holds which trial, the
heartbeats of the trials being measured, which of two racing claims of a config yields, and
how the claims of dead or interrupted workers go back to the study.

A worker claims a config by creating a RUNNING trial with its params (Optuna's ``ask``); the
trial carries the user attrs ``worker`` (:func:`worker_name`) and ``process``
(:func:`process_identity`). Used by :func:`autotune.search.search` and, for a dead worker's
claims, by :mod:`autotune.workers`.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage, RDBStorage
from optuna.trial import FrozenTrial, TrialState

from autotune.searchspace import Key, Space
from autotune.trials import LIVE, is_measurement

CLAIM_WAIT_S = 2.0  # longest wait for an earlier trial's params to be written
PROCESS_ATTR = "process"  # a claim's process (process_identity), to tell whether it is gone
INTERRUPTED = "interrupted"  # status of this worker's claims given back on Ctrl-C


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


@contextmanager
def heartbeat(storage: BaseStorage, trial_id: int):  # noqa: ANN201
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


def conflict(study: optuna.Study, space: Space, number: int, key: Key, trials: int) -> str:
    """Why this freshly claimed trial must not be measured, or "" when it may.

    Workers claim a config by writing all its params, then re-read the study: a config that is
    finished, or claimed by a trial with a lower number, belongs to the other trial; a trial
    beyond the study-wide budget is surplus. An earlier trial whose params are still being
    written is waited for (briefly: its worker may have died), so of two racing claims the
    later-numbered one always sees the earlier one and no config is measured twice.

    A claim whose params took longer than half that wait to be written (a slow sampler on a
    loaded machine) may have been taken for an orphan by later claims that went on: it also
    yields to a later claim of its config, and counts the later claims against the budget.
    Half, so that clocks of two machines up to ``CLAIM_WAIT_S / 2`` apart still agree on which
    yields (at worst both do, and the config or the slot stays free).
    """
    names = set(space.names)
    written = datetime.now()
    deadline = time.monotonic() + CLAIM_WAIT_S
    while True:
        live = study._get_trials(deepcopy=False, states=LIVE, use_cache=False)
        earlier = [t for t in live
                   if t.number != number and (t.state != TrialState.RUNNING or t.number < number)]
        # A trial still without params after the wait is an orphan: do not wait for it again.
        if time.monotonic() > deadline or not any(
                not t.params.keys() >= names and not orphan(t, names) for t in earlier):
            break
        time.sleep(0.01)

    def holds_key(t: FrozenTrial) -> bool:
        return t.params.keys() >= names and space.key(t.params) == key

    count = 0
    for t in earlier:
        if t.state == TrialState.RUNNING and orphan(t, names):
            continue
        if t.state == TrialState.RUNNING or is_measurement(t):
            count += 1
            if holds_key(t):
                return "duplicate"
    [own] = [t for t in live if t.number == number]
    if own.datetime_start < written - timedelta(seconds=CLAIM_WAIT_S / 2):
        later = [t for t in live if t.number > number and t.state == TrialState.RUNNING
                 and t.params.keys() >= names]
        if any(holds_key(t) for t in later):
            return "duplicate"
        count += len(later)
    return "surplus" if count >= trials else ""


def orphan(trial: FrozenTrial, names: set[str], age_s: float = CLAIM_WAIT_S) -> bool:
    """A RUNNING trial still without params, or without the ``worker`` attr its claim writes
    right after them, ``age_s`` after it started: its worker died inside ``ask`` or before it
    recorded the claim (a full disk: no write went through, the claim's release neither).
    It holds no config and no slot of the budget (:func:`fail_orphans` fails it after the
    heartbeat's grace period)."""
    return not (trial.params.keys() >= names and "worker" in trial.user_attrs) and (
        trial.datetime_start < datetime.now() - timedelta(seconds=age_s))


def fail_orphans(study: optuna.Study, orphans: list[FrozenTrial], names: set[str],
                 grace_s: int) -> bool:
    """Fails (status ``orphan``) those of ``orphans`` (see :func:`orphan`) older than
    ``grace_s``: their workers died while Optuna created them, before their first heartbeat,
    so ``fail_stale_trials`` never sees them. True when there were any."""
    expired = [t for t in orphans if orphan(t, names, grace_s)]
    for trial in expired:
        fail(study, trial._trial_id, "orphan")
    return bool(expired)


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
    mine = [t for t in _running(study) if t.user_attrs.get(attr) == value]
    for t in mine:
        fail(study, t._trial_id, "orphan")
    return len(mine)


def release_dead_claims(study: optuna.Study, process: str | None) -> None:
    """Fails (status ``orphan``) the RUNNING trials of gone processes that ran on this
    machine's boot and in this process's pid namespace, where their pids can be checked
    (``process``: ours, :func:`process_identity`): a run killed by SIGTERM or SIGKILL had no
    time to give its claims back, and its rerun measures their configs and fills the budget at
    once. A claim of another container or machine is left to the heartbeat's grace period: its
    process cannot be seen from here."""
    if process is None:
        return
    here = process.split(":")[:2]
    for t in _running(study):
        claimed = t.user_attrs.get(PROCESS_ATTR)
        parts = claimed.split(":") if isinstance(claimed, str) else []
        if len(parts) == 4 and parts[:2] == here and parts[2].isdigit() \
                and process_identity(int(parts[2])) != claimed:
            fail(study, t._trial_id, "orphan")


def release(study: optuna.Study, numbers: set[int]) -> None:
    """Gives back this worker's trials among ``numbers`` that are still RUNNING."""
    for t in _running(study):
        if t.number in numbers:
            fail(study, t._trial_id, INTERRUPTED)


def _running(study: optuna.Study) -> list[FrozenTrial]:
    return study._get_trials(deepcopy=False, states=(TrialState.RUNNING,), use_cache=False)


def fail(study: optuna.Study, trial_id: int, status: str) -> None:
    """Fails a trial of any worker with ``status``; one another worker finished is left."""
    try:
        study._storage.set_trial_user_attr(trial_id, "status", status)
        study._storage.set_trial_state_values(trial_id, TrialState.FAIL)
    except UpdateFinishedTrialError:
        pass


def drop(study: optuna.Study, trial: optuna.Trial, status: str) -> None:
    """Fails this worker's fresh claim with ``status`` (a duplicate, surplus, ...)."""
    trial.set_user_attr("status", status)
    study.tell(trial, state=TrialState.FAIL)


@contextmanager
def interrupt_deferred():  # noqa: ANN201
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
