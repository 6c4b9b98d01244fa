"""One tuning worker of ``autotune tune --devices``: a process that sees one device.

Started by :mod:`autotune.workers` as ``python -m autotune.worker SPEC`` (SPEC: JSON with
``db_url``, ``kernel`` and the ``TuneOptions`` fields). It reads commands from stdin, one JSON
object a line, and writes events to stdout, one JSON object a line (anything else printed goes
to stderr):

- ``{"search": PROBLEM, "kernel": NAME}``: opens the problem's job (of ``kernel``, default
  the spec's) and searches until the study-wide budget is claimed; events ``study`` (its name,
  study-wide measured so far, this worker's name), one ``trial`` per measured config, then
  ``searched``;
- ``{"publish": true}``: confirms and publishes the problem searched last (after a resume pass
  that measures what released claims left missing); event ``summary``;
- ``{"drop": true}``: closes that job (another worker publishes it);
- ``{"choose": PROBLEM, "kernels": [...], "tuned": {NAME: SUMMARY}, "lost": {NAME: [CLASS,
  DETAIL]}}``: confirms the candidates' winners against each other on this device and
  publishes the kernel choice (:func:`autotune.choice.publish_choice`); event ``summary``.

Errors are events too: ``error`` with ``kind`` ``config`` (the kernel cannot tune this device or
problem: the worker exits 2; for a kernel choice, whose ``kernel`` is null in SPEC, ``lost``
instead: that candidate is out of the choice) or ``nothing`` (no config worked; the worker
carries on); both carry ``failure``, ``[class, detail]`` for the choice; or ``corrupt`` (the
device's state went corrupt, :class:`autotune.failures.ChipStateCorrupted`: the worker exits 3
and the pool starts a fresh one on its device). Ctrl-C (SIGINT) gives ``interrupted`` and exit
130. End of stdin ends the worker.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any, TextIO

from autotune.progress import trial_record
from autotune.choice import publish_choice, tuning_failure
from autotune.claims import process_identity, worker_name
from autotune.failures import ChipStateCorrupted, ProblemTooLarge
from autotune.search import SearchResult, StudyMismatchError
from autotune.timing import TimingError
from autotune.trials import TrialResult
from autotune.tune import NothingToPublish, TuneJob, TuneOptions
from kernel import ConfigError, Problem
from storage import Store

CORRUPT_EXIT = 3  # the device's state is corrupt: only a fresh process runs right on it


class _Events:
    """The worker's event stream (the real stdout) and a :class:`TuneObserver` of one job."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.problem: Problem | None = None

    def emit(self, event: str, **fields: Any) -> None:
        self.stream.write(json.dumps({"event": event, **fields}) + "\n")
        self.stream.flush()

    def on_trial(self, result: TrialResult, best: TrialResult | None,
                 default_ms: float | None) -> None:
        self.emit("trial", record=trial_record(self.problem, result),
                  best_ms=best.value if best is not None else None)

    def on_start(self, measured: int) -> None:  # the parent counts from the "study" event
        pass

    def on_phase(self, phase: str) -> None:
        self.emit("phase", phase=phase)

    def on_notice(self, message: str) -> None:
        self.emit("notice", message=message)


def serve(spec: dict[str, Any], commands: TextIO, events: _Events) -> int:
    """Runs commands until stdin ends; the process exit status."""
    options = TuneOptions(**spec["options"])
    job: TuneJob | None = None
    searched: SearchResult | None = None
    choosing = spec["kernel"] is None  # a kernel choice: a candidate that cannot tune is lost
    with Store(spec["db_url"]) as store:
        try:
            while line := commands.readline():
                command = json.loads(line)
                if job is not None and ("search" in command or "drop" in command):
                    job.close()
                    job = None
                if "search" in command:
                    events.problem = Problem.from_dict(command["search"])
                    try:
                        job = TuneJob(events.problem, store, spec["db_url"], options, events,
                                      command.get("kernel") or spec["kernel"])
                    except ConfigError as error:  # too large: the other problems go on
                        if not choosing and not isinstance(error, ProblemTooLarge):
                            raise
                        events.emit("error", kind="lost" if choosing else "nothing",
                                    message=str(error), failure=tuning_failure(error))
                        continue
                    events.emit("study", study=job.name, measured=job.measured(),
                                worker=worker_name(), process=process_identity())
                    searched = job.search()
                    events.emit("searched", stop_reason=searched.stop_reason)
                elif "publish" in command and job is not None and searched is not None:
                    if searched.stop_reason == "budget":
                        searched = job.search()  # claims released by a dead worker
                    try:
                        events.emit("summary", summary=job.publish(searched).to_dict())
                    except NothingToPublish as error:
                        events.emit("error", kind="nothing", message=str(error),
                                    failure=tuning_failure(error))
                    job.close()
                    job = None
                elif "choose" in command:
                    _choose(command, store, options, events)
        except (ConfigError, TimingError, StudyMismatchError) as error:  # as tune on one device
            events.emit("error", kind="config", message=str(error))
            return 2
        except ChipStateCorrupted as error:  # nothing more runs right in this process
            events.emit("error", kind="corrupt", message=error.what)
            return CORRUPT_EXIT
        except KeyboardInterrupt:
            events.emit("interrupted")
            return 130
        finally:
            if job is not None:
                job.close()
    return 0


def _choose(command: dict[str, Any], store: Store, options: TuneOptions,
            events: _Events) -> None:
    """Confirms the candidates' tuned winners against each other on this device and
    publishes the kernel choice: event ``summary`` (the choice's), or ``error``."""
    events.emit("phase", phase="choosing")
    try:
        summary = publish_choice(Problem.from_dict(command["choose"]), store,
                                 command["kernels"], command["tuned"],
                                 {name: tuple(lost) for name, lost in command["lost"].items()},
                                 options)
    except NothingToPublish as error:
        events.emit("error", kind="nothing", message=str(error))
        return
    events.emit("summary", summary=summary.to_dict())


def main() -> None:
    # The parent stops a worker with SIGINT, even where its own shell ignores it (a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    events = _Events(os.fdopen(os.dup(sys.stdout.fileno()), "w"))
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray output must not mix with events
    sys.exit(serve(json.loads(sys.argv[1]), sys.stdin, events))


if __name__ == "__main__":
    main()
