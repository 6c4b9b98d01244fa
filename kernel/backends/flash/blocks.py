"""Which (query block, key block) pairs the flash kernels load and compute: one definition,
used by the Pallas kernels on traced grid indices and by :func:`block_counts` on Python ints.

Pure Python: each function takes its arithmetic (``min``, ``max``, floor division of
non-negative ints) as ``ops``, Python's by default; the kernels pass jax's.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from kernel.backends.flash.config import FlashConfig
from kernel.problem import Problem

PYTHON_OPS = SimpleNamespace(minimum=min, maximum=max, div=operator.floordiv)


@dataclass(frozen=True)
class Reach:
    """Keys visible around query i: ``i - left <= j <= i + right``. Causal is ``right = 0``
    (top-left) or ``kv_len - q_len`` (bottom-right: both sides shift by the query offset, and
    either may be negative); a side at least as long as the sequence masks nothing."""

    left: int
    right: int
    q_len: int
    kv_len: int

    @classmethod
    def of(cls, problem: Problem) -> Reach:
        unbounded = problem.q_len + problem.kv_len  # past every key, whatever the offset
        left, right = problem.window or (unbounded, unbounded)
        offset = problem.query_offset
        return cls(left - offset, (0 if problem.causal else right) + offset, problem.q_len,
                   problem.kv_len)

    @property
    def masks(self) -> bool:
        """Whether some query misses some key (else no block is skipped, no element masked)."""
        return self.masks_left or self.masks_right

    @property
    def masks_left(self) -> bool:
        """Whether some query misses a key before it (a window's left side)."""
        return self.left < self.q_len

    @property
    def masks_right(self) -> bool:
        """Whether some query misses a key after it (causal, or a window's right side)."""
        return self.right < self.kv_len

    def sees(self, q0: Any, rows: int, k0: Any, cols: int) -> Any:
        """Whether some query of ``rows`` from ``q0`` sees some key of ``cols`` from ``k0``:
        the kernels compute a block pair only then (``&``: Python or traced bools)."""
        return (k0 <= q0 + rows - 1 + self.right) & (k0 + cols - 1 >= q0 - self.left)

    def kv_blocks(self, q0: Any, rows: int, block: int, count: int,
                  ops: Any = PYTHON_OPS) -> tuple[Any, Any]:
        """``(first, n)``: the run of the ``count`` key blocks of ``block`` keys that queries
        ``q0 .. q0 + rows - 1`` see, at least one (clamped into range: a kernel's pipeline
        needs a step; ``sees`` then skips its compute). All of them, statically, when
        nothing is masked."""
        if not self.masks:
            return 0, count
        first = ops.minimum(ops.div(ops.maximum(q0 - self.left, 0), block), count - 1)
        last = ops.div(q0 + rows - 1 + self.right, block)
        last = ops.maximum(ops.minimum(last, count - 1), first)
        return first, last - first + 1

    def transposed(self) -> Reach:
        """The same pattern seen from the keys: key j is seen by queries j - right .. j + left."""
        return Reach(self.right, self.left, self.kv_len, self.q_len)


def _pairs(reach: Reach, rows: int, cols: int, sub: int) -> tuple[int, int]:
    """(loaded, computed) block counts of one kernel instance: per block of ``rows`` queries,
    the run of ``cols``-key blocks it loads, each computed in sub-blocks of ``sub`` keys."""
    loaded = computed = 0
    for q0 in range(0, reach.q_len, rows):
        first, n = reach.kv_blocks(q0, rows, cols, reach.kv_len // cols)
        loaded += n
        computed += sum(bool(reach.sees(q0, rows, k0, sub))
                        for k0 in range(first * cols, (first + n) * cols, sub))
    return loaded, computed


def block_counts(problem: Problem, config: FlashConfig) -> dict[str, dict[str, int]]:
    """Blocks each kernel loads and computes, over all batches and query heads: ``fwd`` (key
    blocks of ``block_kv`` loaded, compute sub-blocks of ``block_kv_compute``), and for
    ``fwd_bwd`` ``dq`` (unless ``fused_bwd``: dK/dV computes dQ) and ``dkv`` (query blocks
    loaded and computed per key block)."""
    reach, heads = Reach.of(problem), problem.batch * problem.q_heads
    kernels = {"fwd": _pairs(reach, config.block_q, config.block_kv, config.block_kv_compute)}
    if problem.mode == "fwd_bwd" and not config.fused_bwd:
        kernels["dq"] = _pairs(reach, config.block_q_dq, config.block_kv_dq, config.block_kv_dq)
    if problem.mode == "fwd_bwd":
        kernels["dkv"] = _pairs(reach.transposed(), config.block_kv_dkv, config.block_q_dkv,
                                config.block_q_dkv)
    return {name: {"loaded": heads * loaded, "computed": heads * computed}
            for name, (loaded, computed) in kernels.items()}
