"""How one run of a compiled function is timed: ``step_profile``, ``loop`` or ``wallclock``.

- ``wallclock``: host time around ``jax.block_until_ready(f(x))``; includes Python dispatch
  and host synchronisation (tens of microseconds), more than small kernels take.
- ``loop``: ``n`` runs inside one compiled program (:func:`looped`), its host time over
  ``n``: dispatch is paid once per ``n`` runs. Each run's first input depends on the previous
  run's output, so the compiler can neither hoist the runs out of the loop nor merge or
  overlap them; ``n`` is a runtime argument, so it cannot unroll them away either. The loop
  itself costs per run: on an H200, cuDNN attention at b4 h16 q512 d64 read 0.075 ms per run
  looped against 0.032 ms of device time, so ``loop`` is only the fallback there.
- ``step_profile``: a ``jax.profiler`` trace around the runs, read with the ``xprof`` package
  (:func:`trace_runs`); per run, the busy time of every op event of the measured executable:
  the whole step a training step runs, the kernel's ``pallas_call``s and every XLA op around
  them (padding, transposes, the reductions of the backward). The executable is
  ``jax.jit`` of the measured function itself: the harness adds no op to it (no loop, no
  carry; :func:`looped` is ``loop``'s alone), so nothing is left out. Beside it, the kernel's
  share: the busy time of the events named after its ``pallas_call`` names
  (``TunableKernel.profile_names``), a breakdown that ranks nothing. On a CPU the
  executable's ops run as host-side events, which the same rule reads.

``profile``, which counted the named kernels only, is retired: on a TPU v5e at b4 h16 s4096
d128 causal fwd_bwd it left out 1.89 ms of flash's step (13%) and 0.90 ms of splash's (8%), so
it ranked kernels by times no training step sees. Results timed by it are stale
(:data:`kernel.resolve.RETIRED_TIMINGS`).

``auto`` is ``step_profile`` on a TPU or GPU, falling back to ``loop`` when the trace holds no
device event of the measured program, and ``wallclock`` on a CPU (:func:`timing_plan`).
"""

from __future__ import annotations

import bisect
import contextlib
import importlib.util
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax

from kernel import AutotuneError
from storage import CURRENT_TIMINGS, unknown_timing

PROFILE = "step_profile"  # the profiler-trace method: the whole step's device time
TIMING_CHOICES: tuple[str, ...] = ("auto", *CURRENT_TIMINGS)
RUN_MARK = "autotune-run-"  # the host annotation around each profiled run
# xprof's line of a device's HLO op events: "XLA Ops" on a TPU; on a GPU one per stream,
# "XLA Ops - from #14".
XLA_OPS_LINE = "XLA Ops"
# XLA's GPU runs a sequence of ops as one CUDA graph, a command buffer; on the op line it is
# one event, named after no HLO instruction, that spans its kernels.
_COMMAND_BUFFER = re.compile(r"command_buffer(_\d+)?")
_INSTRUCTION = re.compile(r"%([^\s=,()]+) = ")


class TimingError(AutotuneError):
    """A timing method cannot time this kernel here; the message names the method to use."""


def timing_plan(requested: str, platform: str) -> tuple[str, str | None]:
    """The method to time with and the one to fall back to when a profile trace holds no
    event of the measured program: ``auto`` is (``step_profile``, ``loop``) on a TPU or GPU
    and (``wallclock``, None) on a CPU; a named method is itself with no fallback."""
    unknown = unknown_timing(requested)
    if unknown is not None:
        raise TimingError(unknown)
    if requested != "auto":
        return requested, None
    return ("wallclock", None) if platform == "cpu" else (PROFILE, "loop")


def profiler_missing() -> str | None:
    """Why ``profile`` timing cannot run in this environment, or None: it reads the trace
    with xprof, an install dependency that a hand-assembled environment can lack."""
    if importlib.util.find_spec("xprof") is None:
        return "xprof, which reads the profiler trace, is not installed (pip install xprof)"
    return None


