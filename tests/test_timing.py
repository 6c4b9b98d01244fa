"""Timing methods and the roofline, on this machine's CPU.

``step_profile`` reads a real ``jax.profiler`` trace of a real executable with xprof (on a CPU
the executable's ops are host-side events): every op of the step counts, the named kernels'
part beside it; ``auto`` falls back to ``loop`` without xprof and says why, once; the retired
``profile`` is refused, naming why; a looped program really runs its body n times; the
roofline formulas against values worked out by hand, and no roofline figure on a CPU.
"""

from __future__ import annotations

import gzip
import itertools
import os
import statistics
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autotune import timing
from autotune.measure import Measurer, interleaved, wall_times
from autotune.peaks import device_roofline, gpu_peaks, tpu_peaks
from autotune.timing import (
    TimingError,
    busy_per_op,
    kernel_op_matcher,
    looped,
    op_events,
    op_names,
    op_sources,
    run_times,
    timing_plan,
    trace_events,
    trace_runs,
)
from kernel import Problem, get_kernel
from kernel.roofline import Peaks, attention_bytes, attention_flops, attention_pairs, roofline

FLASH = get_kernel("flash")
TINY = Problem(1, 1, 1, 256, 256, 128, "float32", False, "fwd")
X = jnp.asarray(np.random.default_rng(0).normal(size=(384, 384)), jnp.float32)


def matmuls(x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ x) @ x


def profile_runs(call, runs: int, counts) -> list[float] | None:  # noqa: ANN001
    return run_times(trace_runs(call, runs), runs, counts)


def test_profile_reads_device_time_per_run_from_a_real_trace() -> None:
    compiled = jax.jit(matmuls).lower(X).compile()
    jax.block_until_ready(compiled(X))
    walls: list[float] = []

    def timed_call() -> jax.Array:
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(X))
        walls.append((time.perf_counter() - start) * 1e3)
        return out

    first = profile_runs(timed_call, 6, kernel_op_matcher(op_names(compiled), ()))
    second = profile_runs(lambda: compiled(X), 6, kernel_op_matcher(op_names(compiled), ()))
    assert first is not None and second is not None and len(first) == len(second) == 6
    # Each run's ops fall inside the wall time of the calls: in all (per run, a CPU op whose
    # timestamp the profiler's clock puts a little before its run's annotation counts for the
    # run before; a loaded 2-core CI machine showed one run 0.12 ms over its 2.06 ms wall).
    assert all(busy > 0 for busy in first) and sum(first) <= sum(walls), (first, walls)
    # Without a timed call around each run, too (no ratio of the two: load flips one).
    assert all(busy > 0 for busy in second), second
    # Events of kernels the executable does not run are none: not a zero time.
    assert profile_runs(lambda: compiled(X), 2, kernel_op_matcher(op_names(compiled), ("flash_fwd",))) \
        is None


# --- traces recorded on a GPU: tests/data/h200_traces/README.md ---

TRACES = Path(__file__).parent / "data" / "h200_traces"
# The HLO instructions of the two traced executables (``op_names`` of each, on that machine).
PALLAS_GPU_OPS = ("k.1", "pallas_call.0", "param_0", "param_0.1", "param_0.2", "param_0.3",
                  "q.1", "transpose.3.1", "transpose.4.1", "transpose.5.1", "transpose.6.1",
                  "v.1", "wrapped_transpose", "wrapped_transpose.1", "wrapped_transpose.2",
                  "wrapped_transpose.3")
MATMUL_OPS = ("constant_1_1", "constant_1_2", "convert_element_type.2.1",
              "convert_element_type.3.1", "custom-call.1", "get-tuple-element",
              "input_reduce_fusion", "input_reduce_fusion.1", "param_0.3", "param_0.4",
              "reduce.1.1", "reduce_sum.3", "reduce_sum.4", "reduce_sum.5.0", "reduce_sum.7.1",
              "x.1")


