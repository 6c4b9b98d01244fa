"""``autotune tune --devices``: one worker process per local device, all on one database.

The parent never imports jax: it starts the workers (:mod:`autotune.worker`, each seeing only
its device, :mod:`autotune.devices`), hands out problems and shows one Rich display. Problems
(each kernel's study of a problem: with a kernel choice, one per candidate) are spread first: a
free worker takes a problem nobody works on; when none is left it joins the study with the
fewest workers that still has budget to claim. Once every candidate of a kernel choice is
tuned or lost, one free worker confirms their winners against each other on its device and
publishes the choice. Workers of one study share its
study-wide budget without measuring a config twice (:mod:`autotune.search`); the last one to
finish searching confirms and publishes, so each problem has one winner, confirmed on one
device. A worker that dies is reported, its claims are released at once (their configs and
budget go back to the study) and its problem is taken over. A worker whose device's state went
corrupt (a config left it so, pallas-facts §10; that config is recorded ``corrupts_state``)
is replaced by a fresh process on the same device, up to MAX_RECYCLES times a device. Ctrl-C
stops every worker; each gives its claims back, and a rerun resumes.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autotune.devices import HOST_WORKERS, worker_env
from autotune.progress import output_console
from kernel import Problem

STOP_WAIT_S = 60.0  # how long a stopped worker may take to give its claims back
STDERR_LINES = 20  # the tail of a dead worker's stderr shown in its report
# Fresh processes one device gets after its state went corrupt. Each corruption records its
# config, which is never measured again, so each fresh process makes progress; a device that
# keeps going corrupt is given up rather than recycled for ever.
MAX_RECYCLES = 5


@dataclass(eq=False)
class _Choice:
    """A kernel choice's candidates and what their tuning left: summaries and failures."""

    kernels: list[str]
    tuned: dict[str, dict[str, Any]] = field(default_factory=dict)
    lost: dict[str, list[str]] = field(default_factory=dict)  # kernel -> [class, detail]

    @property
    def ready(self) -> bool:
        """Every candidate tuned or lost: the choice can be confirmed."""
        return len(self.tuned) + len(self.lost) == len(self.kernels)


@dataclass(eq=False)
class _Problem:
    """One study of the pool (a problem's kernel), or, with ``kernel`` None, the
    confirmation of its kernel ``choice`` on one device once its candidates are tuned."""

    problem: Problem
    kernel: str | None
    choice: _Choice | None = None
    searchers: set[_Worker] = field(default_factory=set)
    publisher: _Worker | None = None
    done: bool = False
    closed: bool = False  # a searcher ended its search (budget, exhausted, ...): none joins
    study: str | None = None
    measured: int = 0
    best_ms: float | None = None


@dataclass(eq=False)
class _Worker:
    device: int
    process: subprocess.Popen
    name: str = ""  # the ``worker`` attr of its trials, from its first event
    identity: str | None = None  # their ``process`` attr (autotune.claims.process_identity)
    task: _Problem | None = None
    phase: str = "starting"
    stderr: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_LINES))
    row: Any = None  # its task in the progress display
    measured: int = 0  # configs it measured, over every problem it searched
    corrupt: str | None = None  # why its device's state is corrupt, as it said before exiting
    recycles: int = 0  # fresh processes its device had before this one

    def send(self, **command: Any) -> None:
        try:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):  # it died; its end of stream is on the way
            pass


class WorkersFailed(RuntimeError):
    """Every worker died, or one said the kernel cannot tune this device: exit ``status``."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class WorkersInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the workers; the message says how to resume."""


def _tasks(problem: Problem, kernel: str | None, kernels: list[str]) -> list[_Problem]:
    """The pool's tasks of ``problem``: the study of ``kernel``; or, for a kernel choice, one
    study per candidate of ``kernels`` and the choice's confirmation."""
    if kernel is not None:
        return [_Problem(problem, kernel)]
    choice = _Choice(list(kernels))
    return [*(_Problem(problem, name, choice) for name in kernels),
            _Problem(problem, None, choice)]


def _read(stream: IO[str], sink: Callable[[str], None], end: Callable[[], None]) -> None:
    for line in stream:
        sink(line.rstrip("\n"))
    end()


