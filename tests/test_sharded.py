"""Sharded steps on forced CPU devices: ``jax.shard_map`` (default ``check_vma=True``) and
``jax.jit`` over a mesh run the wrapper's kernels, match the unsharded result, and resolve
(and capture) the problem each device computes.

The device count is fixed when jax starts, so each case runs in a fresh Python process with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (this process keeps its one device;
XLA's CPU backend at -O0 there, see ``_run``),
as the first JAX computation there (the pipeline-depth probe runs inside the sharded trace).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = """
import json
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import kernel

def arrays(b, hq, hk, s, d, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(key, (b, h, s, d), dtype)
            for key, h in zip(keys, (hq, hk, hk))]

def largest_error(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))

def per_device_problems():
    return sorted({(p.batch, p.q_heads, p.kv_heads, p.q_len, p.mode)
                   for (_, _, p) in kernel.resolution_sources()})
"""


def _run(devices: int, body: str) -> Any:
    """Runs ``body`` (after SETUP) on ``devices`` forced CPU devices in a new process; returns
    the JSON object it prints last."""
    # -O0: XLA's CPU backend without LLVM's optimizations. These cases check what the sharded
    # programs compute, resolve and refuse, not how fast they run, and their compiles were most
    # of this file's time: at -O0 a compile is a fifth to a third shorter, a run of these small
    # problems a third to a half longer, the file 15% less CPU (issue 75 item 2). Not for the
    # whole suite: tests/test_bench_model_step.py's profile of a CPU step then no longer ranks
    # its matmuls among the ten slowest ops.
    flags = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if not k.startswith("AUTOTUNE_")}
    done = subprocess.run([sys.executable, "-c", SETUP + textwrap.dedent(body)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_shard_map_with_check_vma_runs_flash_per_device_as_unsharded() -> None:
    """Batch over 2 devices, grouped-query heads: forward and gradients match the unsharded
    call, and the resolved problem is each device's (batch 2 of 4). Before: the depth probe,
    the first call of the process, reported that no Pallas kernel lowers for TPU; after it,
    pallas_call refused its out_shape (no manual_axis_type)."""
    out = _run(2, """
        mesh = jax.make_mesh((2,), ("data",))
        q, k, v = arrays(4, 4, 2, 256, 64)
        attend = lambda q, k, v: kernel.flash_attention(q, k, v, causal=True)
        loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) ** 2)
        sharded = jax.shard_map(attend, mesh=mesh, in_specs=(P("data"),) * 3,
                                out_specs=P("data"))
        put = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, k, v)]
        got, want = jax.jit(sharded)(*put), jax.jit(attend)(q, k, v)
        grads = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(*put)
        wanted = jax.jit(jax.grad(loss(attend), argnums=(0, 1, 2)))(q, k, v)
        print(json.dumps({"out": largest_error(got, want),
                          "grads": max(map(largest_error, grads, wanted)),
                          "problems": per_device_problems()}))
    """)
    assert out["out"] < 1e-5 and out["grads"] < 1e-4
    assert [2, 4, 2, 256, "fwd"] in out["problems"]
    assert [2, 4, 2, 256, "fwd_bwd"] in out["problems"]


def test_dot_product_attention_in_shard_map_over_data_and_heads() -> None:
    """jax.nn's layout [batch, seq, heads, head_dim] on a 2 x 2 mesh, batch over "data" and
    heads over "model" (GQA: 4 query heads, 2 K/V heads): matches the unsharded call and
    resolves b1 h2/1. Before: the probe's error."""
    out = _run(4, """
        mesh = jax.make_mesh((2, 2), ("data", "model"))
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in arrays(2, 4, 2, 128, 64))
        attend = lambda q, k, v: kernel.dot_product_attention(q, k, v, is_causal=True)
        spec = P("data", None, "model")
        sharded = jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        put = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
        print(json.dumps({"out": largest_error(jax.jit(sharded)(*put), attend(q, k, v)),
                          "problems": per_device_problems()}))
    """)
    assert out["out"] < 1e-5
    assert out["problems"][0] == [1, 2, 1, 128, "fwd"]


