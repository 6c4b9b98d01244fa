"""Which local devices ``autotune tune --devices`` tunes on, and the environment that makes a
worker process see only its own device. Pure Python (no jax): the parent must not open the
accelerators its workers are about to claim.

TPU: libtpu reads ``TPU_VISIBLE_CHIPS`` (the chip a process may open) and the topology of the
slice the process belongs to from ``TPU_CHIPS_PER_PROCESS_BOUNDS`` and ``TPU_PROCESS_BOUNDS``.
A worker is a one-chip, one-process slice (``1,1,1`` each), so workers never coordinate with
each other nor with other hosts of a pod; each gets its own ``TPU_PROCESS_PORT``, and
``ALLOW_MULTIPLE_LIBTPU_LOAD`` lets several processes of the VM load libtpu (else the first
holds ``/tmp/libtpu_lockfile``). These are the variables JAX's own multi-process test runner
sets per process (``jax/_src/test_multiprocess.py``), all present in the installed libtpu.
GPU: ``CUDA_VISIBLE_DEVICES``. CPU: an ordinary process (the device index only names it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

from kernel import AutotuneError

TPU_BASE_PORT = 8476  # libtpu's default TPU_PROCESS_PORT; worker d takes 8476 + d
# The variable that makes a worker process see only its own device, by platform.
VISIBLE_DEVICES = {"tpu": "TPU_VISIBLE_CHIPS", "gpu": "CUDA_VISIBLE_DEVICES"}
PROBE = ("import json, jax; d = jax.local_devices(); print(json.dumps("
         "{'platform': d[0].platform, 'kind': d[0].device_kind, 'count': len(d)}))")


class DeviceSelectionError(AutotuneError):
    """``--devices`` names no device, or one this machine does not have."""


@dataclass(frozen=True)
class LocalDevices:
    """The accelerator platform of this machine and how many devices it has."""

    platform: str  # "tpu", "gpu" (cuda/rocm) or "cpu"
    count: int
    device_kind: str = "cpu"  # of device 0 (the devices of a machine are one kind)

    @classmethod
    def probe(cls) -> LocalDevices:
        """Asks JAX in a short-lived process (which releases the devices as it exits). On CPU
        each core counts as a device: ``--devices all`` starts one worker per core."""
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                              timeout=300, check=False)
        if done.returncode != 0:
            raise DeviceSelectionError("cannot list the local devices: JAX failed to start: "
                                       + (done.stderr.strip().splitlines() or ["?"])[-1])
        found = json.loads(done.stdout.strip().splitlines()[-1])
        platform = "gpu" if found["platform"] in ("cuda", "rocm", "gpu") else found["platform"]
        count = cpu_devices() if platform == "cpu" else found["count"]
        return cls(platform, count, found["kind"])


# Set by ``autotune tune --devices`` in each worker: how many tuning processes share the host,
# its cores and memory (:func:`autotune.measure.claims_ahead`).
HOST_WORKERS = "AUTOTUNE_HOST_WORKERS"


def host_workers() -> int:
    """How many tuning processes share this host: the ``--devices`` workers, else 1."""
    value = os.environ.get(HOST_WORKERS, "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def cpu_devices() -> int:
    """How many devices a CPU machine offers ``--devices``: one per core."""
    return os.cpu_count() or 1


def measuring_index_problem(index: int, platform: str) -> str:
    """Why ``device_index`` ``index`` names no device a tune in this process measures on
    ('' when it does). The process measures on its first device: index 0, or the device the
    platform's :data:`VISIBLE_DEVICES` variable names alone (as in a worker of ``--devices``);
    on a CPU, where an index only names a worker, any index ``--devices`` selects."""
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    if platform not in VISIBLE_DEVICES:
        count = cpu_devices()
        return "" if index < count else (f"device_index {index} names no {platform} device: "
                                         f"--devices names 0 to {count - 1} here (one per "
                                         "core); leave device_index at 0")
    variable = VISIBLE_DEVICES[platform]
    visible = os.environ.get(variable, "").strip()
    if index == 0 or visible == str(index):
        return ""
    seen = f"{variable}={visible!r}" if visible else f"{variable} unset"
    return (f"device_index {index} names no device this process measures on: its first "
            f"{platform} device, 0 or the one {variable} names alone ({seen}); leave "
            f"device_index at 0, or tune on device {index} with `autotune tune --devices "
            f"{index},`")


def parse_devices(spec: str) -> int | tuple[int, ...] | None:
    """``all`` (None), a count (``4``) or a comma-separated list of indices (``0,2,5``)."""
    text = spec.strip().lower()
    if text == "all":
        return None
    try:
        if "," in text:
            indices = tuple(int(part) for part in text.split(",") if part.strip())
            if indices and min(indices) >= 0 and len(set(indices)) == len(indices):
                return indices
        elif int(text) >= 1:
            return int(text)
    except ValueError:
        pass
    raise DeviceSelectionError(f"--devices {spec!r}: use 'all', a count such as 2, or distinct "
                               "device indices such as 0,2,5 (one index: '3,')")


def select_devices(spec: int | tuple[int, ...] | None, local: LocalDevices) -> tuple[int, ...]:
    """The device indices ``spec`` selects on this machine."""
    if spec is None:
        return tuple(range(local.count))
    if isinstance(spec, int) and spec > local.count:  # never a range of a huge count
        raise DeviceSelectionError(
            f"--devices {spec} selects {spec} devices, but this machine has {local.count} "
            f"{local.platform} device(s); use --devices all or a count up to {local.count}")
    wanted = tuple(range(spec)) if isinstance(spec, int) else spec
    missing = [i for i in wanted if i >= local.count]
    if missing:
        raise DeviceSelectionError(
            f"--devices selects device(s) {', '.join(map(str, missing))}, but this machine has "
            f"{local.count} {local.platform} device(s) (indices 0 to {local.count - 1})")
    return wanted


def worker_env(platform: str, index: int) -> dict[str, str]:
    """The environment variables that make a worker process see only device ``index``."""
    if platform == "tpu":
        port = TPU_BASE_PORT + index
        return {VISIBLE_DEVICES["tpu"]: str(index), "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
                "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_PORT": str(port),
                "TPU_PROCESS_ADDRESSES": f"localhost:{port}", "CLOUD_TPU_TASK_ID": "0",
                "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "JAX_PLATFORMS": "tpu"}
    if platform == "gpu":
        return {VISIBLE_DEVICES["gpu"]: str(index)}
    return {"JAX_PLATFORMS": "cpu"}
