"""Progress of a tuning run: a Rich bar with the current best, or JSON lines per trial."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autotune.trials import ONE_CONFIG_PHASE, TrialResult
from kernel import ConfigError, Problem
from present.text import first_line

# The width a console writes to a file or a pipe: wide enough that no line is cut or wrapped
# (Rich's default there is 80 columns).
UNTERMINATED_WIDTH = 100_000


def output_console(stderr: bool = False) -> Console:
    """A Rich console on stdout (or stderr) that prints lines whole when that is no terminal
    (redirected to a file or a pipe), where Rich would cut or wrap them at 80 columns."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(
        stderr=stderr, width=UNTERMINATED_WIDTH, soft_wrap=True)


def trial_record(problem: Problem, result: TrialResult) -> dict[str, Any]:
    """The JSON line ``autotune tune --json`` prints per measured config."""
    return {"problem": problem.to_dict(), "trial": result.number, "config": result.config,
            "status": result.measurement.status, "time_ms": result.value,
            **dict(result.measurement.attrs)}


class TuneProgress:
    """A :class:`autotune.tune.TuneObserver` for the CLI."""

    def __init__(self, problem: Problem, budget: int, *, json_output: bool = False,
                 kernel: str | None = None) -> None:
        self.problem = problem
        self.kernel = kernel  # named in the bar and the JSON lines when several are tuned
        self.json_output = json_output
        self.budget = budget
        self.failures: Counter[str] = Counter()
        self.measured = 0
        self._pace = _Pace()
        self._progress = None if json_output else Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("{task.fields[status]}"),
            console=output_console())
        self._task = None if self._progress is None else self._progress.add_task(
            f"{kernel} {problem.label()}" if kernel else problem.label(), total=budget,
            status="starting")

    def __enter__(self) -> TuneProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 *_: object) -> None:
        if self._progress is not None:
            if error is not None:  # the last frame says how it ended, not its last phase
                self._progress.update(self._task, status=_ending(error))
            self._progress.stop()

    def on_start(self, measured: int) -> None:
        self.measured = measured  # the bar counts the study-wide budget, as --trials does
        if self._progress is not None:
            self._progress.update(self._task, completed=measured)

    def on_trial(self, result: TrialResult, best: TrialResult | None,
                 default_ms: float | None) -> None:
        self.measured += 1
        self._pace.tick()
        if not result.measurement.ok:
            self.failures[result.measurement.status] += 1
        if self.json_output:
            kernel = {"kernel": self.kernel} if self.kernel else {}
            print(json.dumps({**trial_record(self.problem, result), **kernel}), flush=True)
            return
        self._progress.update(self._task, completed=self.measured,
                              status=self._status(best, default_ms))

    def on_phase(self, phase: str) -> None:
        if self._progress is None:
            return
        if phase == ONE_CONFIG_PHASE:  # its bar counts that one config, not --trials
            self._progress.update(self._task, total=1, completed=1)
        self._progress.update(self._task, status=phase)

    def on_notice(self, message: str) -> None:
        """Something the user should know once (e.g. the timing method fell back)."""
        if self.json_output:
            print(json.dumps({"problem": self.problem.to_dict(), "notice": message}), flush=True)
        else:
            self._progress.console.print(f"[yellow]note:[/] {escape(message)}")

    def _status(self, best: TrialResult | None, default_ms: float | None) -> str:
        parts: list[str] = []
        if best is not None:
            parts.append(f"best {best.value:.3f} ms")
            if default_ms:
                parts.append(f"{default_ms / best.value:.2f}x vs default")
        if self.failures:
            parts.append("failures " + " ".join(f"{k}={v}" for k, v in
                                                sorted(self.failures.items())))
        parts.append(self._pace.describe(self.budget - self.measured))
        return ", ".join(part for part in parts if part)


def _ending(error: BaseException) -> str:
    """How a tuning that raised ``error`` ended, for its progress line: refused as illegal (a
    kernel that cannot run the problem here), interrupted, or failed, with the first line of
    the reason."""
    if isinstance(error, ConfigError):
        return f"refused (illegal): {escape(first_line(str(error)))}"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    return f"failed: {escape(first_line(str(error)))}"


class _Pace:
    """Trials per minute of this run (a resume's earlier trials not counted) and the time
    the rest of the budget takes at that pace."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.trials = 0

    def tick(self) -> None:
        self.trials += 1

    def describe(self, left: int) -> str:
        minutes = (time.monotonic() - self.start) / 60
        if not self.trials or minutes <= 0:
            return ""
        per_minute = self.trials / minutes
        return f"{per_minute:.1f} trials/min, ~{left / per_minute:.1f} min left"