def test_multi_query_kv_replicated_over_the_heads_axis_gets_summed_gradients() -> None:
    """One K/V head, unsharded over "model" while the 4 query heads are sharded over it: dK
    and dV sum what each device computed (psum over "model"), in shard_map and under plain
    jit. Before: the custom VJP's dK varied over "model", which k does not (ValueError)."""
    out = _run(4, """
        mesh = jax.make_mesh((2, 2), ("data", "model"))
        q, k, v = arrays(4, 4, 1, 128, 64)
        attend = lambda q, k, v: kernel.flash_attention(q, k, v, causal=True)
        loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) ** 2)
        q_spec, kv_spec = P("data", "model"), P("data")
        sharded = jax.shard_map(attend, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                                out_specs=q_spec)
        put = [jax.device_put(x, NamedSharding(mesh, spec))
               for x, spec in zip((q, k, v), (q_spec, kv_spec, kv_spec))]
        wanted = jax.jit(jax.grad(loss(attend), argnums=(0, 1, 2)))(q, k, v)
        errors = {name: max(map(largest_error, jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(
                      *put), wanted)) for name, f in (("shard_map", sharded), ("jit", attend))}
        print(json.dumps(errors))
    """)
    assert out["shard_map"] < 1e-4 and out["jit"] < 1e-4


def test_jit_over_an_explicit_mesh_runs_each_devices_problem() -> None:
    """Plain jax.jit with q, k, v sharded over batch and heads (jax.make_mesh's explicit
    axes): the wrapper runs per device under shard_map, so forward and gradients match and
    the resolved problem is b2 h2/1, not the global b4 h4/2; replicated over the mesh (under
    jax.set_mesh) it matches too. Before: the kernel's refs could not be indexed (TypeError:
    sharded ref), and the key would be global; replicated, the interpreted kernel's stores
    failed JAX's sharding check (ShardingTypeError: dynamic_update_slice operand sharding)."""
    out = _run(4, """
        mesh = jax.make_mesh((2, 2), ("data", "model"))
        q, k, v = arrays(4, 4, 2, 128, 64)
        attend = lambda q, k, v: kernel.flash_attention(q, k, v, causal=True)
        loss = lambda q, k, v: jnp.sum(attend(q, k, v) ** 2)
        put = [jax.device_put(x, NamedSharding(mesh, P("data", "model"))) for x in (q, k, v)]
        got = jax.jit(attend)(*put)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*put)
        sharded = {"data": got.sharding.spec[0], "model": got.sharding.spec[1]}
        problems = per_device_problems()
        wanted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        with jax.set_mesh(mesh):
            replicated = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(
                *(jax.device_put(x, P()) for x in (q, k, v)))
        print(json.dumps({"out": largest_error(got, attend(q, k, v)),
                          "grads": max(map(largest_error, grads, wanted)),
                          "replicated": max(map(largest_error, *map(jax.device_get, (
                              replicated, wanted)))),
                          "sharded": sharded, "problems": problems}))
    """)
    assert out["out"] < 1e-5 and out["grads"] < 1e-4 and out["replicated"] < 1e-4
    assert out["sharded"] == {"data": "data", "model": "model"}  # stays sharded as given
    assert out["problems"] == [[2, 2, 1, 128, "fwd"], [2, 2, 1, 128, "fwd_bwd"]]


def test_segment_ids_under_jit_over_a_mesh_follow_q_batch() -> None:
    """Packed sequences under plain jit, q, k, v sharded over batch and the (unsharded) ids
    resharded as q's batch: matches the unsharded call. Before: ValueError (a PartitionSpec
    outside a mesh context)."""
    out = _run(2, """
        mesh = jax.make_mesh((2,), ("data",))
        q, k, v = arrays(4, 2, 2, 128, 64)
        ids = jnp.concatenate([jnp.zeros((4, 48), jnp.int32), jnp.ones((4, 80), jnp.int32)], 1)
        attend = jax.jit(lambda q, k, v, ids: kernel.flash_attention(q, k, v, causal=True,
                                                                     segment_ids=(ids, ids)))
        put = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, k, v)]
        print(json.dumps({"out": largest_error(attend(*put, ids), attend(q, k, v, ids))}))
    """)
    assert out["out"] < 1e-5


def test_a_sharded_jit_lowers_for_tpu_with_the_per_device_kernel() -> None:
    """jax.export for TPU of a jit over 2 devices (no TPU needed): one Mosaic kernel, inside a
    shard_map; capture records the per-device problem. Before: TypeError (sharded ref)."""
    out = _run(2, """
        mesh = jax.make_mesh((2,), ("data",))
        arg = jax.ShapeDtypeStruct((4, 2, 256, 128), jnp.bfloat16,
                                   sharding=NamedSharding(mesh, P("data")))
        step = jax.jit(lambda q, k, v: kernel.flash_attention(q, k, v, causal=True))
        module = jax.export.export(step, platforms=["tpu"])(arg, arg, arg).mlir_module()
        with kernel.capture() as captured:
            step.lower(arg, arg, arg)
        print(json.dumps({"kernels": module.count("tpu_custom_call"),
                          "captured": [p.label() for p in captured]}))
    """)
    assert out["kernels"] == 1
    assert out["captured"] == ["b2 h2/2 q256 kv256 d128 bfloat16 causal fwd"]