def recorded(name: str, folder: Path) -> list[dict[str, Any]]:
    """The events of a recorded trace (three runs, each in its ``autotune-run-`` mark)."""
    (folder / name).mkdir(parents=True)
    with gzip.open(TRACES / f"{name}.xplane.pb.gz") as packed:
        (folder / name / "host.xplane.pb").write_bytes(packed.read())
    return trace_events(folder / name)


def stream_kernels_ms(events: list[dict[str, Any]]) -> float:
    """What the GPU's kernels took in all, from the stream lines: the check on the op lines."""
    return sum(e.get("dur", 0.0) for e in events
               if "/device:" in e["process"] and e["thread"].startswith("Stream #")) / 1e3


@pytest.mark.parametrize(("name", "ops"), [("pallas_gpu-command-buffer", PALLAS_GPU_OPS),
                                           ("pallas_gpu-no-command-buffer", PALLAS_GPU_OPS),
                                           ("matmul", MATMUL_OPS)])
def test_profile_reads_device_time_from_an_h200_trace(name: str, ops: tuple[str, ...],
                                                      tmp_path: Path) -> None:
    """On a GPU xprof names the op line per stream (``XLA Ops - from #14``), and XLA runs the
    Pallas program's five kernels as one command buffer, a single op event of no HLO name.
    Missing either, every profile there fell back to loop timing."""
    events = recorded(name, tmp_path)
    # Each event carries its HLO instruction name, read once for every run_times call.
    named = {e["op"] for e in events if "/device:" in e["process"]
             and e["thread"].startswith("XLA Ops")}
    assert named and all(op in ops or op.startswith("command_buffer") for op in named), named
    times = run_times(events, 3, kernel_op_matcher(ops, ()))
    assert times is not None and len(times) == 3, times
    assert sum(times) == pytest.approx(stream_kernels_ms(events), rel=0.02)
    assert max(times) / min(times) < 1.1, times


def test_h200_traces_count_only_the_measured_executable_and_its_named_kernels(
        tmp_path: Path) -> None:
    plain = recorded("pallas_gpu-no-command-buffer", tmp_path)
    assert run_times(plain, 3, kernel_op_matcher(MATMUL_OPS, ())) is None
    assert run_times(recorded("matmul", tmp_path), 3,
                     kernel_op_matcher(PALLAS_GPU_OPS, ())) is None
    # The pallas_call alone: the attention kernel without the four transposes around it.
    kernel = run_times(plain, 3, kernel_op_matcher(PALLAS_GPU_OPS, ("pallas_call",)))
    whole = run_times(plain, 3, kernel_op_matcher(PALLAS_GPU_OPS, ()))
    assert kernel is not None and whole is not None
    assert all(0.7 * w < k < 0.95 * w for k, w in zip(kernel, whole, strict=True))
    # Inside a command buffer a named kernel has no op event: None (the caller falls back).
    buffered = recorded("pallas_gpu-command-buffer", tmp_path)
    assert run_times(buffered, 3, kernel_op_matcher(PALLAS_GPU_OPS, ("pallas_call",))) is None


def test_busy_per_op_splits_the_steps_time_among_its_ops(tmp_path: Path) -> None:
    """Per HLO instruction, its busy time per run: together the step's (within the little
    that ops on two streams overlap), the pallas_call's its named kernel time."""
    events = recorded("pallas_gpu-no-command-buffer", tmp_path)
    per_op = busy_per_op(events, 3, kernel_op_matcher(PALLAS_GPU_OPS, ()))
    assert set(per_op) <= set(PALLAS_GPU_OPS) and len(per_op) > 1, per_op
    assert all(ms > 0 for ms in per_op.values()), per_op
    whole = run_times(events, 3, kernel_op_matcher(PALLAS_GPU_OPS, ()))
    assert statistics.mean(whole) <= sum(per_op.values()) < 1.01 * statistics.mean(whole)
    kernel = run_times(events, 3, kernel_op_matcher((), ("pallas_call",)))
    assert sum(ms for op, ms in per_op.items() if op.startswith("pallas_call")) \
        == pytest.approx(statistics.mean(kernel), rel=1e-6)


