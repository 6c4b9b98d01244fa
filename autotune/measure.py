"""Measuring a registered kernel's configs on the attached device.

Per candidate: an ahead-of-time compile (started early, in a small thread pool, for the
candidates the search will ask about next), a correctness gate against the XLA reference, then
timing with one method of :mod:`autotune.timing` (``step_profile``, ``loop`` or
``wallclock``): warm-up, repeated runs, median and spread (with ``step_profile``, of the whole
step, and the named kernels' part of it beside). Every failure is classified and returned, never
raised. Off the kernel's platforms (a CPU-only machine) the kernel runs in Pallas interpret
mode: the pipeline is exercised for real, but the times are no device figure (method
``interpret``).
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from autotune.devices import host_workers
from autotune.failures import (
    ChipStateCorrupted,
    ProblemTooLarge,
    Status,
    classify_compile_error,
    out_of_memory,
)
from autotune.timing import (
    PROFILE,
    TimingError,
    kernel_op_matcher,
    looped,
    op_names,
    profiler_missing,
    run_times,
    timing_plan,
    trace_runs,
)
from autotune.trials import Measurement
from kernel import DEFAULT_KERNEL, Problem, TunableKernel, get_kernel
from kernel.tolerance import max_relative_error
from kernel.tolerance import relative_error as output_error
from present.text import first_line

Config = Any  # the measured kernel's config type (``TunableKernel.config_type``)
K = TypeVar("K", bound=Hashable)
BuildFn = Callable[[Problem, Config], Callable[..., Any]]
RUN_COUNT = jax.ShapeDtypeStruct((), np.int32)  # the run count a looped program takes first
log = logging.getLogger(__name__)


# Configs a tuning search claims ahead of the one it measures, so that their compiles (seconds
# each on a TPU) run on the host's cores during its measurement. The sampler picks them before
# it sees that result: replayed on bench/search/landscapes (bench/search/replay.py --ahead, 20
# seeds), 2 ahead found configs as good as 1 ahead (the tuner before) within the seeds' noise,
# while 3 and 6 fell behind on convolution-A100 (median score@50 0.674 and 0.693 against 0.844 and 0.811).
AHEAD = 2
# Host memory one compile running ahead may hold at its peak: an allowance, so that a host
# with many cores and little memory compiles fewer at once.
COMPILE_MEMORY = 2 * 2**30


@dataclass(frozen=True)
class Timing:
    """Times of repeated runs of one compiled config, in milliseconds (what each is depends
    on the timing method: a run's wall or the whole step's device time, or a loop's time per
    run); ``kernel_samples_ms``, per sample, the part of it the kernel's named
    ``pallas_call``s took (``step_profile`` timing of a kernel that names them; else empty)."""

    samples_ms: tuple[float, ...]
    kernel_samples_ms: tuple[float, ...] = ()

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def kernel_median_ms(self) -> float | None:
        return statistics.median(self.kernel_samples_ms) if self.kernel_samples_ms else None

    @property
    def iqr_ms(self) -> float:
        if len(self.samples_ms) < 4:
            return max(self.samples_ms) - min(self.samples_ms)
        q1, _, q3 = statistics.quantiles(self.samples_ms, n=4)
        return q3 - q1


GIB = 2**30


@dataclass(frozen=True)
class Footprint:
    """Bytes a measurement of a problem holds on its device at its peak: the ``inputs`` (q, k,
    v, any segment ids), the reference's ``outputs`` (the gate's expected values, kept for the
    whole search), and the larger of the reference's temporaries while it runs
    (``reference_temps``) and two more sets of outputs while a config runs (the canary's first
    output and the run's)."""

    inputs: int
    outputs: int
    reference_temps: int = 0

    @property
    def total(self) -> int:
        return self.inputs + self.outputs + max(self.reference_temps, 2 * self.outputs)

    def parts(self) -> str:
        temps = (f"the reference's temporaries {self.reference_temps / GIB:,.2f}"
                 if self.reference_temps > 2 * self.outputs else
                 f"a run's and the canary's outputs {2 * self.outputs / GIB:,.2f}")
        return (f"inputs {self.inputs / GIB:,.2f}, expected outputs {self.outputs / GIB:,.2f}, "
                f"{temps} GiB")


def gated(kernel: TunableKernel | None) -> TunableKernel:
    """The kernel whose gate (``reference`` and ``input_specs``) is asked: ``kernel`` where it
    has a reference of its own (a serving step's), else the default kernel, so that every
    attention backend shares one gate (:func:`kernel.contract.gate_reference`) and its
    compile."""
    own = kernel is not None and type(kernel).reference is not TunableKernel.reference
    return kernel if own else get_kernel(DEFAULT_KERNEL)


def least_footprint(problem: Problem, kernel: TunableKernel | None = None) -> Footprint:
    """What a measurement of ``problem`` holds at the least, from the shapes alone: the
    inputs of ``kernel``'s measured function, and the reference's outputs (the attention
    output, or dq, dk and dv) three times over, the reference's temporaries left out."""
    kernel = gated(kernel)
    specs = kernel.input_specs(problem)
    outputs = jax.tree.leaves(jax.eval_shape(kernel.reference(problem), *specs))
    return Footprint(*(sum(math.prod(x.shape) * x.dtype.itemsize for x in arrays)
                       for arrays in (specs, outputs)))


def compiled_reference(problem: Problem, device: jax.Device,
                       kernel: TunableKernel | None = None) -> Any:
    """The gate's reference of ``problem`` (``kernel``'s, :func:`gated`) compiled for
    ``device``: what :func:`check_fits` sizes and the measurer runs (one compile each)."""
    return _compiled_reference(problem, device, gated(kernel))


@functools.lru_cache(maxsize=2)
def _compiled_reference(problem: Problem, device: jax.Device, kernel: TunableKernel) -> Any:
    return jax.jit(kernel.reference(problem)).lower(
        *kernel.input_specs(problem, device)).compile()


def reference_footprint(problem: Problem, device: jax.Device,
                        kernel: TunableKernel | None = None) -> Footprint:
    """What a measurement of ``problem`` holds on ``device``, from the compiler's memory
    analysis of the reference; :func:`least_footprint` where the compiler gives none."""
    analysis = compiled_reference(problem, device, kernel).memory_analysis()
    if analysis is None:
        return least_footprint(problem, kernel)
    return Footprint(analysis.argument_size_in_bytes, analysis.output_size_in_bytes,
                     analysis.temp_size_in_bytes)


def host_memory_bytes() -> int | None:
    """The host's physical memory; None when this system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # not on this system
        return None


def device_memory_bytes(device: jax.Device) -> int | None:
    """The memory ``device`` holds arrays in: its allocator's limit (a TPU or GPU), or the
    host's physical memory (a CPU); None when neither is known."""
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit is not None or device.platform != "cpu":
        return limit
    return host_memory_bytes()


def claims_ahead(sampler_learns: bool, cores: int | None = None, memory: int | None = None,
                 workers: int | None = None) -> int:
    """How many configs a search claims ahead of the one it measures, compiling meanwhile
    (the measurer's compile threads are one more). A sampler that learns from the results
    claims ``AHEAD`` (more fell behind, above). One that does not (``random``, ``grid``: a
    landscape's sample) claims what this process's share of the host (``workers`` tuning
    processes share its ``cores`` and ``memory``; default: this host, :func:`host_workers`)
    compiles at once: a thread per two cores (the rest for the measuring thread, its
    traces' conversion and the compiler's own threads), ``COMPILE_MEMORY`` each; never
    fewer than ``AHEAD``."""
    cores = (os.cpu_count() or 1) if cores is None else cores
    memory = host_memory_bytes() if memory is None else memory
    workers = host_workers() if workers is None else workers
    if sampler_learns:
        return AHEAD
    threads = cores // 2 if memory is None else min(cores // 2, memory // COMPILE_MEMORY)
    return max(AHEAD, threads // workers - 1)


def check_fits(problem: Problem, device: jax.Device, memory: int | None = None,
               kernel: TunableKernel | None = None) -> None:
    """Raises ``ProblemTooLarge``, one line naming the sizes, when measuring ``problem`` needs
    more than ``memory`` bytes (default: ``device``'s, :func:`device_memory_bytes`), before
    anything is allocated: first by the shapes alone (:func:`least_footprint`), then, if that
    fits, by the compiled reference's memory analysis (:func:`reference_footprint`), of
    ``kernel``'s gate (:func:`gated`)."""
    memory = device_memory_bytes(device) if memory is None else memory
    if memory is None:
        return
    for footprint in (lambda: least_footprint(problem, kernel),
                      lambda: reference_footprint(problem, device, kernel)):
        needed = footprint()
        if needed.total > memory:
            raise ProblemTooLarge(
                f"{problem.label()} needs {needed.total / GIB:,.2f} GiB on the device "
                f"({needed.parts()}) and the {device.device_kind} device has "
                f"{memory / GIB:,.2f} GiB: tune the shape one device runs (its batch and "
                "heads after sharding)")


@contextmanager
def refused_out_of_memory(problem: Problem, device: jax.Device, doing: str) -> Iterator[None]:
    """Turns the device's memory running out (``RESOURCE_EXHAUSTED``) while ``doing`` into
    ``ProblemTooLarge``: one line, never a traceback."""
    try:
        yield
    except Exception as error:
        if not out_of_memory(error):
            raise
        raise ProblemTooLarge(
            f"{problem.label()} ran out of memory on the {device.device_kind} device {doing} "
            f"({first_line(str(error))}): tune the shape one device runs (its batch and heads "
            "after sharding)") from None


def same_bits(got: Any, want: Any) -> bool:
    """Whether two outputs (pytrees of arrays) are identical bit for bit, compared on their
    device: one boolean comes back, not the outputs."""
    return bool(_same_bits(got, want))


@jax.jit
def _same_bits(got: Any, want: Any) -> jax.Array:
    def bits(x: jax.Array) -> jax.Array:
        if x.dtype == jnp.bool_:
            return x
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))

    return jnp.stack([jnp.array_equal(bits(a), bits(b)) for a, b in zip(
        jax.tree.leaves(got), jax.tree.leaves(want), strict=True)]).all()


