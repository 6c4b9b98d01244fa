"""Attention kernels whose tiles come from a tuned config, resolved at trace time.

Layers, each importing only those above it in this list: core types (``errors``, ``problem``,
``config``, ``targets``, ``rules``, ``sharded``); the backend contract (``contract``); the backends
(``backends/``); the registry (``registry``); lookup tables (``table``), shapes files
(``shapesfile``) and scoped tables (``table_scope``); resolution (``resolve``, then
``scoped_resolver`` inside ``kernel.tables`` blocks); misses (``misses``) and capture
(``capture``); context parallelism's plan (``context_parallel``); the public
``flash_attention`` and ``context_parallel_attention`` (``attention``) and
``ragged_paged_attention`` (``paged``). Importing this package loads no jax (the backends
load it when they run), so the service and storage use the rules freely.
Where no accelerator is attached, it keeps JAX off libtpu's TPU backend (``kernel.platforms``).
"""

from __future__ import annotations

from kernel.attention import context_parallel_attention, dot_product_attention, flash_attention
from kernel.backends.flash.config import FlashConfig
from kernel.capture import Capture, capture
from kernel.context_parallel import load_balanced_order
from kernel.contract import TunableKernel, reference_attention
from kernel.errors import (
    AutotuneError,
    ConfigError,
    ProblemError,
    ShardingError,
    StrictMiss,
    TableError,
)
from kernel.misses import Borrowed, Miss, borrowed, untuned
from kernel.paged import ragged_paged_attention
from kernel.platforms import skip_absent_tpu
from kernel.problem import Problem
from kernel.registry import DEFAULT_KERNEL, get_kernel, kernel_names
from kernel.resolve import use_table
from kernel.rules import Violation
from kernel.table_scope import tables
from kernel.scoped_resolver import resolution_sources
from kernel.serving import ServingProblem
from kernel.table import LookupTable, TableEntry
from kernel.targets import TARGETS, Target, device_target, get_target

__all__ = [
    "DEFAULT_KERNEL", "TARGETS", "AutotuneError", "Borrowed", "Capture", "ConfigError",
    "FlashConfig", "LookupTable", "Miss", "Problem", "ProblemError", "ServingProblem",
    "ShardingError", "StrictMiss", "TableEntry", "TableError",
    "Target", "TunableKernel", "Violation", "borrowed", "capture", "context_parallel_attention",
    "device_target", "dot_product_attention", "flash_attention", "get_kernel", "get_target",
    "kernel_names", "load_balanced_order", "ragged_paged_attention", "reference_attention",
    "resolution_sources", "tables", "untuned", "use_table",
]

skip_absent_tpu()  # before the caller's first JAX computation starts the backends
