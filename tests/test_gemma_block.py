"""Issue 48's user path: the Gemma-2-style block of docs/models.md (alternating local and
global layers, a sliding window, a logit soft cap, packed sequences) trains a step on a CPU
through ``kernel.flash_attention``; its shapes tune, publish, export, and resolve at trace time
from the exported table and from the service, in fresh processes, each named by
``resolution_sources()``. The page's snippets run as written, scaled down by their arguments.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autotune
import kernel
from conftest import run_cli, running_server

MODELS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "models.md"
SCALE = dict(window=64, heads=2, kv_heads=1)  # a 64-key window over 256 tokens, GQA 2/1
D, HD, SEQ = 128, 128, 256


def _snippet() -> str:
    """The Python block of docs/models.md that defines the Gemma-2 block."""
    [block] = [b for b in re.findall(r"```python\n(.*?)```", MODELS_PAGE.read_text(), re.S)
               if "def gemma2_layer" in b]
    return block


def _block(attention_module) -> types.SimpleNamespace:
    """The page's definitions, with ``kernel`` bound to ``attention_module``."""
    namespace: dict = {}
    exec(compile(_snippet(), str(MODELS_PAGE), "exec"), namespace)
    namespace["kernel"] = attention_module
    return types.SimpleNamespace(**namespace)


def _reference_kernel() -> types.SimpleNamespace:
    """``flash_attention``'s signature over ``reference_attention`` (plain jnp)."""
    def flash_attention(q, k, v, *, causal, logits_soft_cap, window, segment_ids):
        return kernel.reference_attention(q, k, v, *segment_ids, causal=causal,
                                          sm_scale=q.shape[-1] ** -0.5, window=window,
                                          softcap=logits_soft_cap)
    return types.SimpleNamespace(flash_attention=flash_attention)


def _abstract(dtype=jnp.float32):
    spec = jax.ShapeDtypeStruct
    h, kv = SCALE["heads"], SCALE["kv_heads"]
    layer = {"q": spec((D, h * HD), dtype), "k": spec((D, kv * HD), dtype),
             "v": spec((D, kv * HD), dtype), "o": spec((h * HD, D), dtype)}
    return [layer, layer], spec((1, SEQ, D), dtype), spec((1, SEQ), jnp.int32)


def _arrays(block):
    layers, x, _ = _abstract()
    keys = iter(jax.random.split(jax.random.key(0), 9))
    draw = lambda s: jax.random.normal(next(keys), s.shape, s.dtype) * 0.2  # noqa: E731
    return jax.tree.map(draw, layers), draw(x), block.packed_ids(1, SEQ)


# Run in a fresh process: the page's block trains a step under the environment's sources
# (AUTOTUNE_TABLE or AUTOTUNE_URL) and prints how each key resolved, as JSON.
FRESH = """
import json, sys, types, jax, jax.numpy as jnp, kernel
sys.path.insert(0, sys.argv[1])
import test_gemma_block as t
block = t._block(kernel)
layers, x, ids = t._arrays(block)
jax.block_until_ready(block.train_step(layers, x, ids, **t.SCALE))
print(json.dumps({k[2].label(): v for k, v in kernel.resolution_sources().items()}))
"""


def _fresh_sources(env: dict[str, str]) -> dict[str, str]:
    run = subprocess.run([sys.executable, "-c", FRESH, str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=600,
                         env={**{k: v for k, v in os.environ.items()
                                 if not k.startswith("AUTOTUNE_")}, **env})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_models_page_block_trains_a_step_as_the_float64_reference_does():
    """One step through ``kernel.flash_attention`` moves the weights as the same step through
    the reference does: a kernel that ignored the window, the cap or the ids would not."""
    block = _block(kernel)
    layers, x, ids = _arrays(block)
    stepped = block.train_step(layers, x, ids, **SCALE)
    with jax.enable_x64(True):
        reference = _block(_reference_kernel())
        as64 = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
        want = reference.train_step(jax.tree.map(as64, layers), as64(x), ids, **SCALE)
        for got, expected, before in zip(jax.tree.leaves(stepped), jax.tree.leaves(want),
                                         jax.tree.leaves(layers), strict=True):
            moved = np.asarray(expected) - np.asarray(before)
            assert np.abs(moved).max() > 0
            np.testing.assert_allclose(np.asarray(got) - np.asarray(before), moved,
                                       atol=2e-3 * np.abs(moved).max())


@pytest.mark.timeout(900)
def test_the_models_page_block_tunes_exports_and_resolves_from_table_and_service(tmp_path):
    db = f"sqlite:///{tmp_path / 'tune.db'}"
    block = _block(kernel)
    table = autotune.tune_model(functools.partial(block.train_step, **SCALE), *_abstract(),
                                db=db, trials=1, kernels="flash")
    tuned = {choice.problem.label() for choice in table.choices}
    assert tuned == {
        f"b1 h2/1 q{SEQ} kv{SEQ} d{HD} float32 causal{window} softcap50 segmented fwd_bwd"
        for window in (" window63,0", "")}, tuned
    exported = tmp_path / "table.json"
    done = run_cli("export", "--device-kind", "cpu", "-o", str(exported), "--db", db)
    assert done.returncode == 0, done.stderr

    from_table = _fresh_sources({"AUTOTUNE_TABLE": str(exported)})
    assert set(from_table) == tuned, from_table
    assert all(how.startswith("table, exact") and how.endswith(
        "kernel: chosen (exact choice in pinned table)") for how in from_table.values()), from_table

    with running_server(db, tmp_path) as server:
        from_service = _fresh_sources({"AUTOTUNE_URL": server.url})
    assert set(from_service) == tuned
    assert all(how.startswith("service") and how.endswith(
        "kernel: chosen (exact choice from service)")
        for how in from_service.values()), from_service
