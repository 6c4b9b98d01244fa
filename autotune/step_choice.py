"""Confirming a model's kernel choices over its whole training step (issue 63).

``tune_model`` chooses each attention problem's kernel from isolated timings (the attention's
forward and backward alone). Around the kernels the compiler schedules the rest of the step,
and that schedule can differ with the kernel: on a TPU v5e (llama, 4 layers, d_model 2048,
4096 tokens) the isolated choice's step was 0.59 ms slower than the step with the other
kernel everywhere (docs/model-step-ops.md). :func:`confirm_step_choice` compiles the model's
step under the tuned table and under each candidate kernel's own table (that kernel at its
own tuned config for every problem), times the distinct programs' whole steps in interleaved
rounds with the tuner's own timing, and keeps the tuned table unless another beats it beyond
the noise (:func:`autotune.tune.choose_winner`: faster by more than the larger IQR of the
rounds and 1%). :func:`publish_step_choice` stores the outcome on every choice of the table
(``step_confirmation`` in its provenance; ``method`` ``model_step`` where it changed them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

import kernel
from autotune.measure import Timing, interleaved, profiled_runs, wall_times
from autotune.timing import PROFILE, TimingError, timing_plan
from autotune.tune import choose_winner
from kernel import LookupTable, Problem, get_kernel
from kernel.table import KernelChoice, KernelTiming
from present.text import first_line
from storage import Store

TUNED = "tuned"  # the variant of the table chosen from isolated timings
STEP_METHOD = "model_step"  # a choice's method where the step's confirmation changed it
NOISE = "IQR of the rounds' medians (range under 4 rounds), at least 1% of the median"


@dataclasses.dataclass(frozen=True)
class StepChoice:
    """The outcome of :func:`confirm_step_choice`: the table to use, the variant it is
    (``TUNED`` or a kernel name: that kernel's own tuned table), each timed variant's step
    times (one sample per round; variants lowering to one program share it), the timing
    method, the rounds, and why each variant left out has no time."""

    table: LookupTable
    chosen: str
    times: Mapping[str, Timing]
    timing: str
    rounds: int
    step: str  # step_digest of the step under ``table``
    failures: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return self.chosen != TUNED

    def record(self) -> dict[str, Any]:
        """What a stored choice keeps of it (``step_confirmation`` in its provenance)."""
        return {"chosen": self.chosen, "timing": self.timing, "rounds": self.rounds,
                "noise": NOISE, "step": self.step,
                "variants": {name: {"median_ms": t.median_ms, "iqr_ms": t.iqr_ms}
                             for name, t in self.times.items()},
                "left_out": dict(self.failures)}

    def line(self) -> str:
        """One line saying which table the step chose, with its step time and the tuned
        table's."""
        tuned = self.times[TUNED]
        if not self.changed:
            return (f"step confirmation: the tuned table kept ({tuned.median_ms:.4g} ms per "
                    f"step, {self.timing}, {self.rounds} rounds)")
        won = self.times[self.chosen]
        return (f"step confirmation: {self.chosen} at its own tuned configs replaces the tuned "
                f"table ({won.median_ms:.4g} against {tuned.median_ms:.4g} ms per step, "
                f"{self.timing}, {self.rounds} rounds)")


def step_digest(fn: Callable[..., Any], args: Sequence[Any], table: LookupTable) -> str:
    """Which step a confirmation timed: a short digest of the attention problems of
    ``table`` (one per choice) and of the program ``fn(*args)`` (arrays or
    ``jax.ShapeDtypeStruct``) traces to under it, its jaxpr (the model's ops and the kernels
    at their configs), kept in the record. Two steps with the same attention problems differ
    in it (the problems alone once took one step's confirmation for the other's)."""
    labels = sorted(choice.problem.label() for choice in table.choices)
    with kernel.tables(table):
        program = str(jax.make_jaxpr(fn)(*args))
    return hashlib.sha256("\n".join([*labels, program]).encode()).hexdigest()[:16]


def confirmed_before(fn: Callable[..., Any], args: Sequence[Any], table: LookupTable) -> bool:
    """Whether every choice of ``table`` (as stored) carries the record of a confirmation of
    this step (``fn(*args)`` under ``table``, :func:`step_digest`): an earlier
    ``tune_model(..., confirm_step=True)`` of it, nothing tuned again since (a re-tune drops
    a choice's record)."""
    digest = step_digest(fn, args, table)
    return all((choice.provenance.get("step_confirmation") or {}).get("step") == digest
               for choice in table.choices)


def pinned_table(problems: Sequence[Problem], kernel_name: str,
                 config_for: Callable[[Any, Problem], Any]) -> LookupTable:
    """A table choosing ``kernel_name`` at ``config_for(kernel, problem)`` for each problem:
    a hand-set choice, as a user pins one (no timing stands behind it)."""
    chosen = get_kernel(kernel_name).discover()
    choices = tuple(KernelChoice(p, kernel_name, config_for(chosen, p),
                                 {kernel_name: KernelTiming()}) for p in problems)
    return LookupTable(kernel_name, chosen.version, jax.devices()[0].device_kind, (),
                       choices=choices)


def own_tuned_tables(tuned: LookupTable,
                     problems: Sequence[Problem]) -> dict[str, LookupTable | str]:
    """Per candidate kernel of ``tuned``'s choices with a tuned config for any of
    ``problems``: a table choosing it at its own tuned config for every problem, or the line
    saying which problems it has none for (its tune failed there)."""
    tables: dict[str, LookupTable | str] = {}
    for name in dict.fromkeys(name for choice in tuned.choices for name in choice.candidates):
        configs = {entry.problem: entry.config for table in tuned.kernel_tables()
                   if table.kernel == name for entry in table.entries}
        if not configs:
            continue
        missing = [p.label() for p in problems if p not in configs]
        tables[name] = (
            f"{name} has no tuned config for {', '.join(missing)} (its tune failed there)"
            if missing else
            pinned_table(problems, name, lambda _, p, configs=configs: configs[p]))
    return tables


def confirm_step_choice(fn: Callable[..., Any], args: Sequence[Any], tuned: LookupTable,
                        candidates: Sequence[str], rounds: int = 5, timing: str = "auto",
                        runs_per_round: int = 3) -> StepChoice:
    """Times ``fn(*args)`` (concrete arguments) compiled under ``tuned`` and under each of
    ``candidates``' own tuned tables (:func:`own_tuned_tables`; a kernel that failed a
    problem's isolated confirmation is left out), ``rounds`` interleaved rounds of
    ``runs_per_round`` steps each, with ``timing`` (``auto``: the whole step's device time,
    ``step_profile``, on a TPU or GPU; ``wallclock`` on a CPU; a step has no ``loop``), and
    returns the tuned table unless another variant is faster beyond the noise (``NOISE``)."""
    tables, failures = _variants(tuned, candidates)
    executables = _compiled(fn, args, tables, failures)
    method = _step_timing(timing, executables[TUNED], args)
    programs = {id(executable): executable for executable in executables.values()}
    timers = {key: _step_timer(executable, args, method, runs_per_round)
              for key, executable in programs.items()}
    per_program = interleaved(timers, rounds)
    times = {name: per_program[id(executable)] for name, executable in executables.items()}
    chosen = choose_winner(times, TUNED)
    return StepChoice(tables[chosen], chosen, times, method, rounds,
                      step_digest(fn, args, tables[chosen]), failures)


def _variants(tuned: LookupTable,
              candidates: Sequence[str]) -> tuple[dict[str, LookupTable], dict[str, str]]:
    """The tables to time (``TUNED`` first, then each candidate's own) and why each
    candidate left out is."""
    problems = [choice.problem for choice in tuned.choices]
    tables, failures = {TUNED: tuned}, {}
    for name, table in own_tuned_tables(tuned, problems).items():
        if name not in candidates:
            continue
        failed = [c.problem.label() for c in tuned.choices
                  if c.candidates.get(name, KernelTiming()).median_ms is None]
        if isinstance(table, str):
            failures[name] = table
        elif failed:
            failures[name] = f"{name} failed its confirmation on {', '.join(failed)}"
        else:
            tables[name] = table
    return tables, failures


def _compiled(fn: Callable[..., Any], args: Sequence[Any], tables: Mapping[str, LookupTable],
              failures: dict[str, str]) -> dict[str, Any]:
    """Each variant's compiled step, run once (a warm-up); variants lowering to one program
    share its executable. A candidate's failure is its line in ``failures``; the tuned
    table's raises."""
    executables: dict[str, Any] = {}
    programs: dict[str, Any] = {}
    for name, table in tables.items():
        try:
            with kernel.tables(table):
                lowered = jax.jit(fn).lower(*args)
            text = lowered.as_text()
            if text not in programs:
                executable = lowered.compile()
                jax.block_until_ready(executable(*args))
                programs[text] = executable
        except Exception as error:  # a candidate's failure leaves it out; the tuned one raises
            if name == TUNED:
                raise
            failures[name] = f"{name}: {type(error).__name__} ({first_line(str(error))})"
            continue
        executables[name] = programs[text]
    return executables


def _step_timing(requested: str, executable: Any, args: Sequence[Any]) -> str:
    """The method the steps are timed with: ``step_profile`` where ``requested`` plans it
    and a trace of the tuned step holds its ops, else ``wallclock``."""
    method, _ = timing_plan(requested, jax.devices()[0].platform)
    if method == PROFILE and profiled_runs(executable, args, 1) is not None:
        return PROFILE
    return "wallclock"


def _step_timer(executable: Any, args: Sequence[Any], method: str,
                runs: int) -> Callable[[], Timing]:
    """One round: ``runs`` steps, each timed with ``method``."""
    def profiled() -> Timing:
        timing = profiled_runs(executable, args, runs)
        if timing is None:
            raise TimingError("the profiler trace holds no op of the step; time it with "
                              "timing='wallclock'")
        return timing

    def wall() -> Timing:
        step = wall_times(lambda: jax.block_until_ready(executable(*args)))
        return Timing(tuple(itertools.islice(step, runs)))

    return profiled if method == PROFILE else wall


def publish_step_choice(store: Store, device_kind: str, tuned: LookupTable,
                        step: StepChoice) -> None:
    """Stores the step's outcome on every choice of ``tuned``: the chosen table's kernel and
    config (method ``model_step`` where it changed them; the isolated candidates' times
    stay), with ``step_confirmation`` (:meth:`StepChoice.record`) in its provenance, so that
    the lookup service and ``autotune export`` answer the table the step chose."""
    record = step.record()
    for choice in tuned.choices:
        won = next(c for c in step.table.choices if c.problem == choice.problem)
        provenance = {**choice.provenance, "step_confirmation": record}
        if step.changed:
            provenance |= {"method": STEP_METHOD, "within_noise": False,
                           "kernel_version": get_kernel(won.kernel).version}
        store.publish_choice(device_kind, dataclasses.replace(
            choice, kernel=won.kernel, config=won.config, provenance=provenance))
