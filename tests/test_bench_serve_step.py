"""bench/chip/serve_step.py on the CPU: the decode loop's skeleton with tiny shapes, every
contender's attention the float32 reference (the kernel runs on a TPU only), the loop traced
on a deviceless v5e through ``kernel.ragged_paged_attention`` under a pinned table, and the
shapes file of the keys a tuned table needs, as ``autotune tune --kernel rpa`` reads it."""

from __future__ import annotations

import argparse
import json

import jax

import kernel
from autotune.problem_options import load_shapes
from bench.chip import serve_step
from kernel import LookupTable, ServingProblem, TableEntry
from kernel.aot import topology_device
from kernel.backends.rpa import RpaConfig

V5E = "TPU v5 lite"


def test_the_loop_runs_each_contender_and_checks_it_against_the_reference(tmp_path):
    out = tmp_path / "serve.json"
    report = serve_step.main(["--interpret", "--table", "unused.json", "--out", str(out)])
    assert json.loads(out.read_text())["contenders"] == report["contenders"]
    rows = report["contenders"]
    assert list(rows) == ["tuned", "jax", "default"]
    for row in rows.values():
        assert row["error"] == 0.0 and row["tokens_per_s"] > 0 and row["spread"] >= 0
    assert report["ratios"]["tuned_over_jax"] == (rows["tuned"]["tokens_per_s"]
                                                  / rows["jax"]["tokens_per_s"])


def test_the_loop_traces_through_the_wrapper_on_a_v5e_with_the_tuned_table(tmp_path):
    args = argparse.Namespace(page_size=16, max_model_len=2048, tokens=512)
    problem = serve_step.serving_problem(8, 1, None, 32, args)
    table = tmp_path / "rpa.json"
    table.write_text(json.dumps(LookupTable("rpa", "1", V5E, (
        TableEntry(problem, RpaConfig(8, 32), time_ms=1.0),)).to_dict()))
    params, state, pages = jax.eval_shape(lambda: serve_step.init(problem, 1, 16))
    device = topology_device("v5e")
    run = serve_step.decode_steps(problem, serve_step._wrapper(problem, None), 2)
    with jax.default_device(device), kernel.tables(table):
        x, caches, lens = jax.eval_shape(run, params, state, pages)
        source = kernel.resolution_sources()[("rpa", V5E, problem)]
    assert x.shape == (32, 8 * 128) and caches[0].shape == state[1][0].shape
    assert source == f"scoped table {str(table)!r}, exact, config kv_pages8 q32"


def test_the_shapes_it_writes_are_the_serving_problems_tune_reads(tmp_path):
    shapes = tmp_path / "serving.yaml"
    serve_step.main(["--write-shapes", str(shapes), "--models", "llama3-8b,mistral-7b",
                     "--seqs", "32,256"])
    problems = load_shapes(shapes, problem_type=ServingProblem)
    assert len(problems) == 4
    assert problems[-1] == ServingProblem(32, 8, 128, 16, 128, 512, 256, window=4096)