def test_capture_records_the_per_device_problems_of_a_sharded_step() -> None:
    """What tune_model tunes (autotune.traced.captured_problems): a training step whose
    attention runs in shard_map over 4 devices (batch 8 -> 2), and the same step under jit
    with sharded abstract arguments. Before: the probe's error inside shard_map."""
    out = _run(4, """
        from autotune.traced import captured_problems
        mesh = jax.make_mesh((4,), ("data",))
        attend = lambda q, k, v: kernel.flash_attention(q, k, v, causal=True)
        sharded = jax.shard_map(attend, mesh=mesh, in_specs=(P("data"),) * 3,
                                out_specs=P("data"))
        step = lambda f: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)))
        arg = jax.ShapeDtypeStruct((8, 4, 256, 64), jnp.bfloat16,
                                   sharding=NamedSharding(mesh, P("data")))
        print(json.dumps({"shard_map": [p.label() for p in
                                        captured_problems(step(sharded), arg, arg, arg)],
                          "jit": [p.label() for p in
                                  captured_problems(step(attend), arg, arg, arg)]}))
    """)
    per_device = ["b2 h4/4 q256 kv256 d64 bfloat16 causal fwd_bwd"]
    assert out == {"shard_map": per_device, "jit": per_device}


def test_tune_model_tunes_the_per_device_problems_of_a_sharded_step(tmp_path: Path) -> None:
    """autotune.tune_model of a data + head parallel step (jit over sharded abstract
    arguments on a 2 x 2 mesh, GQA) tunes and tables b2 h2/1, each device's problem. Before:
    the probe's error."""
    out = _run(4, f"""
        import autotune
        mesh = jax.make_mesh((2, 2), ("data", "model"))
        spec = NamedSharding(mesh, P("data", "model"))
        step = jax.grad(lambda q, k, v: jnp.sum(kernel.flash_attention(q, k, v, causal=True)))
        args = [jax.ShapeDtypeStruct((4, h, 128, 64), jnp.float32, sharding=spec)
                for h in (4, 2, 2)]
        table = autotune.tune_model(step, *args, db="sqlite:///{tmp_path / 'autotune.db'}",
                                    trials=1, kernels="xla")
        print(json.dumps([c.problem.label() for c in table.choices]))
    """)
    assert out == ["b2 h2/1 q128 kv128 d64 float32 causal fwd_bwd"]


def test_upstream_kernels_give_way_inside_shard_map_with_check_vma() -> None:
    """A kernel choice of splash (whose pallas_call outputs name no varying axes) for the
    per-device problem: inside shard_map with check_vma=True the next candidate runs (flash),
    saying why in one warning, inside the kernel.tables block too; outside, splash. Before:
    ValueError (manual_axis_type must not be None); then no warning inside kernel.tables
    (issue 71 defect 3: the block's fallback was quieted)."""
    out = _run(2, """
        import logging
        warnings = []
        handler = logging.Handler()
        handler.emit = lambda record: warnings.append(record.getMessage())
        logging.getLogger("kernel.resolve").addHandler(handler)
        from kernel import get_kernel
        from kernel.table import KernelChoice, KernelTiming, LookupTable
        mesh = jax.make_mesh((2,), ("data",))
        q, k, v = arrays(4, 2, 2, 256, 64)
        local = kernel.Problem(2, 2, 2, 256, 256, 64, dtype="float32", causal=True)
        splash = get_kernel("splash")
        choice = KernelChoice(local, "splash", splash.default_config(local),
                              {"splash": KernelTiming(1.0, 0.1), "flash": KernelTiming(2.0, 0.1)})
        table = LookupTable("flash", "1", jax.devices()[0].device_kind, (), choices=(choice,))
        attend = lambda q, k, v: kernel.flash_attention(q, k, v, causal=True)
        sharded = jax.shard_map(attend, mesh=mesh, in_specs=(P("data"),) * 3,
                                out_specs=P("data"))
        put = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, k, v)]
        with kernel.tables(table):
            got = jax.jit(sharded)(*put)
            inside = sorted({name for (name, _, _) in kernel.resolution_sources()})
            unsharded = jax.jit(attend)(q[:2], k[:2], v[:2])
            both = sorted({name for (name, _, _) in kernel.resolution_sources()})
        print(json.dumps({"out": largest_error(jnp.asarray(jax.device_get(got)[:2]), unsharded),
                          "inside": inside,
                          "both": both,
                          "fallbacks": [w for w in warnings if "instead of the chosen" in w]}))
    """)
    assert out["out"] < 1e-5
    assert out["inside"] == ["flash"] and out["both"] == ["flash", "splash"]
    [fallback] = out["fallbacks"]  # once, though the forward and backward both picked
    assert "running flash for b2 h2/2" in fallback and "check_vma" in fallback