def test_op_sources_name_the_jax_operation_of_each_instruction() -> None:
    compiled = jax.jit(matmuls).lower(X).compile()
    sources = op_sources(compiled)
    assert set(sources) <= op_names(compiled), sources
    assert any(source.endswith("/dot_general") for source in sources.values()), sources
    assert any(source.endswith("/tanh") for source in sources.values()), sources


def test_a_profile_drops_the_native_profiler_noise_and_keeps_other_native_output(capfd) -> None:
    """The lines the profiler's C++ logging prints for every trace on a TPU (written here to
    file descriptor 2 as native code writes them) do not reach the terminal; others do."""
    compiled = jax.jit(matmuls).lower(X).compile()
    lines = [b"E0000 00:00 1 tool.cc:1] No UnifiedProfileProcessor registered for tool: "
             b"trace_viewer@\n", b"W0000 00:00 1 remap.cc:2] Remapping device id 0 to 0\n",
             b"E0000 00:00 1 other.cc:3] a real native error\n"]

    def noisy_call() -> jax.Array:
        for line in lines:
            os.write(2, line)
        return compiled(X)

    assert profile_runs(noisy_call, 2, kernel_op_matcher(op_names(compiled), ())) is not None
    stderr = capfd.readouterr().err
    assert "UnifiedProfileProcessor" not in stderr and "Remapping" not in stderr
    assert stderr.count("a real native error") == 2


def test_auto_plan_per_platform() -> None:
    assert timing_plan("auto", "tpu") == ("step_profile", "loop")
    assert timing_plan("auto", "gpu") == ("step_profile", "loop")
    assert timing_plan("auto", "cpu") == ("wallclock", None)
    assert timing_plan("loop", "tpu") == ("loop", None)
    with pytest.raises(TimingError, match="unknown timing method 'stopwatch'; choose one of"):
        timing_plan("stopwatch", "cpu")
    # The retired method, which counted the named kernels only, is refused, saying why.
    with pytest.raises(TimingError, match=r"'profile' \(retired: it timed the named kernels "
                                          r"only, not the whole step\); choose one of auto, "
                                          r"step_profile, loop"):
        timing_plan("profile", "tpu")


def doubled_tanh(x: jax.Array) -> jax.Array:
    """A Pallas kernel (interpret mode, a grid of 4) over the rows of ``x``."""
    from jax.experimental import pallas as pl

    rows = x.reshape(-1, x.shape[-1])
    block = pl.BlockSpec((rows.shape[0] // 4, rows.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(lambda x, o: o.__setitem__(..., jnp.tanh(x[...]) * 2.0),
                          out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype), grid=(4,),
                          in_specs=[block], out_specs=block, interpret=True,
                          name="doubled_tanh")(rows)


