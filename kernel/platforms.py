"""Keeping JAX from starting libtpu's TPU backend where no TPU is attached.

With libtpu installed (the ``tpu`` and ``all`` extras), every JAX process tries the TPU
backend first; without a TPU, libtpu prints ``Failed to find host bounds ...``, ``E0000 ...
INVALID_ARGUMENT: unexpected worker hostname ...`` and a source location trace before JAX
falls back to the CPU. ``import kernel`` calls :func:`skip_absent_tpu`, so our commands and a
model importing ``kernel`` before its first JAX computation stay quiet. Pure Python.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")
# Device files of accelerators: TPUs (accel: v4, v5e; vfio: v5p, v6e and later) and GPUs.
# Settings that say a TPU is meant to be used here (a user's or ``tune --devices``'s).
TPU_SETTINGS = ("JAX_FORCE_TPU_INIT", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES",
                "TPU_VISIBLE_CHIPS", "TPU_PROCESS_BOUNDS", "TPU_CHIPS_PER_PROCESS_BOUNDS")
ACCELERATOR_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/nvidiactl",
                     "/dev/kfd", "/dev/dxg")


def accelerator_attached() -> bool:
    """Whether this machine shows any sign of a TPU or GPU: a TPU on the PCI bus, or a device
    file of one (what libtpu and JAX look for). When in doubt, yes."""
    if any(glob.glob(pattern) for pattern in ACCELERATOR_FILES):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if (Path(vendor).read_text().strip() == GOOGLE_PCI_VENDOR
                    and Path(vendor).with_name("device").read_text().strip()
                    in TPU_PCI_DEVICES):
                return True
        except OSError:
            return True
    return False


def skip_absent_tpu() -> None:
    """Runs JAX on the CPU alone where no accelerator is attached and nothing chose the
    platforms (``JAX_PLATFORMS``, ``jax_platforms``, :data:`TPU_SETTINGS`): the CPU is what
    JAX would fall back to, without libtpu's noise. Does nothing once JAX's backends are
    started."""
    if (os.environ.get("JAX_PLATFORMS") or any(name in os.environ for name in TPU_SETTINGS)
            or accelerator_attached()):
        return
    jax = sys.modules.get("jax")
    if jax is None:
        os.environ["JAX_PLATFORMS"] = "cpu"
        return
    from jax._src import xla_bridge

    if not jax.config.jax_platforms and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
