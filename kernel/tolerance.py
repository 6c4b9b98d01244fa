"""Error bounds per dtype, shared by the tuner's correctness gate and the kernel tests, and the
float64 truth errors are measured against.

An error is the largest absolute difference over an output (the attention output, or one of
dq, dk, dv), relative to that output's largest magnitude in the reference. The bounds hold for
every registered kernel on normal inputs at the default scale, with margin over what the worst
of them measures (``bench/kernels/numerics.py``), so a config that is faster but less accurate
than the kernels' own precision fails the gate instead of winning.

Pure Python at import (numpy and JAX load where used); imports nothing from kernel.
"""

from __future__ import annotations

import functools
from typing import Any

# The tuner's gate checks against an f32 reference at "highest" precision
# (kernel.reference.blockwise_reference). f32: on a CPU every kernel stays within 1e-5 of it
# (the bound is the one set when the reference ran at default precision). bf16: inputs and outputs
# rounded to 8 mantissa bits (the kernels measure up to 7e-3 at extreme logits,
# bench/kernels/numerics.py).
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
    magnitude; ``inf`` when ``got`` holds a NaN or an infinity. Two JAX arrays are reduced on
    their device, in float32 or wider, and three scalars come back: moving four model-sized
    outputs to the host and reducing them there took seconds a config. Anything else is
    reduced in numpy float64."""
    import numpy as np

    if _is_jax_array(got) and _is_jax_array(want):
        finite, worst, scale = _device_error_terms()(got, want)
    else:
        finite, worst, scale = _error_terms(np, np.asarray(got, np.float64),
                                            np.asarray(want, np.float64))
    return float(worst) / (float(scale) + 1e-30) if bool(finite) else float("inf")


def _error_terms(xp: Any, got: Any, want: Any) -> tuple[Any, Any, Any]:
    """Whether ``got`` is finite, its largest absolute error, ``want``'s largest magnitude;
    with the array module ``xp`` (numpy or jax.numpy)."""
    return xp.all(xp.isfinite(got)), xp.max(xp.abs(got - want)), xp.max(xp.abs(want))


def _is_jax_array(x: Any) -> bool:
    import sys

    jax = sys.modules.get("jax")  # a caller holding JAX arrays has imported jax
    return jax is not None and isinstance(x, jax.Array)


@functools.cache
def _device_error_terms() -> Any:
    """:func:`_error_terms` jitted, in the wider of the arrays' dtype and float32."""
    import jax
    import jax.numpy as jnp

    def terms(got: Any, want: Any) -> tuple[Any, Any, Any]:
        wide = jnp.promote_types(jnp.promote_types(got.dtype, want.dtype), jnp.float32)
        return _error_terms(jnp, got.astype(wide), want.astype(wide))

    return jax.jit(terms)


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