def test_a_sharded_head_dim_or_a_sequence_sharded_unlike_q_is_refused_naming_the_fix() -> None:
    """Under plain jit a sharded sequence runs (context parallelism, tests/
    test_context_parallel.py), a sharded head_dim does not, nor K/V sharded over the sequence
    unlike q."""
    out = _run(2, """
        mesh = jax.make_mesh((2,), ("x",))
        q, k, v = arrays(1, 2, 2, 256, 64)
        specs = {"head_dim": (P(None, None, None, "x"),) * 3,
                 "seq unlike q": (P(None, None, "x"), P(), P())}
        errors = {}
        for name, (q_spec, kv_spec, _) in specs.items():
            placed = [jax.device_put(x, NamedSharding(mesh, spec))
                      for x, spec in zip((q, k, v), (q_spec, kv_spec, kv_spec))]
            try:
                jax.jit(lambda q, k, v: kernel.flash_attention(q, k, v))(*placed)
            except ValueError as error:
                errors[name] = str(error)
        print(json.dumps(errors))
    """)
    assert "sharded over its head_dim axis" in out["head_dim"]
    assert "batch, heads and seq only" in out["head_dim"]
    assert "sharded alike over batch, heads and seq" in out["seq unlike q"]


def test_the_depth_probe_names_a_real_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error that is no depth's (here injected at the probe's lowering) is named in the
    probe's error, not hidden behind 'install the tpu extra'."""
    from kernel.backends.flash import depths

    def broken(depth: int) -> None:
        raise ValueError("manual_axis_type on jax.ShapeDtypeStruct must not be None")

    monkeypatch.setattr(depths, "_lower_here", broken)
    with pytest.raises(RuntimeError, match="ValueError: manual_axis_type on jax"):
        depths.supported_pipeline_depths.__wrapped__()


def test_every_mask_under_every_sharding_style_matches_the_unsharded_call() -> None:
    """No mask, causal, a window, segment ids and a soft cap, multi-query (one K/V head), the
    loss and its gradients: under jit over explicit NamedShardings, under jax.set_mesh with
    bare PartitionSpecs, and in shard_map with either check_vma. Before: attention without a
    mask or window failed in every sharded context ("Scan carry input and output got
    mismatched varying manual axes": its static K/V loop was a scan, whose interpret-mode
    discharge drops the varying axes)."""
    out = _run(2, """
        mesh = jax.make_mesh((2,), ("data",))
        q, k, v = arrays(4, 2, 1, 128, 64)
        ids = jnp.concatenate([jnp.zeros((4, 48), jnp.int32), jnp.ones((4, 80), jnp.int32)], 1)
        masks = {"none": {}, "causal": {"causal": True}, "window": {"window": (32, 16)},
                 "segments": {"segments": True}, "softcap": {"logits_soft_cap": 20.0}}

        def loss_of(mask):
            def loss(q, k, v, ids):
                options = {key: value for key, value in masks[mask].items() if key != "segments"}
                segments = (ids, ids) if "segments" in masks[mask] else None
                return jnp.sum(kernel.flash_attention(q, k, v, segment_ids=segments,
                                                      **options) ** 2)
            return loss

        def in_shard_map(loss, check_vma):
            return jax.shard_map(lambda *args: jax.lax.psum(loss(*args), "data"), mesh=mesh,
                                 in_specs=(P("data"),) * 4, out_specs=P(), check_vma=check_vma)

        # One jit per set of inputs, each mask's loss and gradients in it (five kernels to a
        # compile, not one: the compiles were most of this test's time).
        every_mask = lambda wrap: lambda *args: {
            mask: jax.value_and_grad(wrap(loss_of(mask)), argnums=(0, 1, 2))(*args)
            for mask in masks}
        plain = lambda loss: loss
        placed = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, k, v, ids)]
        want = jax.jit(every_mask(plain))(q, k, v, ids)
        with jax.set_mesh(mesh):
            bare = jax.jit(every_mask(plain))(*(jax.device_put(x, P("data"))
                                                for x in (q, k, v, ids)))
        styles = {"jit": plain, "shard_map": lambda loss: in_shard_map(loss, True),
                  "shard_map_unchecked": lambda loss: in_shard_map(loss, False)}
        got = jax.jit(lambda *args: {style: every_mask(wrap)(*args)
                                     for style, wrap in styles.items()})(*placed)
        errors = {}
        for style, results in {**got, "set_mesh": bare}.items():
            for mask, (value, grads) in results.items():
                want_value, want_grads = want[mask]
                errors[f"{mask} {style}"] = max(largest_error(value, want_value)
                                                / float(want_value),
                                                *map(largest_error, grads, want_grads))
        print(json.dumps(errors))
    """)
    assert len(out) == 20
    assert all(error < 1e-4 for error in out.values()), out