@dataclass(frozen=True)
class Program:
    """A measured function compiled for the timing method: a ``looped`` one takes the number
    of runs first (:func:`autotune.timing.looped`); ``kernel_names`` are the kernels whose
    share of the step a profile reports (``TunableKernel.profile_names``; empty: none);
    ``compile_s`` the seconds its compile took."""

    fn: Callable[..., Any]
    compiled: Any
    looped: bool
    kernel_names: tuple[str, ...] = ()
    compile_s: float = 0.0


def relative_error(got: Any, want: Any) -> float:
    """The worst :func:`kernel.tolerance.relative_error` over every output (the attention
    output, or dq, dk and dv)."""
    return max(output_error(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                                                  strict=True))


@dataclass
class Measurer:
    """Measures configs of one problem and one kernel on ``jax.devices()[0]``; a search
    ``Measure``.

    ``prepare(config)`` starts compiling a config the search will ask about soon; calling the
    measurer with a config waits for its compile (``compile_timeout_s``), checks the result
    against the gate's reference (:func:`compiled_reference`) and times it with ``timing``
    (``auto``, ``step_profile``, ``loop`` or ``wallclock``; after construction the method in
    use). Construction raises ``ProblemTooLarge`` when the problem does not fit the device
    (:func:`check_fits`, or the device's memory running out). ``build`` makes the function to
    measure (``kernel.build`` by default). ``fallback`` is the method used when a profile
    trace holds no event of the measured program (``auto`` sets ``loop`` on a TPU or GPU;
    without one, ``step_profile`` raises ``TimingError``); on falling back, ``timing_note``
    says why and ``notify`` (else the log) is told once.
    """

    problem: Problem
    base: Config  # a config of ``kernel``; fields the search does not vary come from here
    kernel: TunableKernel
    compile_timeout_s: float = 300.0
    min_runs: int = 5
    max_runs: int = 50
    min_time_s: float = 0.2  # keep timing until this much time (or max_runs) is spent
    warmup: int = 1
    tolerance: float | None = None
    pool_size: int = AHEAD + 1  # compiles at once: the config asked for and those ahead
    build: BuildFn | None = None
    seed: int = 0
    timing: str = "auto"
    fallback: str | None = None
    notify: Callable[[str], None] | None = None
    loop_sample_s: float = 0.02  # a loop program runs the kernel about this long per sample
    max_loop_runs: int = 1000
    timing_note: str | None = field(init=False, default=None)
    corrupt: str | None = field(init=False, default=None)  # why the chip state is corrupt
    _canary: tuple[Program, Any] | None = field(init=False, default=None)
    _canary_taken: bool = field(init=False, default=False)
    keep_best: int = 3  # compiled programs of the fastest configs kept for the confirmation
    _kept: dict[Config, tuple[Program, float]] = field(init=False, default_factory=dict)
    _pool: ThreadPoolExecutor = field(init=False, repr=False)
    _compiles: dict[Config, Future] = field(init=False, repr=False, default_factory=dict)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.device = jax.devices()[0]
        self.method = "device" if self.device.platform in self.kernel.platforms else "interpret"
        self.timing, planned = timing_plan(self.timing, self.device.platform)
        self.fallback = self.fallback or planned
        missing = profiler_missing() if self.timing == PROFILE else None
        if missing is not None:  # else every config would fail to time, as a runtime error
            self._fall_back(missing)
        if self.build is None:
            self.build = self.kernel.build
        if self.tolerance is None:
            # The bound the kernel tests hold every kernel to: a config less accurate than
            # that fails the gate, however fast.
            self.tolerance = max_relative_error(self.problem.dtype, self.device.platform)
        check_fits(self.problem, self.device, kernel=self.kernel)
        self.inputs, self.expected = self._gate_values()
        self._pool = ThreadPoolExecutor(self.pool_size, thread_name_prefix="compile")

    def _gate_values(self) -> tuple[list[jax.Array], Any]:
        """The gate's inputs on the device (q, k, v, and a segmented problem's representative
        packing: the kernel's ``example_inputs``) and the reference's outputs on them."""
        with refused_out_of_memory(self.problem, self.device,
                                   "computing the correctness gate's reference"):
            inputs = [jax.device_put(x, self.device)
                      for x in self.kernel.example_inputs(self.problem, self.seed)]
            return inputs, jax.block_until_ready(
                compiled_reference(self.problem, self.device, self.kernel)(*inputs))

    def config(self, params: dict[str, Any]) -> Config:
        return self.base.replace(**params)

    def compile(self, fn: Callable[..., Any], kernel_names: Sequence[str] = ()) -> Program:
        """Compiles the measured function ``fn`` (of the measurer's inputs) in the form the
        timing method runs."""
        start = time.perf_counter()
        if self.timing == "loop":
            compiled = jax.jit(looped(fn)).lower(RUN_COUNT, *self.inputs).compile()
        else:
            compiled = jax.jit(fn).lower(*self.inputs).compile()
        return Program(fn, compiled, self.timing == "loop", tuple(kernel_names),
                       time.perf_counter() - start)

    def _compile(self, config: Config) -> Program:
        return self.compile(self.build(self.problem, config), self.kernel.profile_names)

    def run(self, program: Program, runs: int = 1) -> Any:
        """Runs ``program`` to completion (``runs`` times in one call if looped)."""
        args = (np.int32(runs), *self.inputs) if program.looped else self.inputs
        return jax.block_until_ready(program.compiled(*args))

    def prepare(self, params: dict[str, Any]) -> None:
        """Starts compiling ``params`` in the background (no-op if already started)."""
        self._start(self.config(params))

    def _start(self, config: Config) -> None:
        with self._lock:
            if config not in self._compiles and self._held(config) is None:
                self._compiles[config] = self._pool.submit(self._compile, config)

    def _held(self, config: Config) -> Program | None:
        """The compiled program held for ``config``: one of the fastest measured, or the
        canary's (the default's); None if none is."""
        if config in self._kept:
            return self._kept[config][0]
        return self._canary[0] if self._canary is not None and config == self.base else None

    def _compiled(self, config: Config) -> Program | Measurement:
        """``config`` compiled: its held program, else its background compile (started now if
        it was not) waited for; or the compile's failure (a result, not a crash)."""
        held = self._held(config)
        if held is not None:
            return held
        self._start(config)
        with self._lock:
            future = self._compiles[config]
        try:
            return future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            # A running compile cannot be interrupted; it finishes in the background and is
            # dropped. The config is classified and the search moves on.
            self._abandon_pool()
            return Measurement.failure(Status.TIMEOUT, error=f"compile took longer than "
                                       f"{self.compile_timeout_s:g} s")
        except Exception as error:  # noqa: BLE001 - any compiler failure is a result
            return Measurement.failure(classify_compile_error(str(error)),
                                       error=first_line(str(error)))
        finally:
            with self._lock:  # drop the executable once taken: flat memory over long runs
                self._compiles.pop(config, None)

    def settle_timing(self, params: dict[str, Any]) -> None:
        """Settles a ``step_profile`` timing before a search by timing ``params`` (the
        default) twice: falls back to ``loop``, or raises ``TimingError`` for an explicit
        ``step_profile``, when the trace holds no event of the measured program. The
        default's program is kept (the canary's) for the search; a config that fails leaves
        the question to the first config that runs."""
        if self.timing != PROFILE:
            return
        self._take_canary()
        program, _ = self.checked(self.config(params))
        if program is not None:
            self.time(program, runs=2)

    def __call__(self, params: dict[str, Any]) -> Measurement:
        if self.corrupt is not None:
            raise ChipStateCorrupted(self.corrupt)
        self._take_canary()
        config = self.config(params)
        asked = time.perf_counter()
        program = self._compiled(config)
        if isinstance(program, Measurement):
            return program
        waited = time.perf_counter() - asked
        measurement = self._check_and_time(program)
        self._keep_if_fast(config, program, measurement)
        timed = time.perf_counter()
        measurement = self._canary_after(config, measurement)
        # Where the trial's time went (its compile ran ahead, in compile_s).
        return replace(measurement, attrs={**measurement.attrs, "wait_s": round(waited, 4),
                                           "canary_s": round(time.perf_counter() - timed, 4)})

    def _keep_if_fast(self, config: Config, program: Program, measurement: Measurement) -> None:
        """Keeps ``program`` when ``config`` is among the ``keep_best`` fastest measured, so
        the confirmation runs it without compiling it again (a few seconds a config on a TPU);
        at most ``keep_best`` are held, so memory stays flat over a long run."""
        if not measurement.ok:
            return
        self._kept[config] = (program, measurement.value)
        if len(self._kept) > self.keep_best:
            del self._kept[max(self._kept, key=lambda kept: self._kept[kept][1])]

    def _take_canary(self) -> None:
        if not self._canary_taken:
            self._canary, self._canary_taken = self._canary_of(self.base), True

    def _canary_of(self, config: Config) -> tuple[Program, Any] | None:
        """``config``'s program and its output on the gate's inputs; None when it fails, or
        when two runs differ (a kernel that is not bit-reproducible, e.g. one reducing with
        atomics on a GPU, cannot be a canary)."""
        program, _ = self.checked(config)
        if program is None:
            return None
        first = self.run(program)
        return (program, first) if same_bits(self.run(program), first) else None

    def _canary_after(self, config: Config, measurement: Measurement) -> Measurement:
        """``measurement``, or ``corrupts_state`` when the canary (the default config, run
        before the search) no longer gives its first output bit for bit. A config that leaves
        a copy in flight can be right itself and corrupt every later kernel (pallas-facts
        §10); checked after every config, so the one that did it is named (one run of the
        default: milliseconds, against seconds of compiling and timing a config)."""
        if self._canary_holds():
            return measurement
        self.corrupt = (
            f"the device's state is corrupt after config {config.label(self.problem.mode)}: "
            f"the default config's output on the same inputs changed since the search began. "
            f"That config is recorded as corrupts_state and never published")
        return Measurement.failure(Status.CORRUPTS_STATE, error=self.corrupt)

    def _canary_holds(self) -> bool:
        """Whether the canary still gives its first output bit for bit (True without one)."""
        if self._canary is None:
            return True
        program, first = self._canary
        return same_bits(self.run(program), first)

    def _abandon_pool(self) -> None:
        """Leaves an overrunning compile its thread and gives later compiles a new pool, so
        they do not queue behind it and time out too; queued compiles are dropped (a config
        is compiled again when asked for)."""
        with self._lock:
            stuck, self._pool = self._pool, ThreadPoolExecutor(
                self.pool_size, thread_name_prefix="compile")
            stuck.shutdown(wait=False, cancel_futures=True)
            self._compiles = {c: f for c, f in self._compiles.items() if not f.cancelled()}

    def _check(self, program: Program) -> tuple[Measurement | None, float]:
        """Runs ``program`` once against the reference: (its failure or None, its error)."""
        compile_s = program.compile_s
        try:
            got = self.run(program)
        except Exception as error:
            return Measurement.failure(Status.RUNTIME_ERROR, compile_s=compile_s,
                                       error=first_line(str(error))), float("inf")
        error = relative_error(got, self.expected)
        if not error <= self.tolerance:
            return Measurement.failure(Status.WRONG_RESULT, compile_s=compile_s,
                                       error=f"relative error {error:.3g} over tolerance "
                                             f"{self.tolerance:g}"), error
        return None, error

    def _check_and_time(self, program: Program) -> Measurement:
        start = time.perf_counter()
        failure, error = self._check(program)
        if failure is not None:
            return failure
        checked = time.perf_counter()
        timing = self.time(program)
        kernel_ms = {} if timing.kernel_median_ms is None else {
            "kernel_ms": timing.kernel_median_ms}
        return Measurement(timing.median_ms, Status.OK, {
            "compile_s": round(program.compile_s, 4), "gate_s": round(checked - start, 4),
            "time_s": round(time.perf_counter() - checked, 4), "iqr_ms": timing.iqr_ms,
            "runs": len(timing.samples_ms), "max_error": error, "timing": self.timing,
            **kernel_ms})

    def time(self, program: Program, *, runs: int | None = None) -> Timing:
        """Times ``program`` with the timing method after ``warmup`` runs: exactly ``runs``
        samples when given, else at least ``min_runs`` and until ``min_time_s`` has passed
        (at most ``max_runs``). A program compiled for another method is compiled again."""
        if program.looped != (self.timing == "loop"):
            program = self.compile(program.fn, program.kernel_names)
        start = time.perf_counter()
        for _ in range(self.warmup):
            self.run(program)
        run_s = (time.perf_counter() - start) / max(self.warmup, 1)
        if self.timing == PROFILE:
            count = runs or min(self.max_runs, max(self.min_runs,
                                                   math.ceil(self.min_time_s / run_s)))
            timing = self._profile(program, count)
            if timing is not None:
                return timing
            self._fall_back(f"the profiler trace on {self.device.device_kind} holds no device "
                            f"event of the measured program")
            return self.time(program, runs=runs)
        if self.timing == "loop":
            n = min(self.max_loop_runs, max(2, math.ceil(self.loop_sample_s / run_s)))
            return self._sample(lambda: self.run(program, n), runs, per_call=n)
        return self._sample(lambda: self.run(program), runs)

    def _profile(self, program: Program, runs: int) -> Timing | None:
        """``runs`` runs of ``program`` under one profiler trace: per run, the busy time of
        every op of its executable (the whole step), and of its named kernels (the
        breakdown; empty when it names none or the trace shows none of them); None when the
        trace holds no op of the executable."""
        return profiled_runs(program.compiled, self.inputs, runs, program.kernel_names)

    def _sample(self, call: Callable[[], Any], runs: int | None, per_call: int = 1) -> Timing:
        samples: list[float] = []
        begin = time.perf_counter()
        for sample in itertools.islice(wall_times(call, per_call), runs or self.max_runs):
            samples.append(sample)
            if runs is None and len(samples) >= self.min_runs and (
                    time.perf_counter() - begin >= self.min_time_s):
                break
        return Timing(tuple(samples))

    def _fall_back(self, reason: str) -> None:
        """``step_profile`` timing cannot time the kernel (``reason``): switch to the fallback
        and say so once, or (an explicit ``step_profile``) raise ``TimingError``."""
        if self.fallback is None:
            raise TimingError(f"{PROFILE} timing cannot time kernel {self.kernel.name!r}: "
                              f"{reason}; use --timing loop or wallclock")
        self.timing, self.fallback = self.fallback, None
        self.timing_note = f"timing with {self.timing} instead of {PROFILE}: {reason}"
        (self.notify or log.warning)(self.timing_note)

    def checked(self, config: Config) -> tuple[Program | None, Measurement | None]:
        """``config`` compiled and run once against the reference: ``(program, None)``, or
        ``(None, its failure)``."""
        program = self._compiled(config)
        if isinstance(program, Measurement):
            return None, program
        failure, _ = self._check(program)
        return (None, failure) if failure else (program, None)

    def timer(self, program: Program, runs_per_round: int = 3) -> Callable[[], Timing]:
        """One round of :func:`interleaved` for ``program``: ``runs_per_round`` samples, timed
        with the same method as the search."""
        return lambda: self.time(program, runs=runs_per_round)

    def confirm(self, configs: Sequence[Config], rounds: int = 5,
                runs_per_round: int = 3) -> dict[Config, Timing]:
        """Re-measures ``configs`` :func:`interleaved`. Configs that fail to compile, run or
        pass the correctness gate here are left out (the default is confirmed even when the
        search never measured it). Then the canary runs (taken now if no search ran here): a
        device left corrupt by the end of the confirmation raises ``ChipStateCorrupted``, so
        nothing is published from it."""
        self._take_canary()
        timers = {}
        for config in dict.fromkeys(configs):
            program, _ = self.checked(config)
            if program is not None:
                timers[config] = self.timer(program, runs_per_round)
        timings = interleaved(timers, rounds)
        if not self._canary_holds():
            raise ChipStateCorrupted(
                f"the device's state is corrupt after the confirmation of "
                f"{len(timers)} configs: the default config's output on the same inputs "
                f"changed since the canary was taken; nothing is published")
        return timings

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._compiles.clear()
        self._kept.clear()


