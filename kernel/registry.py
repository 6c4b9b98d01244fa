"""Every registered backend by name: plain imports, one mapping (tokamax's IMPLEMENTATIONS).

Pure Python at import (backends load jax only when run). Adding a backend: import it here and
add it to :data:`KERNELS`; see the checklist in :class:`kernel.contract.TunableKernel`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from kernel.backends import flash, jax_tpu_flash, mosaic_gpu, pallas_gpu, splash, xla
from kernel.contract import TunableKernel
from kernel.errors import ConfigError

DEFAULT_KERNEL = flash.KERNEL.name

KERNELS: Mapping[str, TunableKernel] = MappingProxyType({
    backend.name: backend
    for backend in (flash.KERNEL, jax_tpu_flash.KERNEL, pallas_gpu.KERNEL, splash.KERNEL,
                    xla.KERNEL, xla.CUDNN, mosaic_gpu.KERNEL)
})


def kernel_names() -> list[str]:
    return list(KERNELS)


def get_kernel(name: str) -> TunableKernel:
    """The registered backend called ``name``; an unknown name lists the known ones."""
    if name not in KERNELS:
        raise ConfigError(f"unknown kernel {name!r}; choose one of {', '.join(KERNELS)}")
    return KERNELS[name]