class WorkerPool:
    """The workers of one ``autotune tune --devices`` run and the problems they share."""

    def __init__(self, problems: list[Problem], devices: tuple[int, ...], platform: str, *,
                 db_url: str, kernel: str | None, options: dict[str, Any], json_output: bool,
                 on_summary: Callable[[dict[str, Any]], None],
                 kernels: list[str] | None = None) -> None:
        """``kernel``: the one kernel to tune; None: choose among ``kernels`` per problem."""
        self.problems = [task for p in problems for task in _tasks(p, kernel, kernels or [])]
        self.budget = options["trials"]
        self.db_url, self.json_output, self.on_summary = db_url, json_output, on_summary
        self.platform, self.kernel, self.options = platform, kernel, options
        self.events: queue.Queue[tuple[_Worker, dict[str, Any] | None]] = queue.Queue()
        self.failed = 0
        self.progress = None if json_output else Progress(
            TextColumn("[bold]device {task.fields[device]}"), TextColumn("{task.description}"),
            BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"), console=output_console())
        self.host_workers = len(devices)
        self.workers = [self._start(d) for d in devices]

    def _start(self, device: int, previous: _Worker | None = None) -> _Worker:
        """A worker process on ``device``; in place of ``previous`` (whose device went
        corrupt), it takes over its row, count and recycles."""
        spec = {"db_url": self.db_url, "kernel": self.kernel,
                "options": {**self.options, "device_index": device}}
        process = subprocess.Popen(
            [sys.executable, "-m", "autotune.worker", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **worker_env(self.platform, device),
                 HOST_WORKERS: str(self.host_workers)},
            start_new_session=True)  # Ctrl-C reaches the parent, which stops each worker once
        worker = _Worker(device, process)
        threading.Thread(target=_read, daemon=True, args=(
            process.stdout, lambda line: self.events.put((worker, json.loads(line))),
            lambda: self.events.put((worker, None)))).start()
        threading.Thread(target=_read, daemon=True, args=(
            process.stderr, worker.stderr.append, lambda: None)).start()
        if previous is not None:
            worker.row, worker.measured = previous.row, previous.measured
            worker.recycles = previous.recycles + 1
        elif self.progress is not None:
            worker.row = self.progress.add_task("", total=self.budget, device=device,
                                                status="starting")
        return worker

    # --- scheduling -------------------------------------------------------------------------

    def _assign(self, worker: _Worker) -> None:
        """Gives a free worker a kernel choice to confirm, else a problem nobody works on,
        else a study to join."""
        open_ = [p for p in self.problems if not p.done and p.publisher is None]
        ready = [p for p in open_ if p.kernel is None and p.choice.ready]
        if ready:
            task, choice = ready[0], ready[0].choice
            task.publisher, worker.task, worker.phase = worker, task, "choosing"
            worker.send(choose=task.problem.to_dict(), kernels=choice.kernels,
                        tuned=choice.tuned, lost=choice.lost)
            self._show(worker)
            return
        free = [p for p in open_ if not p.searchers and p.kernel is not None]
        # A study whose search ended for one searcher ended for all: one that stopped early
        # (its space exhausted, patience, timeout) never reaches the budget, and rejoining it
        # went on forever; ``free`` still lets a worker take over a dead one's problem.
        joinable = [p for p in open_ if not p.closed and p.kernel is not None
                    and p.measured + len(p.searchers) < self.budget]
        if free or joinable:
            target = free[0] if free else min(joinable, key=lambda p: (len(p.searchers),
                                                                       p.measured))
            target.searchers.add(worker)
            worker.task, worker.phase = target, "searching"
            worker.send(search=target.problem.to_dict(), kernel=target.kernel)
        else:
            worker.task, worker.phase = None, "idle"
        self._show(worker)

    def _show_done(self) -> None:
        """Every row ends ``done``, counting the configs its device measured (not ``idle``)."""
        if self.progress is None:
            return
        for worker in self.workers:
            self.progress.update(worker.row, description="", total=max(worker.measured, 1),
                                 completed=worker.measured,
                                 status=f"done: {worker.measured} measured")

    def _alive(self) -> list[_Worker]:
        return [w for w in self.workers if w.process.returncode is None]

    def _show(self, worker: _Worker) -> None:
        if self.progress is None:
            return
        task = worker.task
        status = worker.phase
        if task is not None and task.best_ms is not None:
            status += f", best {task.best_ms:.3f} ms"
        label = task and (task.problem.label() + (f" {task.kernel}" if task.kernel else ""))
        self.progress.update(worker.row, description=label or "",
                             completed=task.measured if task else 0, status=status)

    # --- events -----------------------------------------------------------------------------

    def _handle(self, worker: _Worker, event: dict[str, Any]) -> None:
        kind, task = event["event"], worker.task
        if kind == "study":
            worker.name, worker.identity = event["worker"], event.get("process")
            task.study = event["study"]
            task.measured = max(task.measured, event["measured"])
        elif kind == "trial":
            task.measured += 1
            worker.measured += 1
            best = event["best_ms"]
            if best is not None and (task.best_ms is None or best < task.best_ms):
                task.best_ms = best
            if self.json_output:
                print(json.dumps({**event["record"], "device": worker.device}), flush=True)
        elif kind == "phase":
            worker.phase = event["phase"]
        elif kind == "error" and event.get("kind") == "corrupt":  # it exits; _died recycles it
            worker.corrupt = event["message"]
        elif kind == "notice":  # e.g. the timing method fell back: once per worker and problem
            self._say(f"note (device {worker.device}): {event['message']}")
        elif kind == "searched":
            task.searchers.discard(worker)
            task.closed = True
            if task.searchers:  # the last searcher of the study publishes it
                worker.send(drop=True)
                self._assign(worker)
                return
            task.publisher, worker.phase = worker, "confirming"
            worker.send(publish=True)
        elif kind in ("summary", "error") and event.get("kind") != "config":
            task.done, task.publisher = True, None
            task.searchers.discard(worker)  # a candidate lost before its search
            if task.choice is not None and task.kernel is not None:  # a candidate's outcome
                if kind == "summary":
                    task.choice.tuned[task.kernel] = event["summary"]
                else:
                    task.choice.lost[task.kernel] = event["failure"]
            elif kind == "summary":
                self.on_summary(event["summary"])
            else:
                self.failed += 1
                self._say(f"error: {event['message']}")
            for idle in [w for w in self._alive() if w.task is None and w is not worker]:
                self._assign(idle)  # a choice may have become ready to confirm
            self._assign(worker)
            return
        elif kind == "error":
            raise WorkersFailed(f"error: {event['message']}", 2)
        self._show(worker)

    def _died(self, worker: _Worker) -> None:
        """A worker's event stream ended: its claims go back, its problem to another; a
        worker whose device went corrupt gets a fresh process in its place."""
        status = worker.process.wait()
        task, worker.task = worker.task, None
        worker.phase = "stopped"
        self._show(worker)
        if task is not None and not task.done:
            if worker.corrupt is None:  # a corrupt one gave its claims back itself
                how = f"signal {-status}" if status < 0 else f"exit status {status}"
                tail = "\n".join(f"  {line}" for line in list(worker.stderr)[-5:])
                released = self._release(worker, task)
                self._say(f"worker of device {worker.device} died ({how}) while tuning "
                          f"{task.problem.label()}; {released} claimed config(s) released, the "
                          f"problem goes to another worker"
                          + (f"; its last output:\n{tail}" if tail else ""))
            task.searchers.discard(worker)
            if task.publisher is worker:
                task.publisher = None
        if worker.corrupt is not None:
            self._recycle(worker)
        for idle in self._alive():
            if idle.task is None:
                self._assign(idle)

    def _recycle(self, worker: _Worker) -> None:
        """Puts a fresh process on the device of ``worker``, whose state went corrupt (its
        search recorded the config that did it and gave its claims back); the device is given
        up after MAX_RECYCLES."""
        if worker.recycles >= MAX_RECYCLES:
            self._say(f"device {worker.device}: {worker.corrupt}; it went corrupt "
                      f"{MAX_RECYCLES + 1} times, so no fresh worker is started on it")
            return
        self._say(f"device {worker.device}: {worker.corrupt}; a fresh worker process takes "
                  f"over the device ({worker.recycles + 1} of at most {MAX_RECYCLES})")
        self.workers[self.workers.index(worker)] = self._start(worker.device, worker)

    def _release(self, worker: _Worker, task: _Problem) -> int:
        from autotune.claims import release_claims
        from storage.studies import get_storage

        if not (task.study and worker.name):
            return 0
        return release_claims(get_storage(self.db_url), task.study, worker.name,
                              worker.identity)

    def _say(self, message: str) -> None:
        console = (self.progress.console if self.progress is not None
                   else output_console(stderr=True))
        console.print(message, markup=False, highlight=False, style=None)

    # --- the run ----------------------------------------------------------------------------

    def run(self) -> int:
        """Tunes every problem; the number that had nothing to publish. Raises WorkersFailed
        or WorkersInterrupted."""
        if self.progress is not None:
            self.progress.start()
        try:
            for worker in self.workers:
                self._assign(worker)
            while not all(p.done for p in self.problems):
                if not self._alive() and self.events.empty():
                    left = [p.problem.label() for p in self.problems if not p.done]
                    raise WorkersFailed(f"error: every worker died; not tuned: "
                                        f"{', '.join(left)}; run the same command to resume", 1)
                try:
                    worker, event = self.events.get(timeout=0.5)
                except queue.Empty:
                    continue
                if event is None:
                    self._died(worker)
                else:
                    self._handle(worker, event)
            self._show_done()
        except KeyboardInterrupt:
            self._stop(signal.SIGINT)
            left = sum(not p.done for p in self.problems)
            raise WorkersInterrupted(
                f"{left} problem(s) not finished; every measured config is kept: run the same "
                f"command again to resume") from None
        except WorkersFailed:
            self._stop(signal.SIGINT)
            raise
        finally:
            if self.progress is not None:
                self.progress.stop()
        self._stop(None)
        return self.failed

    def _stop(self, sig: signal.Signals | None) -> None:
        """Ends every worker: end of input (``sig`` None), else ``sig`` and, if one does not
        end within STOP_WAIT_S, SIGKILL; the claims of a killed one are released."""
        for worker in self._alive():
            if sig is not None:
                worker.process.send_signal(sig)
            worker.process.stdin.close()
        for worker in self.workers:
            try:
                worker.process.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
                if worker.task is not None:
                    self._release(worker, worker.task)