def looped(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``(n, *args) -> fn(*args)`` computed ``n`` times in one program (``n >= 1``, a traced
    int32): each run's first argument gets the previous output's first element times zero
    added to one element, a data dependency the compiler cannot see through."""
    def run(n: Any, *args: Any) -> Any:
        def body(_: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
            first, out = carry
            dependency = jax.tree.leaves(out)[0].ravel()[0] * 0
            first = first.at[(0,) * first.ndim].add(dependency.astype(first.dtype))
            return first, fn(first, *args[1:])

        return jax.lax.fori_loop(1, n, body, (args[0], fn(*args)))[1]

    return run


def op_names(compiled: Any) -> frozenset[str]:
    """The HLO instruction names of a compiled executable: what its op events are called."""
    return frozenset(_INSTRUCTION.findall(compiled.as_text()))


_SOURCE = re.compile(r'%([^\s=,()]+) = .*?metadata=\{op_name="([^"]*)"')


def op_sources(compiled: Any) -> dict[str, str]:
    """Per HLO instruction of a compiled executable, the JAX operation it came from (its
    ``op_name`` metadata, e.g. ``jit(step)/transpose(jvp(...))/dot_general``), where it has
    one: what an op event computes, since instruction names differ between compiles."""
    return dict(_SOURCE.findall(compiled.as_text()))


def kernel_op_matcher(ops: Iterable[str], kernel_names: Iterable[str]) -> Callable[[str], bool]:
    """Which op events count: those named after ``kernel_names`` (an HLO instruction
    ``flash_fwd.1`` is a ``pallas_call(name="flash_fwd")``), or with none given, every op of
    the executable, ``ops`` (its :func:`op_names`), and its command buffers. A named kernel
    inside a command buffer has no event of its own on the op line, so it is not found."""
    names = tuple(kernel_names)
    if names:
        return lambda op: op.split(".")[0] in names
    executable = frozenset(ops)
    return lambda op: op in executable or _COMMAND_BUFFER.fullmatch(op) is not None


def trace_events(logdir: str | Path) -> list[dict[str, Any]]:
    """The events of the ``jax.profiler`` trace in ``logdir`` (Chrome trace format, converted
    by xprof), each with its process and thread names added (``process``, ``thread``) and its
    HLO instruction name (``op``, :func:`_op_name`)."""
    from xprof.convert.raw_to_tool_data import xspace_to_tool_data

    paths = sorted(str(p) for p in Path(logdir).rglob("*.xplane.pb"))
    if not paths:
        raise TimingError(f"jax.profiler wrote no trace under {logdir}")
    data, _ = xspace_to_tool_data(paths, "trace_viewer@", {"use_saved_result": False})
    processes: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    spans = []
    for event in json.loads(data)["traceEvents"]:  # one pass: a trace holds 10,000s of events
        kind = event.get("ph")
        if kind == "X":
            spans.append(event)
        elif kind == "M" and event.get("name") == "process_name":
            processes[event["pid"]] = event["args"]["name"]
        elif kind == "M" and event.get("name") == "thread_name":
            threads[event["pid"], event["tid"]] = event["args"]["name"]
    for event in spans:
        event["process"] = processes.get(event["pid"], "")
        event["thread"] = threads.get((event["pid"], event.get("tid")), "")
        event["op"] = _op_name(event)
    return spans


def _op_name(event: dict[str, Any]) -> str:
    """An op event's HLO instruction name (xprof may show a long form ``%name = ...``)."""
    match = _INSTRUCTION.match(event.get("args", {}).get("long_name", ""))
    return match.group(1) if match else event["name"]


def _is_op_line(thread: str) -> bool:
    return thread == XLA_OPS_LINE or thread.startswith(f"{XLA_OPS_LINE} - ")


def _busy_ms(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals in microseconds, in ms (nested or
    overlapping op events count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e3


def op_events(events: list[dict[str, Any]],
              counts: Callable[[str], bool]) -> list[dict[str, Any]]:
    """The op events ``counts`` accepts (by HLO instruction name; ``events`` as
    :func:`trace_events` gives them): on a device's ``XLA Ops``
    line when the trace has devices, else (a CPU) on the host's threads."""
    on_device = any("/device:" in e["process"] for e in events)
    return [e for e in events if ("/device:" in e["process"] and _is_op_line(e["thread"])
                                  if on_device else not e["name"].startswith(RUN_MARK))
            and counts(e["op"])]


def busy_per_op(events: list[dict[str, Any]], runs: int,
                counts: Callable[[str], bool]) -> dict[str, float]:
    """Per HLO instruction that ``counts`` accepts, the busy time (ms) of its op events
    (:func:`op_events`) per run: their union over the ``runs`` profiled runs, over ``runs``."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for event in op_events(events, counts):
        spans.setdefault(event["op"], []).append(
            (event["ts"], event["ts"] + event.get("dur", 0.0)))
    return {name: _busy_ms(intervals) / runs for name, intervals in spans.items()}


def run_times(events: list[dict[str, Any]], runs: int,
              counts: Callable[[str], bool]) -> list[float] | None:
    """Per profiled run, the busy time (ms) of the op events ``counts`` accepts (``events`` as
    :func:`trace_events` gives them): on a device's ``XLA Ops`` line when the trace has
    devices, else (a CPU) on the host's threads. Runs are told apart by their host
    annotations; None when no event counts."""
    marks = sorted((e["ts"], int(e["name"][len(RUN_MARK):])) for e in events
                   if e["name"].startswith(RUN_MARK))
    if len(marks) != runs:
        raise TimingError(f"the trace holds {len(marks)} of the {runs} runs' annotations")
    ops = op_events(events, counts)
    if not ops:
        return None
    starts = [ts for ts, _ in marks]
    intervals: list[list[tuple[float, float]]] = [[] for _ in range(runs)]
    for event in ops:  # a device clock slightly ahead of the host's still counts for its run
        run = marks[max(0, bisect.bisect_right(starts, event["ts"]) - 1)][1]
        intervals[run].append((event["ts"], event["ts"] + event.get("dur", 0.0)))
    return [_busy_ms(spans) for spans in intervals]


def trace_options() -> jax.profiler.ProfileOptions:
    """What a trace records: the device's op events, and on the host its annotations (the
    runs' ``RUN_MARK``s; on a CPU also the executable's op events), all at host level 1;
    not every Python call of every thread (the Python tracer, on by default), nor the host's
    level-2 detail. While configs compile ahead in other threads, their Python calls were
    most of a trace (on a 2-core CPU, 231,000 of a trial's 252,000 events), each one
    serialised, converted by xprof and parsed, and the tracer slowed those compiles."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 1
    return options


def trace_runs(call: Callable[[], Any], runs: int) -> list[dict[str, Any]]:
    """Runs ``call`` ``runs`` times (each to completion, in its own ``RUN_MARK`` annotation)
    under one ``jax.profiler`` trace (:func:`trace_options`) and returns the trace's
    :func:`trace_events`."""
    with tempfile.TemporaryDirectory(prefix="autotune-profile-") as logdir, \
            native_noise_dropped(PROFILER_NOISE):
        jax.profiler.start_trace(logdir, profiler_options=trace_options())
        try:
            for index in range(runs):
                with jax.profiler.TraceAnnotation(f"{RUN_MARK}{index}"):
                    jax.block_until_ready(call())
        finally:
            jax.profiler.stop_trace()
        return trace_events(logdir)


# What the profiler's and xprof's C++ logging prints to stderr for every trace on a TPU, with
# nothing for a user to do about it (seen with jax 0.10.2, libtpu 0.0.42.1, xprof 2.24).
PROFILER_NOISE = re.compile(r"No UnifiedProfileProcessor registered for tool|"
                            r"Unified processor not found for tool|Remapping device id")


@contextlib.contextmanager
def native_noise_dropped(noise: re.Pattern[str]) -> Iterator[None]:
    """Holds what native code writes to the process's stderr (file descriptor 2, which
    Python's ``sys.stderr`` cannot intercept) while the block runs, then writes it back
    without the lines ``noise`` matches."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(True)
                    if not noise.search(line)]
            sys.stderr.write("".join(kept))