def products(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """:func:`matmuls` of a 512 x 512 matrix made of q, k and v: XLA ops, no kernel."""
    return matmuls(jnp.concatenate([x.reshape(-1, 128) for x in (q, k, v, q)])
                   .reshape(512, 512))


def test_step_profile_counts_every_op_of_the_step_and_the_named_kernels_beside() -> None:
    """The measured step is a kernel and matrix products outside it: the step's time holds
    both, the kernel's part (all that ``profile`` counted) leaves the products out. On a CPU
    an interpret-mode ``pallas_call`` runs as an XLA while loop (its ``name=`` names no op
    there), so the kernel here is named by that loop, the step's only one."""
    problem = Problem(1, 2, 2, 256, 256, 128, "float32", False, "fwd")
    xla = get_kernel("xla")
    measurer = Measurer(problem, xla.default_config(problem, "cpu"), xla,
                        timing="step_profile", min_runs=5, min_time_s=0.05)
    try:
        step = measurer.compile(lambda q, k, v: (doubled_tanh(q), products(q, k, v)),
                                ("while",))
        alone = measurer.compile(products, ("while",))
        timings = interleaved({"step": measurer.timer(step, 5),
                               "products": measurer.timer(alone, 5)}, rounds=3)
    finally:
        measurer.close()
    whole = timings["step"]
    assert timings["products"].kernel_median_ms is None  # no kernel of that name ran
    assert whole.kernel_median_ms is not None and whole.kernel_median_ms > 0
    # The products count in the step, and are no part of its kernel: the step's time is many
    # times its kernel's (about 40x on a quiet 2-core CPU), where either mistake would make
    # them about equal. Both come from the same runs, so no load between runs can flip it (the
    # products timed alone, compared with the step, once read 3x the step's time under load).
    assert whole.median_ms > 5 * whole.kernel_median_ms, whole


def test_step_profile_times_an_interpreted_kernels_whole_step_without_a_breakdown() -> None:
    """Our kernel in interpret mode: its step's ops are timed (no fall back to ``loop``), and
    its named kernels, which run no ``flash_fwd`` event there, give no breakdown."""
    notes: list[str] = []
    measurer = Measurer(TINY, FLASH.default_config(TINY, "cpu"), FLASH, timing="step_profile",
                        fallback="loop", notify=notes.append, min_time_s=0.01, min_runs=2)
    try:
        measurer.settle_timing({})
        first = measurer({})
    finally:
        measurer.close()
    assert (measurer.timing, notes) == ("step_profile", [])
    assert first.ok and first.attrs["timing"] == "step_profile" and first.value > 0
    assert "kernel_ms" not in first.attrs


def test_profile_without_xprof_falls_back_before_any_config_fails(monkeypatch) -> None:
    """A GPU environment assembled by hand lacked xprof: every config then failed to time and
    was stored as a runtime error. Now ``auto`` falls back at once, and says how to fix it."""
    monkeypatch.setitem(sys.modules, "xprof", None)  # what an environment without it imports
    notes: list[str] = []
    measurer = Measurer(TINY, FLASH.default_config(TINY, "cpu"), FLASH, timing="step_profile",
                        fallback="loop", notify=notes.append, min_time_s=0.01, min_runs=2)
    try:
        first = measurer({})
    finally:
        measurer.close()
    assert notes == [measurer.timing_note]
    assert "xprof, which reads the profiler trace, is not installed (pip install xprof)" \
        in notes[0]
    assert first.ok and first.attrs["timing"] == "loop"
    with pytest.raises(TimingError, match="pip install xprof.*use --timing loop or wallclock"):
        Measurer(TINY, FLASH.default_config(TINY, "cpu"), FLASH, timing="step_profile")


def test_loop_runs_its_body_n_times() -> None:
    """The loop is in the compiled program (a while loop holding the matrix products) and its
    time grows with n: nothing hoisted, merged or unrolled away."""
    compiled = jax.jit(looped(matmuls)).lower(jax.ShapeDtypeStruct((), np.int32), X).compile()
    text = compiled.as_text()
    body = text[text.index("while"):]
    assert "while" in text and "dot(" in body
    assert jnp.allclose(compiled(np.int32(1), X), matmuls(X))

    def seconds(n: int) -> float:
        jax.block_until_ready(compiled(np.int32(n), X))
        return min(_wall(lambda: compiled(np.int32(n), X)) for _ in range(3))

    assert seconds(16) / seconds(2) > 4


def test_wall_timing_takes_the_runs_asked_or_runs_until_enough() -> None:
    """One wall-time loop (``wall_times``) serves ``wallclock`` and ``loop`` timing and the step
    confirmation: a fixed number of runs is that many calls, each sample a call's time over
    the runs it makes; without one, at least ``min_runs`` until ``min_time_s`` has passed, at
    most ``max_runs``."""
    calls: list[None] = []
    samples = list(itertools.islice(
        wall_times(lambda: (calls.append(None), time.sleep(0.004)), per_call=2), 3))
    assert len(calls) == 3 and all(2 <= s < 1000 for s in samples), samples  # ms, not s or us
    measurer = Measurer(TINY, FLASH.default_config(TINY, "cpu"), FLASH, timing="wallclock",
                        min_runs=2, max_runs=4, min_time_s=0.0)
    try:
        program, failure = measurer.checked(measurer.config({}))
        assert failure is None
        assert len(measurer.time(program, runs=3).samples_ms) == 3
        assert len(measurer.time(program).samples_ms) == 2  # min_time_s passed at once
        measurer.min_time_s = 600
        assert len(measurer.time(program).samples_ms) == 4  # max_runs long before that
    finally:
        measurer.close()


def _wall(call) -> float:  # noqa: ANN001
    start = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - start


def test_op_names_are_the_executables_instructions() -> None:
    compiled = jax.jit(matmuls).lower(X).compile()
    names = op_names(compiled)
    assert names and all(" " not in name for name in names)
    assert kernel_op_matcher(op_names(compiled), ("flash_fwd",))("flash_fwd.3")
    assert not kernel_op_matcher(op_names(compiled), ("flash_fwd",))("flash_fwd_helper.3")


# --- roofline ---

MHA = Problem(2, 8, 8, 1024, 1024, 128, "bfloat16", False, "fwd")
GQA_CAUSAL = Problem(1, 8, 2, 512, 256, 64, "float32", True, "fwd_bwd")


def test_roofline_formulas_against_hand_computed_values() -> None:
    # MHA: 1024 x 1024 pairs; 4 FLOPs per pair and head_dim, batch 2, 8 heads.
    assert attention_pairs(MHA) == 1_048_576
    assert attention_flops(MHA) == 4 * 2 * 8 * 128 * 1_048_576 == 8_589_934_592
    # |Q| = |O| = 2*8*1024*128 = 2_097_152 elements = |K| = |V|; bf16: 2 bytes each.
    assert attention_bytes(MHA) == 2 * 4 * 2_097_152 == 16_777_216
    # Causal, top-left aligned, q 512 over kv 256: rows 0..255 keep 1..256 keys (32_896),
    # rows 256..511 all 256 (65_536).
    assert attention_pairs(GQA_CAUSAL) == 32_896 + 65_536 == 98_432
    assert attention_flops(GQA_CAUSAL) == 14 * 8 * 64 * 98_432 == 705_560_576
    # |Q| = 8*512*64 = 262_144; |K| = 2*256*64 = 32_768; float32; lse 4 bytes x 2 x 4096 rows.
    assert attention_bytes(GQA_CAUSAL) == 4 * 6 * (262_144 + 32_768) + 8 * 4096 == 7_110_656
    # Square causal: about half the pairs.
    assert attention_pairs(Problem(1, 1, 1, 4, 4, 8, causal=True)) == 10

    peaks = Peaks(flops_per_s=100e12, bytes_per_s=1e12, source="test")
    # 8.59 GFLOP take 85.9 us at 100 TFLOP/s, 16.8 MB take 16.8 us at 1 TB/s: compute binds.
    at_half = roofline(MHA, 2 * 8_589_934_592 / 100e12 * 1e3, peaks)
    assert (at_half.bound, at_half.fraction, at_half.tflops) == ("compute", pytest.approx(0.5),
                                                                 pytest.approx(50.0))
    slow_memory = Peaks(flops_per_s=100e12, bytes_per_s=0.1e12, source="test")
    memory = roofline(MHA, 1.0, slow_memory)  # 16.8 MB at 0.1 TB/s: 168 us of 1 ms
    assert (memory.bound, memory.fraction) == ("memory", pytest.approx(0.16777216))
    assert roofline(MHA, 1.0, None).fraction is None


def test_a_time_below_the_roofline_records_no_fraction(caplog) -> None:
    """Issue 62 item 8: storage refuses a roofline fraction above 1 (a time the device's peaks
    do not allow); the tuner records none rather than fail its publish."""
    h100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    plausible = device_roofline(h100, MHA, 1.0)
    assert 0 < plausible.fraction <= 1 and plausible.bound == "compute"
    impossible = device_roofline(h100, MHA, 1e-6)
    assert (impossible.fraction, impossible.bound) == (None, None) and impossible.tflops > 1e6
    assert "beats the least time the peaks of NVIDIA H100 80GB HBM3 allow" in caplog.text


def test_peaks_from_jax_and_the_gpu_table_and_none_on_cpu() -> None:
    v5e = tpu_peaks("TPU v5 lite", 1)
    assert (v5e.flops_per_s, v5e.bytes_per_s) == (197e12, 820e9)
    assert tpu_peaks("TPU v4", 2).flops_per_s == 2 * 137.5e12  # megacore: both TensorCores
    assert tpu_peaks("TPU v99", 1) is None
    assert gpu_peaks("NVIDIA H200", "bfloat16").bytes_per_s == 4.8e12
    assert gpu_peaks("NVIDIA H100 80GB HBM3", "float32").flops_per_s == 494.5e12
    assert gpu_peaks("NVIDIA H100 PCIe", "bfloat16").flops_per_s == 756.5e12
    assert gpu_peaks("Tesla T4", "bfloat16") is None
    assert device_roofline(jax.devices()[0], MHA, 1.0) is None


def test_a_trace_leaves_out_the_python_calls_of_threads_compiling_meanwhile() -> None:
    """While the tuner times a config, others compile in its threads (mostly Python: tracing
    and lowering). A trace that records their every call is mostly those calls, each
    converted and parsed; the trace keeps the runs' marks and the executable's op events."""
    compiled = jax.jit(matmuls).lower(X).compile()
    jax.block_until_ready(compiled(X))
    done = threading.Event()

    def compiling() -> None:
        while not done.is_set():
            jax.jit(lambda x: jnp.sin(x) * 2).lower(X).compile()

    thread = threading.Thread(target=compiling)
    thread.start()
    try:
        events = trace_runs(lambda: compiled(X), 3)
    finally:
        done.set()
        thread.join()
    python_calls = [e["name"] for e in events if e["name"].startswith("$")]
    assert python_calls == [], python_calls[:5]
    assert run_times(events, 3, kernel_op_matcher(op_names(compiled), ())) is not None


def test_the_lean_trace_reads_the_same_step_times_as_a_full_one(monkeypatch) -> None:
    """The same executable traced in turns with the profiler's defaults (the Python tracer
    on, host level 2: the trace before) and with :func:`trace_options`: the same op events
    per run, and busy times of the same order (on a chip, the device's op
    lines)."""
    compiled = jax.jit(matmuls).lower(X).compile()
    jax.block_until_ready(compiled(X))
    counts = kernel_op_matcher(op_names(compiled), ())
    lean = timing.trace_options
    medians: dict[str, list[float]] = {"full": [], "lean": []}
    ops: dict[str, set[int]] = {"full": set(), "lean": set()}
    for _ in range(4):
        for name, options in (("full", jax.profiler.ProfileOptions), ("lean", lean)):
            monkeypatch.setattr(timing, "trace_options", options)
            events = trace_runs(lambda: compiled(X), 3)
            ops[name].add(len(op_events(events, counts)))  # on a chip, its op lines
            medians[name].append(statistics.median(run_times(events, 3, counts)))
    assert ops["full"] == ops["lean"] and len(ops["lean"]) == 1, ops
    # Times read alike: a unit or an event mistake is 1000x off; the bound leaves load room.
    ratio = statistics.median(medians["lean"]) / statistics.median(medians["full"])
    assert 0.1 < ratio < 10, medians
