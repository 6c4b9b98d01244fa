"""Deviceless precheck: compile every candidate config for a TPU generation on this CPU.

Compiles run in worker processes (each with its own JAX/libtpu), so a compile that hangs is
killed at its timeout without taking the sweep down; the worker is replaced and the sweep goes on.

For ``fwd_bwd`` problems of a kernel whose gradient program is made of independently compiled
kernels (``TunableKernel.compile_parts``: ours has forward, dK/dV and dQ), the full space (the
product of their tiles) is covered by compiling each part's own tiles with the others at the
default: |fwd| + |dkv| + |dq| compiles instead of |fwd| x |dkv| x |dq| (a part's combinations
that break a rule other than VMEM's are not compiled, as in the forward). A full config compiles
exactly when each of its parts does. The forward variants compile only the forward pass (as
training runs it, saving the residuals): the default backward kernels they share are compiled
with every backward variant already. Any other kernel compiles its whole space. The predicted
fit of a config is that it breaks no rule of the kernel (its VMEM estimate included).
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing as mp
import re
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for
from dataclasses import dataclass, field
from typing import Any

from autotune.failures import Status, classify_compile_error
from autotune.timing import native_noise_dropped
from kernel import Problem, Target, TunableKernel, get_kernel
from present.text import first_line

START_TIMEOUT_S = 180.0  # a compiler process that is not ready by then will not be
# What libtpu prints to stderr as it starts for a deviceless compile on a machine without a
# TPU, with nothing for a user to do about it (seen with libtpu 0.0.42.1): warnings that it
# cannot determine the TPU's accelerator type and worker hostnames, an ``E0000 ...
# INVALID_ARGUMENT: Error: unexpected worker hostname`` line and its source location trace.
LIBTPU_START_NOISE = re.compile(r"Failed to find host bounds for accelerator type|"
                                r"Logging before InitGoogle\(\) is written to STDERR|"
                                r"INVALID_ARGUMENT: Error: unexpected worker hostname|"
                                r"^=== Source Location Trace: ===|libtpu_init_utils\.cc:\d+")


@dataclass(frozen=True)
class Candidate:
    """A config to compile, and whether the VMEM estimate predicts it fits."""

    config: Any  # a config of the prechecked kernel
    predicted_fit: bool
    forward_only: bool = False  # compile just the forward kernel of a fwd_bwd problem


@dataclass
class PrecheckResult:
    config: Any
    status: Status
    compile_s: float
    predicted_fit: bool
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "status": str(self.status),
                "compile_s": round(self.compile_s, 3), "predicted_fit": self.predicted_fit,
                "error": self.error}


@dataclass
class Agreement:
    """How the VMEM estimate's verdicts compare with the compiler's."""

    admitted: int = 0  # the estimate says it fits
    admitted_ok: int = 0  # ... and it compiles
    compiled_ok: int = 0  # the compiler accepts it
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, results: list[PrecheckResult]) -> Agreement:
        agreement = cls()
        for result in results:
            agreement.counts[result.status] = agreement.counts.get(result.status, 0) + 1
            ok = result.status == Status.OK
            agreement.admitted += result.predicted_fit
            agreement.admitted_ok += result.predicted_fit and ok
            agreement.compiled_ok += ok
        return agreement

    @property
    def precision(self) -> float | None:
        """Share of admitted configs that compile (target: 1.0)."""
        return self.admitted_ok / self.admitted if self.admitted else None

    @property
    def recall(self) -> float | None:
        """Share of compiling configs that the estimate admits (target: >= 0.9)."""
        return self.admitted_ok / self.compiled_ok if self.compiled_ok else None

    def to_dict(self) -> dict[str, Any]:
        return {"summary": True, "counts": self.counts, "admitted": self.admitted,
                "admitted_and_compiled": self.admitted_ok, "compiled": self.compiled_ok,
                "precision": self.precision, "recall": self.recall}


def vmem_limited(target: Target, vmem_limit_bytes: int | None) -> Target:
    """``target`` with another scoped VMEM limit (the rules and the compiler then both use
    it), or itself."""
    if vmem_limit_bytes is None:
        return target
    return dataclasses.replace(target, scoped_vmem_bytes=vmem_limit_bytes)


def candidates(problem: Problem, target: Target, kernel: TunableKernel, *,
               include_rejected: bool = False) -> list[Candidate]:
    """The configs precheck compiles (see the module docstring for ``fwd_bwd``); ``kernel``
    as discovered for the installed JAX."""
    if problem.mode == "fwd" or not kernel.compile_parts:  # one program: the whole space
        configs = {c: False for c in kernel.search_space(problem, target,
                                                          ignore=frozenset({"vmem"}))}
    else:
        base = kernel.default_config(problem, target)
        _, *backward = kernel.compile_parts
        at_default = {f: getattr(base, f) for part in backward for f in part}
        fwd_problem = dataclasses.replace(problem, mode="fwd")
        # config -> forward_only, in order; a backward variant (and the default) compiles whole.
        configs = {c.replace(**at_default): True
                   for c in kernel.search_space(fwd_problem, target, ignore=frozenset({"vmem"}))}
        params = kernel.space_params(problem)
        for part in backward:
            for values in itertools.product(*(params[f] for f in part)):  # incl. the default
                # canonical: a flag in one part may leave another part's fields unused (the
                # fused backward's dQ fields), which then take their unused value
                config = base.replace(**kernel.canonical_params(
                    {**base.to_dict(), **dict(zip(part, values))}))
                if all(v.rule == "vmem" for v in kernel.violations(problem, config, target)):
                    configs[config] = False
    out = [Candidate(c, not kernel.violations(problem, c, target), forward_only)
           for c, forward_only in configs.items()]
    return out if include_rejected else [c for c in out if c.predicted_fit]


def _worker(target_name: str, kernel_name: str, conn: Connection) -> None:
    """Worker process: compiles the configs of one kernel it is sent, one at a time."""
    from kernel.aot import compile_for_target, topology_device

    kernel = get_kernel(kernel_name).discover()
    with native_noise_dropped(LIBTPU_START_NOISE):
        topology_device(target_name)  # pay libtpu start-up once, before the first deadline
    conn.send(("ready", None))
    while (task := conn.recv()) is not None:
        index, problem_dict, config_dict, options, forward_only = task
        problem, config = Problem.from_dict(problem_dict), kernel.config_from_dict(config_dict)
        start = time.perf_counter()
        try:
            seconds = compile_for_target(kernel, problem, config, target_name, options,
                                         forward_only=forward_only)
            conn.send(("done", (index, Status.OK, seconds, None)))
        except Exception as error:  # any compiler failure is a result, not a crash
            message = str(error)
            conn.send(("done", (index, classify_compile_error(message),
                                time.perf_counter() - start, first_line(message))))


class _Slot:
    """One worker process, its own pipe, and the task it is running.

    A pipe per worker, not one shared queue: a worker killed at its timeout may die in the
    middle of a write, which would leave a shared queue's lock held and every other worker
    unable to answer.
    """

    def __init__(self, ctx: Any, target_name: str, kernel_name: str) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(target_name, kernel_name, child),
                                   daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.retired = False
        self.index: int | None = None
        self.started = time.monotonic()  # of the start-up, then of the current task

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
        self.conn.close()


def precheck(
    problem: Problem, target: Target, kernel: TunableKernel, *,
    jobs: int = 2, timeout_s: float = 300.0, include_rejected: bool = False,
    compiler_options: dict[str, Any] | None = None,
    on_result: Callable[[PrecheckResult], None] | None = None,
    sample_every: int = 1,
) -> list[PrecheckResult]:
    """Compiles every candidate of ``kernel`` (discovered) for ``target`` in ``jobs``
    processes, each with a timeout; with ``sample_every`` n > 1 only every n-th candidate (a
    deterministic sample: pick an n prime to the sizes of the space's axes, so every value of
    each axis is drawn)."""
    todo = candidates(problem, target, kernel, include_rejected=include_rejected)[::sample_every]
    results: list[PrecheckResult | None] = [None] * len(todo)
    ctx = mp.get_context("spawn")
    next_index = 0  # the next candidate to hand to a worker
    slots = [_Slot(ctx, target.name, kernel.name) for _ in range(max(1, min(jobs, len(todo))))]

    def record(index: int, status: Status, seconds: float, error: str | None) -> None:
        result = PrecheckResult(todo[index].config, status, seconds, todo[index].predicted_fit,
                                error)
        results[index] = result
        if on_result:
            on_result(result)

    def feed(slot: _Slot) -> None:
        nonlocal next_index
        if next_index == len(todo):
            slot.index = None
            return
        slot.index, slot.started = next_index, time.monotonic()
        slot.conn.send((next_index, problem.to_dict(),
                        todo[next_index].config.to_dict(),
                        compiler_options, todo[next_index].forward_only))
        next_index += 1

    def replace(i: int) -> None:
        """Retires slot ``i`` (killed or dead); a new worker takes its place while work is left."""
        slots[i].stop()
        if next_index < len(todo):
            slots[i] = _Slot(ctx, target.name, kernel.name)
        else:
            slots[i].retired, slots[i].index = True, None

    try:
        while any(r is None for r in results):
            now = time.monotonic()
            # Wake up no later than the nearest deadline, so a timeout is enforced on time.
            wait = min([1.0] + [max(0.0, s.started + timeout_s - now) for s in slots
                                if s.index is not None])
            live = {s.conn: s for s in slots if not s.retired}
            for conn in wait_for(list(live), timeout=wait):
                slot = live[conn]
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):  # the worker died; the checks below handle it
                    slot.process.join(timeout=1)
                    continue
                if kind == "ready":
                    slot.ready = True
                    feed(slot)
                    continue
                index, status, seconds, error = payload
                if seconds > timeout_s:  # finished, but later than allowed
                    status, error = Status.TIMEOUT, f"no result within {timeout_s:g} s"
                record(index, status, seconds, error)
                feed(slot)
            for i, slot in enumerate(slots):
                if slot.retired:
                    continue
                if slot.index is not None and time.monotonic() - slot.started > timeout_s:
                    slot.process.kill()
                    record(slot.index, Status.TIMEOUT, time.monotonic() - slot.started,
                           f"no result within {timeout_s:g} s")
                    replace(i)
                elif not slot.process.is_alive() and slot.index is not None:
                    record(slot.index, Status.COMPILE_ERROR, time.monotonic() - slot.started,
                           f"compiler process died (exit code {slot.process.exitcode})")
                    replace(i)
                elif not slot.ready and (not slot.process.is_alive() or
                                         time.monotonic() - slot.started > START_TIMEOUT_S):
                    raise RuntimeError(
                        f"a compiler process failed to start within {START_TIMEOUT_S:.0f} s "
                        f"(exit code {slot.process.exitcode}); is libtpu installed? "
                        "(pip install 'flash-autotune[tpu]')")
    finally:
        for slot in slots:
            if not slot.retired:
                slot.stop()
    return [r for r in results if r is not None]
