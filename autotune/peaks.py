"""A device's peak throughput for the roofline (``kernel.roofline``), or None where unknown.

TPU figures come from the installed JAX (``pltpu.get_tpu_info_for_chip``: per TensorCore, times
the device's cores); GPU figures from :data:`GPU_PEAKS` below; a CPU, or a TPU or GPU not
listed, has none: its results store no fraction of a roofline rather than a made-up one
(and a CPU no achieved TFLOP/s either).
"""

from __future__ import annotations

import logging
from typing import Any

from kernel import Problem, device_target
from kernel.roofline import Peaks, Roofline, roofline
from kernel.targets import TARGETS

log = logging.getLogger(__name__)

# Dense (no sparsity) tensor-core peaks per device kind, matched as a substring of
# jax.Device.device_kind in this order: (bf16 FLOP/s, tf32 FLOP/s for float32 inputs, HBM B/s).
GPU_PEAKS: tuple[tuple[str, tuple[float, float, float], str], ...] = (
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS and TF32 989 TFLOPS with
    # sparsity, so half that dense; GPU memory bandwidth 4.8 TB/s.
    ("H200", (989e12, 494.5e12, 4.8e12), "NVIDIA H200 datasheet (SXM, dense)"),
    # NVIDIA H100 Tensor Core GPU datasheet, PCIe column: BF16 1,513 / TF32 756 TFLOPS with
    # sparsity; 2.0 TB/s.
    ("H100 PCIe", (756.5e12, 378e12, 2.0e12), "NVIDIA H100 datasheet (PCIe, dense)"),
    # NVIDIA H100 Tensor Core GPU datasheet, SXM column: BF16 1,979 / TF32 989 TFLOPS with
    # sparsity; 3.35 TB/s.
    ("H100", (989.5e12, 494.5e12, 3.35e12), "NVIDIA H100 datasheet (SXM, dense)"),
)


def tpu_peaks(device_kind: str, cores: int) -> Peaks | None:
    """Peaks of a TPU device (``cores`` TensorCores) from the installed JAX, or None when this
    JAX has no ``get_tpu_info_for_chip`` or does not know the chip. JAX gives the bf16 MXU
    peak only: float32 problems are held against it too (their fraction reads low)."""
    from jax.experimental.pallas import tpu as pltpu

    # A listed generation only: an unlisted kind's stand-in limits (kernel.targets) are no
    # figures of its own.
    target = next((t for t in TARGETS.values() if t.device_kind == device_kind), None)
    if not hasattr(pltpu, "get_tpu_info_for_chip") or target is None or target.name == "cpu":
        return None
    try:
        chip = pltpu.ChipVersion(target.name)
        info = pltpu.get_tpu_info_for_chip(chip, cores)
    except ValueError:  # a generation this JAX does not know, or a core count it refuses
        return None
    return Peaks(info.bf16_ops_per_second * cores, info.mem_bw_bytes_per_second * cores,
                 f"pltpu.get_tpu_info_for_chip({chip.value!r}, {cores}) x {cores} cores")


def gpu_peaks(device_kind: str, dtype: str) -> Peaks | None:
    """Peaks of a listed NVIDIA GPU (tf32 tensor cores for float32 inputs), else None."""
    for name, (bf16, tf32, bandwidth), source in GPU_PEAKS:
        if name in device_kind:
            return Peaks(bf16 if dtype == "bfloat16" else tf32, bandwidth, source)
    return None


def device_peaks(device: Any, dtype: str) -> Peaks | None:
    """The peaks of a JAX device for inputs of ``dtype``; None on a CPU or an unlisted chip."""
    if device.platform == "tpu":
        return tpu_peaks(device.device_kind, getattr(device, "num_cores", 1) or 1)
    if device_target(device.platform, device.device_kind).name == "gpu":
        return gpu_peaks(device.device_kind, dtype)
    return None


def device_roofline(device: Any, problem: Problem, time_ms: float) -> Roofline | None:
    """Where ``time_ms`` stands on ``device``'s roofline: None on a CPU (interpret-mode times
    are no device figure) and for a serving step (its work depends on the batch compositions,
    no problem field), no fraction where the device's peaks are unknown."""
    if device.platform == "cpu" or not isinstance(problem, Problem):
        return None
    peaks = device_peaks(device, problem.dtype)
    measured = roofline(problem, time_ms, peaks)
    if measured.fraction is not None and measured.fraction > 1:  # storage refuses it
        log.warning("flash-autotune: %.3f ms for %s beats the least time the peaks of %s allow "
                    "(%s: %.2f of the roofline): they are not this device's; no fraction is "
                    "recorded", time_ms, problem.label(), device.device_kind, peaks.source,
                    measured.fraction)
        return Roofline(measured.tflops)
    return measured
