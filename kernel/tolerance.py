"""Error bounds per dtype, shared by the tuner's correctness gate and the kernel tests, and the
float64 truth errors are measured against.

An error is the largest absolute difference over an output (the attention output, or one of
dq, dk, dv), relative to that output's largest magnitude in the reference. The bounds hold for
every registered kernel on normal inputs at the default scale, with margin over what the worst
of them measures (``bench/numerics.py``), so a config that is faster but less accurate than the
kernels' own precision fails the gate instead of winning.

Pure Python at import (numpy loads in :func:`float64_attention`); imports nothing from kernel.
"""

from __future__ import annotations

from typing import Any

# f32: on a CPU every kernel stays within 1e-5 of XLA, but on a TPU XLA's reference runs its f32
# matmuls at default precision (one bf16 pass, about 1e-3 off), so the bound leaves room for
# that rather than failing every config there. bf16: inputs and outputs rounded to 8 mantissa
# bits (the kernels measure up to 7e-3 at extreme logits, bench/numerics.py).
MAX_RELATIVE_ERROR: dict[str, float] = {"float32": 2e-3, "bfloat16": 2e-2}
# f32 on a TPU: every kernel's f32 matmuls, XLA's attention's too, run at the TPU's default
# precision (bf16 passes). Against an f32 reference at "highest" precision a TPU v5e measured up
# to 6.1e-3 (dq, 2048 tokens) for every kernel, XLA's own included
# (bench/results/tpu-v5e-2026-12-05/tier.json); the f32 bound there is this.
TPU_FLOAT32_RELATIVE_ERROR = 1e-2


def max_relative_error(dtype: str, platform: str = "cpu") -> float:
    """The bound for outputs of ``dtype`` computed on ``platform`` (a JAX platform name)."""
    if dtype == "float32" and platform == "tpu":
        return TPU_FLOAT32_RELATIVE_ERROR
    return MAX_RELATIVE_ERROR[dtype]


def relative_error(got: Any, want: Any) -> float:
    """Largest absolute error of ``got`` against ``want``, relative to ``want``'s largest
    magnitude; ``inf`` when ``got`` holds a NaN or an infinity."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


def float64_attention(q: Any, k: Any, v: Any, d_out: Any, *, causal: bool,
                      sm_scale: float) -> tuple[Any, Any, Any, Any]:
    """Attention and its gradients in float64 (numpy): ``(out, dq, dk, dv)`` for the cotangent
    ``d_out``. Layout ``[batch, heads, seq, head_dim]``; K/V may have fewer heads (grouped
    query attention, gradients summed over each group); ``causal`` is top-left aligned."""
    import numpy as np

    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    group = q.shape[1] // k.shape[1]
    keys, values = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    logits = np.einsum("bhqd,bhkd->bhqk", q, keys) * sm_scale
    if causal:
        logits = np.where(np.tri(*logits.shape[-2:], dtype=bool), logits, -np.inf)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ values
    dp = np.einsum("bhqd,bhkd->bhqk", d_out, values)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    dq = ds @ keys * sm_scale
    dk = np.einsum("bhqk,bhqd->bhkd", ds, q) * sm_scale
    dv = np.einsum("bhqk,bhqd->bhkd", p, d_out)
    per_group = (k.shape[0], k.shape[1], group, *k.shape[2:])
    return out, dq, dk.reshape(per_group).sum(axis=2), dv.reshape(per_group).sum(axis=2)