def test_auto_axes_raise_naming_shard_map_and_run_per_device_inside_it() -> None:
    """A 2 x 4 mesh of Auto axes (MaxText's): under jax.set_mesh, and under plain jit with
    in_shardings and with_sharding_constraint (no context mesh), the wrapper and capture
    raise naming the fix; MaxText's attention op inside its own shard_map(check_vma=False)
    resolves the per-device problem b2 h2/1. Before: b4 h8/4, the global problem, with no
    word."""
    out = _run(8, """
        from jax.sharding import AxisType
        from autotune.traced import TraceError, captured_problems
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        spec = P("data", "model")
        attend = lambda q, k, v: kernel.flash_attention(q, k, v, causal=True)

        def constrained(q, k, v):
            q, k, v = (jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
                       for x in (q, k, v))
            return jnp.sum(attend(q, k, v))

        in_shard_map = jax.shard_map(lambda q, k, v: jax.lax.psum(jnp.sum(attend(q, k, v)),
                                                                  ("data", "model")),
                                     mesh=mesh, in_specs=(spec,) * 3, out_specs=P(),
                                     check_vma=False)
        bare = [jax.ShapeDtypeStruct((4, h, 256, 64), jnp.float32) for h in (8, 4, 4)]
        errors = {}
        for name, loss in (("constrained", constrained),
                           ("in_shardings", lambda q, k, v: jnp.sum(attend(q, k, v)))):
            step = jax.jit(jax.grad(loss), in_shardings=NamedSharding(mesh, spec))
            for how, trace in (("jit", lambda: step.lower(*bare)),
                               ("capture", lambda: captured_problems(step, *bare))):
                try:
                    trace()
                except (kernel.ShardingError, TraceError) as error:
                    errors[f"{name} {how}"] = str(error)
        args = [jax.ShapeDtypeStruct(arg.shape, arg.dtype, sharding=NamedSharding(mesh, spec))
                for arg in bare]
        with jax.set_mesh(mesh):
            try:
                jax.eval_shape(jax.grad(constrained), *args)
            except kernel.ShardingError as error:
                errors["set_mesh"] = str(error)
            captured = [p.label() for p in captured_problems(jax.grad(in_shard_map), *args)]
        print(json.dumps({"errors": errors, "shard_map": captured}))
    """)
    errors = out["errors"]
    assert set(errors) == {"constrained jit", "constrained capture", "in_shardings jit",
                           "in_shardings capture", "set_mesh"}
    for error in errors.values():
        assert "call it inside jax.shard_map" in error and "\\n" not in error, error
    for name in ("constrained jit", "constrained capture", "set_mesh"):
        assert "axes data, model are Auto" in errors[name]  # seen while tracing
    for name in ("in_shardings jit", "in_shardings capture"):
        assert "program over 8 devices" in errors[name]  # seen when lowered
    assert out["shard_map"] == ["b2 h2/1 q256 kv256 d64 float32 causal fwd_bwd"]


