"""A TPU-native Pallas flash-attention kernel whose tiles come from a config.

The config types, legality rules and table resolution are pure Python and import eagerly;
everything that needs jax (the kernel itself) loads on first use, so the service can use the
rules without jax.
"""

from __future__ import annotations

import importlib
from typing import Any

from kernel.config import ConfigError, FlashConfig
from kernel.problem import Problem, ProblemError
from kernel.resolve import KERNEL_NAME, resolution_sources, use_table
from kernel.space import TARGETS, Target, Violation, default_config, get_target, violations
from kernel.table import LookupTable, TableEntry, TableError

KERNEL_VERSION = "1"

# Names loaded on first use, and the module that defines each: they need jax, or (the kernel
# registry, pure Python) import this package's constants.
_LAZY = {
    "flash_attention": "kernel.flash",
    "search_space": "kernel.depths",
    "supported_pipeline_depths": "kernel.depths",
    "TunableKernel": "kernel.registry",
    "get_kernel": "kernel.registry",
    "kernel_names": "kernel.registry",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kernel' has no attribute {name!r}")


__all__ = [
    "KERNEL_NAME", "KERNEL_VERSION", "TARGETS", "ConfigError", "FlashConfig", "Problem",
    "LookupTable", "ProblemError", "TableEntry", "TableError", "Target", "Violation",
    "default_config", "get_target", "resolution_sources", "use_table", "violations",
    *_LAZY,
]
