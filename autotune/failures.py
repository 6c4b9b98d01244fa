"""Failure classes a candidate config can end in, and how compiler errors map to them."""

from __future__ import annotations

import re
from enum import StrEnum


class Status(StrEnum):
    """Outcome of compiling or measuring one config."""

    OK = "ok"
    ILLEGAL = "illegal"
    COMPILE_ERROR = "compile_error"
    VMEM_OOM = "vmem_oom"
    RUNTIME_ERROR = "runtime_error"
    WRONG_RESULT = "wrong_result"
    TIMEOUT = "timeout"


# What Mosaic / XLA:TPU say when a kernel's VMEM does not fit, e.g.
# "RESOURCE_EXHAUSTED: ... CompileTimeScopedVmemOom ... Scoped allocation with size 73.39M"
# or "Ran out of memory in memory space vmem. Used 275.35M of 128.00M vmem".
_VMEM_OOM = re.compile(
    r"ScopedVmemOom|memory space vmem|vmem.*(exhaust|out of memory|exceed)"
    r"|(exhaust|out of memory|exceed).*vmem", re.IGNORECASE | re.DOTALL)


def classify_compile_error(message: str) -> Status:
    """``vmem_oom`` when the compiler ran out of VMEM, else ``compile_error``."""
    return Status.VMEM_OOM if _VMEM_OOM.search(message) else Status.COMPILE_ERROR

