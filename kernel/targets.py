"""The devices a kernel is tuned and checked for: TPU generations, any GPU, and the CPU.

Pure Python: the service checks stored configs against the same targets the tuner used.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from kernel.errors import ConfigError

log = logging.getLogger(__name__)

MiB = 1 << 20


@dataclass(frozen=True)
class Target:
    """A device a kernel is compiled for, with the limits the rules check against."""

    name: str
    device_kind: str  # as jax.Device.device_kind reports it
    scoped_vmem_bytes: int | None  # None: no VMEM (a GPU, or interpret mode on a CPU)
    topology: str | None = None  # deviceless topology name for ahead-of-time TPU compiles
    # A core's whole VMEM, the most a kernel's vmem_limit_bytes may raise the scoped limit to
    # (JAX's pallas.mosaic.tpu_info); None: no VMEM.
    vmem_capacity_bytes: int | None = None


TARGETS: dict[str, Target] = {
    "v4": Target("v4", "TPU v4", 16 * MiB, "v4:1x1x1", 16 * MiB),
    "v5e": Target("v5e", "TPU v5 lite", 16 * MiB, "v5e:1x1", 128 * MiB),
    "v5p": Target("v5p", "TPU v5", 16 * MiB, "v5p:1x1x1", 64 * MiB),
    "v6e": Target("v6e", "TPU v6 lite", 32 * MiB, "v6e:1x1", 128 * MiB),
    "cpu": Target("cpu", "cpu", None),
}
TPU_TARGETS: tuple[str, ...] = tuple(TARGETS)  # v4 v5e v5p v6e cpu (interpret mode)
# A GPU has no scoped VMEM; what its kernels cannot hold (shared memory, registers) only the
# GPU compiler knows. Matched by platform, not device kind ("NVIDIA H200", ...).
GPU_TARGET = Target("gpu", "gpu", None)
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def get_target(name: str) -> Target:
    """A TPU or CPU target by name (``v5e``) or by JAX device kind (``TPU v5 lite``)."""
    if name in TARGETS:
        return TARGETS[name]
    for target in TARGETS.values():
        if target.device_kind.lower() == name.lower():
            return target
    raise ConfigError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}")


def device_target(platform: str, device_kind: str) -> Target:
    """The target of a JAX device (``device.platform``, ``device.device_kind``): a known TPU
    generation, ``gpu`` for any CUDA/ROCm device, ``cpu`` (interpret mode) for a CPU. A TPU of
    a kind not listed here gets the most conservative generation's limits (warned once)."""
    if platform in GPU_PLATFORMS:
        return GPU_TARGET
    known = next((t for t in TARGETS.values() if t.device_kind == device_kind), None)
    if known is not None:
        return known
    return _unknown_tpu_target(device_kind) if platform == "tpu" else TARGETS["cpu"]


@functools.cache
def _unknown_tpu_target(device_kind: str) -> Target:
    """The TPU generation with the smallest scoped VMEM, standing in for an unlisted kind."""
    tpus = [t for t in TARGETS.values() if t.scoped_vmem_bytes is not None]
    target = min(tpus, key=lambda t: t.scoped_vmem_bytes)
    log.warning("flash-autotune: TPU device kind %r is not one of %s; checking configs against "
                "%s's limits (%d MiB scoped VMEM), the most conservative known; upgrade "
                "flash-autotune for this chip's own", device_kind,
                ", ".join(t.device_kind for t in tpus), target.name,
                target.scoped_vmem_bytes // MiB)
    return target
