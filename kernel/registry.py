"""Every registered backend by name: plain imports, one mapping per problem type (tokamax's
IMPLEMENTATIONS): :data:`KERNELS`, the attention backends ``flash_attention`` picks among, and
:data:`SERVING_KERNELS`, those of a serving step (``kernel.serving.ServingProblem``).

Pure Python at import (backends load jax only when run). Adding a backend: import it here and
add it to its problem type's mapping; see the checklist in :class:`kernel.contract.TunableKernel`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from kernel.backends import (flash, jax_tpu_flash, mosaic_gpu, pallas_gpu, rpa, splash,
                             tokamax_splash, xla)
from kernel.contract import TunableKernel
from kernel.errors import ConfigError

DEFAULT_KERNEL = flash.KERNEL.name

KERNELS: Mapping[str, TunableKernel] = MappingProxyType({
    backend.name: backend
    for backend in (flash.KERNEL, jax_tpu_flash.KERNEL, pallas_gpu.KERNEL, splash.KERNEL,
                    tokamax_splash.KERNEL, xla.KERNEL, xla.CUDNN, mosaic_gpu.KERNEL)
})
SERVING_KERNELS: Mapping[str, TunableKernel] = MappingProxyType({rpa.KERNEL.name: rpa.KERNEL})


def kernel_names() -> list[str]:
    """The attention backends' names."""
    return list(KERNELS)


def get_kernel(name: str) -> TunableKernel:
    """The attention backend called ``name``; an unknown name lists the known ones, and a
    serving backend's says what it runs."""
    if name in SERVING_KERNELS:
        raise ConfigError(f"kernel {name!r} runs a serving step (ragged paged attention over a "
                          "paged KV cache), not an attention call; choose one of "
                          f"{', '.join(KERNELS)}, or tune and look up {name!r} by its serving "
                          "problem (docs/serving.md)")
    return registered_kernel(name)


def registered_kernel(name: str) -> TunableKernel:
    """The registered backend called ``name``, of either problem type (what tables, storage
    and the service read configs with); an unknown name lists the known ones."""
    for kernels in (KERNELS, SERVING_KERNELS):
        if name in kernels:
            return kernels[name]
    raise ConfigError(f"unknown kernel {name!r}; choose one of "
                      f"{', '.join([*KERNELS, *SERVING_KERNELS])}")


def is_registered(name: str) -> bool:
    """Whether a backend of either problem type is called ``name``."""
    return name in KERNELS or name in SERVING_KERNELS