def test_tune_model_tunes_and_returns_only_kernels_that_run_at_the_call_site(
        tmp_path: Path) -> None:
    """Under jit over explicit axes the wrapper runs in shard_map(check_vma=True), where
    splash cannot run: tune_model does not tune it there (said on stderr), and with only
    splash asked leaves the problem out. kernels= restricts what is returned, a stored
    choice made among more kernels included. Before: splash was tuned and returned there
    (issue 71 defect 3), and kernels="flash" returned the stored flash + xla choice (defect
    4)."""
    out = _run(2, f"""
        import autotune
        mesh = jax.make_mesh((2,), ("data",))
        step = jax.grad(lambda q, k, v: jnp.sum(kernel.flash_attention(q, k, v, causal=True)))
        args = [jax.ShapeDtypeStruct((4, 2, 128, 64), jnp.float32,
                                     sharding=NamedSharding(mesh, P("data")))] * 3
        tune = lambda kernels: autotune.tune_model(
            step, *args, db="sqlite:///{tmp_path / 'autotune.db'}", trials=1, kernels=kernels)
        choices = lambda table: [(c.kernel, sorted(c.candidates)) for c in table.choices]
        print(json.dumps({{"splash": choices(tune("splash")),
                          "both": choices(tune("xla,flash")),
                          "flash": choices(tune("flash")),
                          "flash, splash": choices(tune("flash,splash"))}}))
    """)
    assert out["both"][0][1] == ["flash", "xla"]
    assert out["flash"] == [["flash", ["flash"]]]
    assert out["splash"] == []
    assert out["flash, splash"] == [["flash", ["flash", "splash"]]]  # splash: illegal there


def test_a_strict_build_fails_the_trace_listing_what_the_pinned_table_misses(
        tmp_path: Path) -> None:
    """kernel.use_table(path, strict=True): a sharded step whose per-device problem has an
    exact entry runs from it; one the table misses fails its trace naming the problem (the
    service is not asked), while a capture of it still records it; strict="nearest" takes
    the nearest entry. Before: no strict mode (issue 71 defect 6)."""
    out = _run(2, f"""
        import os
        os.environ["AUTOTUNE_URL"] = "http://127.0.0.1:9"  # nothing listens: never asked
        from kernel import get_kernel
        from kernel.table import LookupTable, TableEntry
        mesh = jax.make_mesh((2,), ("data",))
        flash = get_kernel("flash")
        local = kernel.Problem(2, 2, 2, 128, 128, 64, dtype="float32", mode="fwd")
        table = LookupTable("flash", flash.version, jax.devices()[0].device_kind,
                            (TableEntry(local, flash.default_config(local)),))
        path = "{tmp_path / 'table.json'}"
        with open(path, "w") as file:
            json.dump(table.to_dict(), file)
        attend = jax.jit(lambda q, k, v: kernel.flash_attention(q, k, v))
        placed = lambda seq: [jax.device_put(x, NamedSharding(mesh, P("data")))
                              for x in arrays(4, 2, 2, seq, 64)]
        kernel.use_table(path, strict=True)
        attend(*placed(128))
        sources = [source for (_, _, p), source in kernel.resolution_sources().items()
                   if p == local]
        try:
            attend(*placed(256))
            missed = ""
        except kernel.StrictMiss as error:
            missed = str(error)
        with kernel.capture() as captured:
            jax.eval_shape(attend, *placed(256))
        kernel.use_table(path, strict="nearest")
        attend(*placed(256))
        print(json.dumps({{"sources": sources, "missed": missed,
                          "captured": [p.label() for p in captured],
                          "requests": kernel.resolve.get_resolver().service_requests}}))
    """)
    assert out["sources"] == ["table, exact, config q128 kv128/128 depth2"]
    assert "flash b2 h2/2 q256 kv256 d64 float32 full fwd" in out["missed"]
    assert "AUTOTUNE_STRICT" in out["missed"] and "\\n" not in out["missed"]
    assert out["captured"] == ["b2 h2/2 q256 kv256 d64 float32 full fwd"]
    assert out["requests"] == 0


