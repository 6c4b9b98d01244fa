"""Failure classes a candidate config can end in, and how compiler errors map to them."""

from __future__ import annotations

import re
from enum import StrEnum

from kernel.errors import AutotuneError, ConfigError


class Status(StrEnum):
    """Outcome of compiling or measuring one config."""

    OK = "ok"
    ILLEGAL = "illegal"
    COMPILE_ERROR = "compile_error"
    VMEM_OOM = "vmem_oom"
    RUNTIME_ERROR = "runtime_error"
    WRONG_RESULT = "wrong_result"
    TIMEOUT = "timeout"
    # After it, the default config's output on the gate's inputs changed bit for bit: the chip
    # was left corrupt (a copy in flight at kernel exit, pallas-facts §10). Never published.
    CORRUPTS_STATE = "corrupts_state"


class ChipStateCorrupted(AutotuneError):
    """The device's state is corrupt (:attr:`Status.CORRUPTS_STATE`): nothing more can be
    measured in this process. ``what`` says what showed it; the message adds what to do."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"{what}; run the same command again to go on in a fresh process")


class ProblemTooLarge(ConfigError):
    """Measuring a problem needs more memory than its device has: no config of it can be
    measured there. The message, one line, names the sizes and the fix."""


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the runtime saying the device's memory ran out
    (``RESOURCE_EXHAUSTED`` on allocating an array or running a program)."""
    return isinstance(error, RuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


# What Mosaic / XLA:TPU say when a kernel's VMEM does not fit, e.g.
# "RESOURCE_EXHAUSTED: ... CompileTimeScopedVmemOom ... Scoped allocation with size 73.39M"
# or "Ran out of memory in memory space vmem. Used 275.35M of 128.00M vmem".
_VMEM_OOM = re.compile(
    r"ScopedVmemOom|memory space vmem|vmem.*(exhaust|out of memory|exceed)"
    r"|(exhaust|out of memory|exceed).*vmem", re.IGNORECASE | re.DOTALL)


def classify_compile_error(message: str) -> Status:
    """``vmem_oom`` when the compiler ran out of VMEM, else ``compile_error``."""
    return Status.VMEM_OOM if _VMEM_OOM.search(message) else Status.COMPILE_ERROR


# "... allocating on stack for %splash_mha_fwd_no_residuals.1 = ... Scoped allocation with size
# 16.54M and limit 16.00M ...": the kernel (XLA instruction) and the bytes it asked for.
_SCOPED_ALLOCATION = re.compile(r"allocating on stack for %(\S+) = .*?Scoped allocation with "
                                r"size ([\d.]+)([KMG])", re.DOTALL)
_UNIT_BYTES = {"K": 1024, "M": 1024**2, "G": 1024**3}


# "Ran out of memory in memory space vmem. Used 19.35M of 16.00M vmem": the whole program's
# VMEM against the chip's (v4 reports this where a later chip reports a scoped allocation).
_PHYSICAL_USE = re.compile(r"memory space vmem\. Used ([\d.]+)([KMG]) of")


def physical_vmem_use(message: str) -> int | None:
    """The VMEM bytes a program needed, from an error saying it outgrew the chip's VMEM;
    None for any other message."""
    found = _PHYSICAL_USE.search(message)
    return None if found is None else round(float(found[1]) * _UNIT_BYTES[found[2]])


def scoped_vmem_allocation(message: str) -> tuple[str, int] | None:
    """The kernel and the scoped VMEM bytes it needed, from a ``CompileTimeScopedVmemOom``
    compiler error; None for any other message."""
    found = _SCOPED_ALLOCATION.search(message)
    if not found:
        return None
    kernel, size, unit = found.groups()
    return kernel, round(float(size) * _UNIT_BYTES[unit])
