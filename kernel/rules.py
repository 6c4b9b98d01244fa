"""What every backend's legality rules are made of: violations, and the TPU tiling helpers.

Pure Python (no jax): the service checks a stored config with the same rules the tuner uses.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

from kernel.problem import Problem
from kernel.targets import MiB, Target

LANES = 128  # TPU vector registers are (8 sublanes x 128 lanes); VMEM tiles pad to them.
SUBLANES = 8
MAX_BLOCK = 4096  # larger tiles never fit the scoped VMEM of any current TPU generation
MAX_COMPUTE_BLOCK = 1024  # the f32 logits of a compute block live in VMEM/vregs


@dataclass(frozen=True)
class Violation:
    """One broken legality rule: ``rule`` is a stable name, ``message`` says how to fix it."""

    rule: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


def block_values(dim: int) -> list[int]:
    """Legal TPU tile sizes along a sequence axis of length ``dim``.

    Multiples of 128 (powers of two times 128, the lane width, so the logits tile fills whole
    vector registers) that divide ``dim``, plus ``dim`` itself (a full-axis block is always a
    legal Mosaic block shape), capped at ``MAX_BLOCK``. Empty when ``dim`` is longer than
    ``MAX_BLOCK`` and not a multiple of 128.
    """
    values = {dim} if dim <= MAX_BLOCK else set()
    size = LANES
    while size <= min(dim, MAX_BLOCK):
        if dim % size == 0:
            values.add(size)
        size *= 2
    return sorted(values)


def sequence_violations(length: int, name: str, largest: int = MAX_BLOCK) -> list[Violation]:
    """``seq_len``: a sequence axis no TPU block of at most ``largest`` can tile, with the
    fix."""
    if any(block <= largest for block in block_values(length)):
        return []
    return [Violation("seq_len", f"{name}={length} admits no legal block: a sequence longer "
                      f"than {largest} must be a multiple of {LANES}; pad it to "
                      f"{-(-length // LANES) * LANES} and mask the padding")]


def key_lane_violations(kv_len: int) -> list[Violation]:
    """``kv_len``: a key axis that is not a multiple of 128, for a kernel whose key blocks
    must fill whole lanes (upstream's TPU kernels)."""
    if kv_len % LANES == 0:
        return []
    return [Violation("kv_len", f"kv_len={kv_len} is not a multiple of {LANES}: the kernel's "
                      "key blocks must be; pad the keys or use the flash kernel")]


def block_violations(field: str, block: int, dim: int, dim_name: str) -> list[Violation]:
    """``block_max``, ``block_divides`` and ``block_tiling`` (a multiple of 128 or the whole
    axis: the TPU (8, 128) tiling) for one sequence-axis block of a TPU kernel."""
    if block > dim:
        return [Violation("block_max", f"{field}={block} is larger than {dim_name}={dim}; "
                          f"use at most {dim}")]
    out = []
    if dim % block:
        out.append(Violation("block_divides", f"{field}={block} does not divide "
                             f"{dim_name}={dim}; pick one of {block_values(dim)}"))
    if block % LANES and block != dim:
        out.append(Violation("block_tiling", f"{field}={block} is neither a multiple of "
                             f"{LANES} nor the whole {dim_name}={dim} (TPU (8,128) tiling)"))
    return out


# The block fields of a splash kernel (JAX's and tokamax's name them alike): the forward's and
# dK/dV's sequence-axis blocks as ``(field, axis)``, and ``(compute, block)``: the kernel loops
# block // compute times over the block's keys.
SPLASH_FWD_AXES = (("block_q", "q_len"), ("block_kv", "kv_len"), ("block_kv_compute", "kv_len"))
SPLASH_DKV_AXES = (("block_q_dkv", "q_len"), ("block_kv_dkv", "kv_len"),
                   ("block_kv_dkv_compute", "kv_len"))
SPLASH_COMPUTE_OF = (("block_kv_compute", "block_kv"),
                     ("block_kv_dkv_compute", "block_kv_dkv"))


def splash_block_violations(problem: Problem, config: object, axes: tuple[tuple[str, str], ...],
                            compute_of: tuple[tuple[str, str], ...]) -> list[Violation]:
    """The block rules of a splash kernel (JAX's or tokamax's) for ``config``: each
    ``(field, axis)`` block in ``axes`` tiles its sequence axis (:func:`block_violations`),
    each ``(compute, block)`` of ``compute_of`` divides (``compute_divides_block``: the kernel
    loops over the block's keys), and key blocks fill whole lanes (``block_lanes``)."""
    out = []
    for field, axis in axes:
        out += block_violations(field, getattr(config, field), getattr(problem, axis), axis)
    for compute, block in compute_of:
        small, large = getattr(config, compute), getattr(config, block)
        if large % small:
            out.append(Violation("compute_divides_block", f"{compute}={small} must divide "
                                 f"{block}={large}"))
    for field, axis in axes:
        value = getattr(config, field)
        if axis == "kv_len" and value % LANES:
            out.append(Violation("block_lanes", f"{field}={value} must be a multiple of "
                                 f"{LANES} (splash's key blocks fill whole lanes)"))
    return out


def tile_bytes(rows: int, cols: int, itemsize: int) -> int:
    """VMEM bytes of a (rows, cols) tile, padded to whole (8 or 16, 128) tiles."""
    sublanes = SUBLANES * (4 // itemsize)  # bf16 packs two rows per sublane
    rows_padded = -(-rows // sublanes) * sublanes
    cols_padded = -(-cols // LANES) * LANES
    return rows_padded * cols_padded * itemsize


REGISTER_FILE = 256 * 1024  # a TPU core's vector registers, counted once in Mosaic's scratch


@dataclass(frozen=True)
class UnrolledScratch:
    """Mosaic's internal VMEM scratch for a compute loop unrolled over (rows, cols) f32 logits
    tiles (f32 temporaries that do not fit the vector registers): ``base`` tiles for the first
    ``base_steps`` steps, ``per_step`` more per unrolled step beyond them (counting at most
    ``max_steps`` steps), plus the register file once. Each kernel calibrates its own on
    deviceless compiles."""

    base: float
    per_step: float
    max_steps: int | None = None
    base_steps: int = 2

    def bytes(self, rows: int, cols: int, steps: int, copies: int = 1) -> int:
        """The scratch of ``steps`` unrolled tiles, the whole body repeated ``copies`` times."""
        live = steps if self.max_steps is None else min(steps, self.max_steps)
        tiles = self.base + self.per_step * max(0, live - self.base_steps)
        return int(copies * tiles * tile_bytes(rows, cols, 4)) + REGISTER_FILE


def largest_at_most(values: list[int], cap: int) -> int:
    """The largest of ``values`` not above ``cap``, else the smallest."""
    fitting = [v for v in values if v <= cap]
    return max(fitting) if fitting else min(values)


def vmem_limit_violations(kernel_needs: Mapping[str, int], target: Target) -> list[Violation]:
    """``vmem``: each kernel (name -> estimated VMEM bytes) over the target's scoped VMEM limit
    (none without one)."""
    limit = target.scoped_vmem_bytes
    if limit is None:
        return []
    return [Violation("vmem", f"the {name} kernel needs about {need / MiB:.1f} MiB of VMEM, over "
                      f"the {limit / MiB:.0f} MiB scoped limit of {target.name}; use smaller "
                      "blocks") for name, need in kernel_needs.items() if need > limit]


def x64_enabled() -> bool:
    """Whether ``jax_enable_x64`` is on for the current call: the global flag or a
    ``jax.enable_x64`` context. False while jax is not loaded (nothing can trace then)."""
    jax = sys.modules.get("jax")
    return jax is not None and bool(jax.config.jax_enable_x64)


def x64_violations() -> list[Violation]:
    """``x64``, while ``jax_enable_x64`` is on (:func:`x64_enabled`): for an upstream kernel
    whose index arithmetic mixes int32 and int64 then (a ``TypeError`` from inside it)."""
    if not x64_enabled():
        return []
    return [Violation("x64", "upstream's kernel does not trace under jax_enable_x64 (its index "
                      "arithmetic mixes int32 and int64); use the flash kernel, or disable x64 "
                      "for this call (with jax.enable_x64(False): ...)")]


# The attention features beyond causal masking a problem may use (kernel.problem's window,
# softcap, segmented and bottom_right), as rule names, with what each is called in a message.
FEATURES = {"window": "a sliding window", "softcap": "logit soft-capping",
            "segment_ids": "segment ids (packed sequences)",
            "bottom_right": "bottom-right alignment (query i at position i + kv_len - q_len)"}
# The kernels that run every feature, named as the fix when one is refused.
ALL_FEATURE_KERNELS = "splash (TPU, interpreted elsewhere) or xla (everywhere)"


def problem_features(problem: Problem) -> list[str]:
    """The :data:`FEATURES` ``problem`` uses."""
    used = {"window": problem.window is not None, "softcap": problem.softcap is not None,
            "segment_ids": problem.segmented, "bottom_right": problem.bottom_right}
    return [feature for feature in FEATURES if used[feature]]


def feature_violations(problem: Problem, kernel: str,
                       supported: frozenset[str] = frozenset()) -> list[Violation]:
    """One violation per feature ``problem`` uses that kernel ``kernel`` does not run (only
    ``supported`` run), named by the feature and naming the kernels that run it."""
    return [Violation(feature, f"kernel {kernel!r} does not implement {FEATURES[feature]}; "
                      f"use {ALL_FEATURE_KERNELS}")
            for feature in problem_features(problem) if feature not in supported]