def test_the_maxtext_style_and_set_mesh_steps_are_tuned_and_run_each_devices_problems(
        tmp_path: Path) -> None:
    """A Gemma-2-style step of a local (sliding-window, soft-capped) and a global layer on a
    2 x 4 mesh, in both styles: MaxText's (Auto axes, kernel.maxtext's drop-in in its own
    shard_map(check_vma=False)) and the explicit one (jax.set_mesh, arguments sharded by bare
    PartitionSpecs, the wrapper called directly). tune_model, called inside the mesh, tunes
    the two per-device problems b2 h2/1 on one device outside it (the MaxText step then only
    reads them), and each step runs both from its table with the kernel its choice names, the
    two styles' gradients alike. Before: the explicit style raised ValueError "Received
    incompatible devices for jitted computation" from the gate reference's compile in
    check_fits."""
    out = _run(8, f"""
        import autotune
        from autotune.tune import TuneOptions
        from jax.sharding import AxisType
        from kernel.maxtext import tpu_flash_attention
        db = "sqlite:///{tmp_path / 'autotune.db'}"
        shape = dict(zip(("batch", "heads", "kv_heads", "seq", "head_dim"), (4, 8, 4, 128, 64)))
        layers = (("local_sliding", 48), ("global", None))

        def maxtext_loss(mesh, spec):
            def loss(q, k, v):
                return sum(jnp.sum(tpu_flash_attention(
                    q, k, v, None, 20.0, mesh=mesh, axis_names_q=spec, axis_names_kv=spec,
                    attention_type=kind, sliding_window_size=window) ** 2)
                    for kind, window in layers)
            return loss

        def explicit_loss(q, k, v):
            return sum(jnp.sum(kernel.flash_attention(
                q, k, v, causal=True, window=window and (window - 1, 0), sm_scale=1.0,
                logits_soft_cap=20.0, layout="BSHD") ** 2) for _, window in layers)

        def tuned_run(mesh, sharding, loss):
            step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            with jax.set_mesh(mesh):
                args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
                        for x in inputs]
                table = autotune.tune_model(step, *args, db=db, trials=1, kernels="flash",
                                            options=TuneOptions(confirm_rounds=1))
                with kernel.tables(table):
                    grads = step(*(jax.device_put(x, sharding) for x in inputs))
                    sources = {{f"{{name}} {{p.label()}}": source
                               for (name, _, p), source in kernel.resolution_sources().items()
                               if "scoped" in source}}
            return grads, {{"choices": {{c.problem.label(): c.kernel for c in table.choices}},
                           "sources": sources, "dq": str(grads[0].sharding.spec)}}

        inputs = [jnp.swapaxes(x, 1, 2) for x in arrays(*shape.values())]
        spec = P("data", None, "model", None)  # [batch, seq, heads, head_dim]
        explicit = jax.make_mesh((2, 4), ("data", "model"))
        auto = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        explicit_grads, out = tuned_run(explicit, spec, explicit_loss)
        maxtext_grads, maxtext = tuned_run(auto, NamedSharding(auto, spec),
                                           maxtext_loss(auto, P("data", "model")))
        print(json.dumps({{"set_mesh": out, "maxtext": maxtext,
                          "grads": max(map(largest_error, *map(jax.device_get, (
                              maxtext_grads, explicit_grads))))}}))
    """)
    local = ["b2 h2/1 q128 kv128 d64 float32 causal window47,0 softcap20 fwd_bwd",
             "b2 h2/1 q128 kv128 d64 float32 causal softcap20 fwd_bwd"]
    for style in ("set_mesh", "maxtext"):
        assert out[style]["choices"] == {problem: "flash" for problem in local}
        sources = out[style]["sources"]
        assert sorted(sources) == sorted(f"flash {problem}" for problem in local), sources
        assert all(source.startswith("scoped table") and "kernel: chosen" in source
                   for source in sources.values()), sources
    assert out["set_mesh"]["dq"] == "P('data', None, 'model', None)"
    assert out["grads"] < 1e-4


