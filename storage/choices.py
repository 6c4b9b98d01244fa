"""Kernel choices as stored: a ``kernel.table.KernelChoice`` with its device and provenance.

A choice names the kernel that won a problem on a device kind among the candidates tuned
there, its config, and every candidate's confirmed median and spread or failure class; its
provenance says, as ``within_noise``, whether the kernel kept (the platform's default, or
the one chosen before) was kept although another candidate measured faster by no more than the
noise (null: not recorded).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kernel import get_kernel
from kernel.table import KernelChoice, KernelTiming
from storage.results import (
    METHODS,
    TIMINGS,
    ResultError,
    check_text,
    default_platform,
    problem_columns,
    problem_from_columns,
)

# Provenance a stored choice keeps in columns (the rest of a table's provenance is dropped).
CHOICE_PROVENANCE = ("platform", "kernel_version", "method", "timing", "jax_version",
                     "jaxlib_version", "libtpu_version")
# Candidates a stored choice may hold, so that the wrapper's one request for a new shape (both
# modes' choices in one batch reply) stays under its cap (kernel.service.MAX_REPLY_BYTES,
# 64 KiB): a candidate of the longest name and failure text (64 characters of 4 UTF-8 bytes)
# takes about 820 bytes of a reply, so 32 of them keep two choices near 52 KiB.
MAX_CHOICE_CANDIDATES = 32
CHOICE_FLAGS = ("within_noise",)  # provenance kept as nullable boolean columns
CHOICE_RECORDS = ("step_confirmation",)  # provenance kept as nullable JSON objects
# Methods a choice is made by: a result's, or the whole model step's timing of the tables
# (autotune.step_choice), where that changed the isolated choice.
CHOICE_METHODS: tuple[str, ...] = (*METHODS, "model_step")
MAX_RECORD_CHARS = 4096  # a step confirmation's JSON: a few variants' times (about 100 each)


def check_choice(device_kind: str, choice: KernelChoice) -> None:
    """Raises ``ResultError`` naming what is wrong: a chosen kernel this build does not know,
    a config illegal for the problem, a candidate name or failure that is not plain text."""
    check_text("device_kind", device_kind)
    if not isinstance(choice.config, get_kernel(choice.kernel).config_type):
        raise ResultError(f"the config of chosen kernel {choice.kernel!r} must be one of its "
                          f"configs, got {choice.config!r}")
    broken = get_kernel(choice.kernel).stored_violations(choice.problem, choice.config)
    if broken:
        raise ResultError(f"config {choice.config.label()} of chosen kernel "
                          f"{choice.kernel!r} is illegal for {choice.problem.label()}: "
                          + "; ".join(map(str, broken)))
    if len(choice.candidates) > MAX_CHOICE_CANDIDATES:
        raise ResultError(f"a choice may compare at most {MAX_CHOICE_CANDIDATES} candidate "
                          f"kernels, got {len(choice.candidates)}; keep the measured ones")
    for name, timing in choice.candidates.items():
        check_text("kernel", name)
        if timing.failure is not None:
            check_text("failure", timing.failure)
    for name in CHOICE_PROVENANCE:
        check_text(name, choice.provenance.get(name), optional=True)
    for name, allowed in (("method", CHOICE_METHODS), ("timing", TIMINGS)):
        if choice.provenance.get(name) not in (None, *allowed):
            raise ResultError(f"{name} must be one of {', '.join(allowed)}, got "
                              f"{choice.provenance[name]!r}")
    for name in CHOICE_RECORDS:
        check_record(name, choice.provenance.get(name))
    for name in CHOICE_FLAGS:
        if not isinstance(choice.provenance.get(name, False), bool):
            raise ResultError(f"{name} must be true, false or absent, got "
                              f"{choice.provenance[name]!r}")


def check_record(name: str, value: Any) -> None:
    """Raises ``ResultError`` unless ``value`` is absent or a JSON object of at most
    ``MAX_RECORD_CHARS`` characters."""
    if value is None:
        return
    try:
        size = len(json.dumps(value, allow_nan=False)) if isinstance(value, dict) else None
    except (TypeError, ValueError):
        size = None
    if size is None or size > MAX_RECORD_CHARS:
        raise ResultError(f"{name} must be a JSON object of at most {MAX_RECORD_CHARS} "
                          f"characters, got {str(value)[:80]!r}")


def choice_columns(device_kind: str, choice: KernelChoice) -> dict[str, Any]:
    """The row of a checked choice (everything but the id and the timestamps)."""
    provenance = choice.provenance
    return {"device_kind": device_kind,
            "platform": provenance.get("platform") or default_platform(device_kind),
            **problem_columns(choice.problem), "kernel": choice.kernel,
            "kernel_version": provenance.get("kernel_version") or get_kernel(choice.kernel).version,
            "config": choice.config.to_dict(),
            "candidates": {name: t.to_dict() for name, t in choice.candidates.items()},
            **{name: provenance.get(name)
               for name in (*CHOICE_PROVENANCE[2:], *CHOICE_FLAGS, *CHOICE_RECORDS)}}


@dataclass(frozen=True)
class StoredChoice:
    """A stored kernel choice with its device kind and timestamps (UTC)."""

    device_kind: str
    choice: KernelChoice
    created_at: datetime
    updated_at: datetime

    def to_dict(self) -> dict[str, Any]:
        """The wire shape: the choice (problem, kernel, config, candidates, provenance), its
        device kind, every candidate's median (``times_ms``, null when it failed) and the
        timestamps."""
        return {"device_kind": self.device_kind, **self.choice.to_dict(),
                "times_ms": self.choice.times_ms(),
                "created_at": self.created_at.isoformat(),
                "updated_at": self.updated_at.isoformat()}


def stored_choice(get: Callable[[str], Any], utc: Callable[[datetime], datetime]) -> StoredChoice:
    """A stored choice from a row's column getter (``utc`` makes its timestamps aware)."""
    candidates = {name: KernelTiming.from_dict(raw, name)
                  for name, raw in get("candidates").items()}
    provenance = {name: get(name) for name in (*CHOICE_PROVENANCE, *CHOICE_FLAGS,
                                               *CHOICE_RECORDS) if get(name) is not None}
    choice = KernelChoice(
        problem=problem_from_columns(get), kernel=get("kernel"),
        config=get_kernel(get("kernel")).config_from_dict(get("config")),
        candidates=candidates, provenance=provenance)
    return StoredChoice(get("device_kind"), choice, utc(get("created_at")),
                        utc(get("updated_at")))