def wall_times(call: Callable[[], Any], per_call: int = 1) -> Iterator[float]:
    """The wall milliseconds of each call of ``call`` (which must block until its work is
    done), divided by ``per_call`` (the runs one call makes), call after call until the
    consumer stops (``itertools.islice`` for a fixed number of runs)."""
    while True:
        start = time.perf_counter()
        call()
        yield (time.perf_counter() - start) * 1e3 / per_call


def profiled_runs(compiled: Any, args: Sequence[Any], runs: int,
                  kernel_names: Sequence[str] = ()) -> Timing | None:
    """``runs`` runs of ``compiled(*args)`` under one profiler trace
    (:func:`autotune.timing.trace_runs`): per run, the busy time of every op of the
    executable (the whole step), and of the ``pallas_call``s named ``kernel_names`` (the
    breakdown; empty when none is named or the trace shows none of them); None when the
    trace holds no op of the executable."""
    events = trace_runs(lambda: compiled(*args), runs)
    step = run_times(events, runs, kernel_op_matcher(op_names(compiled), ()))
    if step is None:
        return None
    kernels = run_times(events, runs, kernel_op_matcher((), kernel_names)) \
        if kernel_names else None
    return Timing(tuple(step), tuple(kernels or ()))


def interleaved(timers: Mapping[K, Callable[[], Timing]], rounds: int) -> dict[K, Timing]:
    """Runs every timer once per round, interleaved (A B C A B C ...), so drift and noise hit
    all alike; each round contributes the median of that timer's runs (and of their named
    kernels' part, where measured)."""
    samples: dict[K, list[float]] = {key: [] for key in timers}
    kernel_samples: dict[K, list[float]] = {key: [] for key in timers}
    for _ in range(rounds):
        for key, timer in timers.items():
            timing = timer()
            samples[key].append(timing.median_ms)
            if timing.kernel_median_ms is not None:
                kernel_samples[key].append(timing.kernel_median_ms)
    return {key: Timing(tuple(values), tuple(kernel_samples[key]))
            for key, values in samples.items()}