def test_the_maxtext_drop_in_matches_maxtexts_splash_call_on_a_2x4_mesh() -> None:
    """kernel.maxtext.tpu_flash_attention against splash called as MaxText's
    tpu_flash_attention calls it (MaxText 2026-08, layers/attention_op.py; interpreted here):
    BSHD inputs over a 2 x 4 mesh of Auto axes (batch over "fsdp", heads over "tensor",
    grouped-query), its mask (CausalMask, & LocalMask((w - 1, w)) for a local layer), its
    default sa_* blocks, the kernel made for the global heads with head_shards and passed
    through shard_map(check_vma=False) by its manual_sharding_spec, vmapped over the batch
    with SegmentIds. The loss and its gradients agree for a soft-capped local sliding-window
    layer and a global (causal) layer of packed segments, a window one key narrower does not,
    and each call resolved the per-device problem b1 h2/1."""
    out = _run(8, """
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as sk, splash_attention_mask as sm)
        from jax.sharding import AxisType
        from kernel.backends.splash import block_sizes
        from kernel.maxtext import tpu_flash_attention

        mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
        spec, ids_spec = P("fsdp", "tensor", None, None), P("fsdp", None)
        q, k, v = (jnp.swapaxes(x, 1, 2) for x in arrays(2, 8, 4, 128, 64))
        ids = jnp.concatenate([jnp.zeros((2, 40), jnp.int32), jnp.ones((2, 88), jnp.int32)], 1)

        def maxtext_splash(query, key, value, segment_ids, attention_type, window, cap):
            query, key, value = (jnp.transpose(x, (0, 2, 1, 3)) for x in (query, key, value))
            shape = (query.shape[2], key.shape[2])
            mask = sm.CausalMask(shape=shape)
            if attention_type == "local_sliding":
                mask &= sm.LocalMask(shape=shape, window_size=(window - 1, window), offset=0)
            problem = kernel.Problem(*query.shape[:2], key.shape[1], *shape, query.shape[3],
                                     "float32")
            splash = sk.make_splash_mha(
                sm.MultiHeadMask(masks=(mask,) * query.shape[1]), head_shards=4, q_seq_shards=1,
                block_sizes=block_sizes(kernel.get_kernel("splash").default_config(problem)),
                attn_logits_soft_cap=cap, residual_checkpoint_name="context", interpret=True)
            splash_spec = splash.manual_sharding_spec(NamedSharding(mesh, P("tensor", None)))
            segmented = segment_ids is not None
            segments = sk.SegmentIds(segment_ids, segment_ids) if segmented else None
            segments_spec = sk.SegmentIds(ids_spec, ids_spec) if segmented else None
            out = jax.shard_map(
                lambda q, k, v, s, splash: jax.vmap(splash, in_axes=(0, 0, 0, 0))(q, k, v, s),
                mesh=mesh, in_specs=(spec, spec, spec, segments_spec, splash_spec),
                out_specs=spec, check_vma=False)(query, key, value, segments, splash)
            return jnp.transpose(out, (0, 2, 1, 3))

        def drop_in(query, key, value, segment_ids, attention_type, window, cap):
            return tpu_flash_attention(query, key, value, segment_ids, cap, mesh=mesh,
                                       axis_names_q=spec, axis_names_kv=spec,
                                       attention_type=attention_type, sliding_window_size=window)

        def loss_and_grads(attention, *options):
            loss = lambda q, k, v: jnp.sum(attention(q, k, v, *options) ** 2)
            with jax.set_mesh(mesh):
                return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

        def relative_error(got, want):
            return max(largest_error(a, b) / float(jnp.max(jnp.abs(b)))
                       for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))

        layers = {"local, soft cap": (None, "local_sliding", 48, 20.0),
                  "global, segments": (ids, "global", None, None)}
        errors = {name: relative_error(loss_and_grads(drop_in, *options),
                                       loss_and_grads(maxtext_splash, *options))
                  for name, options in layers.items()}
        with jax.set_mesh(mesh):
            narrower = relative_error(
                jax.jit(drop_in, static_argnums=(4, 5, 6))(q, k, v, None, "local_sliding", 47,
                                                            20.0),
                jax.jit(maxtext_splash, static_argnums=(4, 5, 6))(q, k, v, None,
                                                                  "local_sliding", 48, 20.0))
        print(json.dumps({"errors": errors, "narrower": narrower,
                          "problems": per_device_problems()}))
    """)
    assert all(error < 1e-5 for error in out["errors"].values()), out["errors"]
    assert out["narrower"] > 1e-3
    assert out["problems"] == [[1, 2, 1, 128, "fwd"], [1, 2, 1, 128, "fwd_bwd"]]


@pytest.mark.parametrize(("options", "message"), [
    ({"attention_type": "chunk"}, "attention_type 'chunk' is not run by this op; it runs "
                                  "global, local_sliding, full"),
    ({"attention_type": "local_sliding"}, "needs sliding_window_size, a positive int"),
    ({"axis_names_q": ("data", None, "context")}, "shards the seq axis"),
    ({"decoder_segment_ids_kv": "ids"}, "decoder_segment_ids_kv was given without "
                                        "decoder_segment_ids")])
def test_the_maxtext_drop_in_refuses_what_it_does_not_run_naming_the_fix(options, message):
    """What MaxText runs another way (chunk attention, context parallelism) or a local layer
    without its window is refused before anything is traced, naming the fix."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    from kernel.maxtext import tpu_flash_attention

    x = jnp.zeros((1, 128, 2, 64))
    given = {"mesh": None, "axis_names_q": PartitionSpec("data"),
             "axis_names_kv": PartitionSpec("data"), **options}
    given["axis_names_q"] = PartitionSpec(*given["axis_names_q"])
    with pytest.raises(ValueError, match=message):
        tpu_flash_attention(x, x, x, **given)
