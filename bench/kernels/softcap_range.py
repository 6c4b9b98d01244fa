"""The soft cap's float32 range on the attached device (issue 62 item 5).

``kernel.problem.SOFTCAP_RANGE`` admits caps from 1e-30 to 1e30: a cap float32 rounds to inf
or to 0 gives NaN outputs, and near float32's largest (3.4e38) xla's gradients are NaN. This
runs every kernel that takes a soft cap (``flash``, ``splash``, ``xla``, each where it runs)
forward and backward at both ends of the range and at caps the wrapper refuses, and prints
whether each output and gradient is finite. Expected: every admitted cap finite; past the
range, NaN somewhere. A CPU (interpret mode, bf16 and f32 alike): all finite at 1e-30 and
1e30; at 3.4e38 xla's gradients NaN, at 3.5e38 every kernel's, at 1e-40 flash's and xla's.

    python bench/kernels/softcap_range.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kernel import Problem, get_kernel  # noqa: E402
from kernel.contract import default_device  # noqa: E402
from kernel.problem import SOFTCAP_RANGE  # noqa: E402
from kernel.targets import device_target  # noqa: E402

PROBLEM = dict(batch=1, q_heads=2, kv_heads=2, q_len=256, kv_len=256, head_dim=128)
# Refused: float32's largest, inf and a subnormal (0 on a TPU) in float32.
PAST = (3.4028234663852886e38, 3.5e38, 1e-40)


def finite(fn, *arrays) -> str:
    """'finite' or 'NaN/inf' for fn's output and its gradient by q, k and v."""
    out, grads = jax.value_and_grad(lambda *a: fn(*a).astype(jnp.float32).sum(),
                                    argnums=(0, 1, 2))(*arrays)
    ok = bool(jnp.isfinite(out)) and all(bool(jnp.isfinite(g).all()) for g in grads)
    return "finite" if ok else "NaN/inf"


def main() -> None:
    device = default_device()
    target = device_target(device.platform, device.device_kind)
    print(f"device: {device.device_kind} ({device.platform})")
    for dtype in ("bfloat16", "float32"):
        keys = jax.random.split(jax.random.key(0), 3)
        shape = (1, 2, 256, 128)
        q, k, v = (jax.random.normal(key, shape, dtype) for key in keys)
        for cap in (*SOFTCAP_RANGE, *PAST):
            admitted = SOFTCAP_RANGE[0] <= cap <= SOFTCAP_RANGE[1]
            problem = Problem(**PROBLEM, dtype=dtype, softcap=50.0, mode="fwd_bwd")
            object.__setattr__(problem, "softcap", cap)  # past the range too: what it would do
            for name in ("flash", "splash", "xla"):
                backend = get_kernel(name)
                try:
                    backend.discover().check_runs(problem, target)
                except Exception as error:  # noqa: BLE001 - a kernel that cannot run here
                    print(f"{dtype} cap {cap:.8g} {name}: does not run here ({error})")
                    continue
                config = backend.default_config(problem, target)
                attend = backend.attention(problem, lambda _mode, c=config: c,
                                           problem.head_dim ** -0.5)
                said = "" if admitted else " (refused)"
                print(f"{dtype} cap {cap:.8g}{said} {name}: {finite(attend, q, k, v)}")


if __name__ == "__main__":
    main()
