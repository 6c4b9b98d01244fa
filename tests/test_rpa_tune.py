"""``autotune tune --kernel rpa --shapes FILE`` on a CPU, its kernel replaced by the float32
reference of one call (upstream's kernel runs on a TPU only, docs/serving.md): the serving
problems of the file are tuned over the batch compositions, the gate checks every batch, and
the published result records the compositions in its provenance, and the summary times JAX's
own choice beside the winner, as a chip run does."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from autotune.cli import app
from autotune.problem_options import load_shapes
from kernel import LookupTable, ServingProblem, TableEntry
from kernel.backends.rpa import RpaConfig, RpaKernel, paged_reference
from kernel.registry import SERVING_KERNELS
from storage import Store

RPA = SERVING_KERNELS["rpa"]
ROOT = Path(__file__).resolve().parents[1]
TINY = ServingProblem(4, 2, 128, page_size=4, pages_per_seq=4, max_num_batched_tokens=8,
                      max_num_seqs=2, dtype="float32", kv_dtype="float32")


@pytest.fixture()
def on_the_reference(monkeypatch):
    """The rpa backend's kernel replaced by one call's float32 reference, which runs here."""
    def attention(self, problem, config_for, sm_scale):  # noqa: ANN001, ANN202, ARG001
        return paged_reference(problem, min(problem.max_num_batched_tokens,
                                            problem.max_model_len))

    monkeypatch.setattr(RpaKernel, "attention", attention)


def _tune(*args: str) -> object:
    return CliRunner().invoke(app, ["tune", "--kernel", "rpa", *args], catch_exceptions=False,
                              env={"COLUMNS": "400"})  # Rich wraps errors at 80 columns


def test_a_serving_problem_is_tuned_over_its_batches_and_records_them(tmp_path,
                                                                      on_the_reference):
    shapes = tmp_path / "serving.yaml"
    shapes.write_text(yaml.safe_dump([TINY.to_dict()]))
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    result = _tune("--shapes", str(shapes), "--trials", "2", "--db", url, "--json")
    assert result.exit_code == 0, result.output
    summary = [json.loads(line) for line in result.output.splitlines()][-1]
    assert summary["problem"] == TINY.to_dict() and summary["kernel"] == "rpa"
    jax_choice = summary["baselines"]["jax"]  # JAX's fallback, clamped: confirmed beside
    assert jax_choice["config"] == RPA.jax_config(TINY, "cpu").to_dict()
    assert jax_choice["speedup"] == pytest.approx(jax_choice["median_ms"]
                                                  / summary["best_time_ms"])
    with Store(url) as store:
        entry, match = store.lookup("rpa", "cpu", TINY)
    assert match == "exact" and entry.result.trials == 2
    assert entry.result.compositions == RPA.compositions(TINY)
    assert [c["name"] for c in entry.result.compositions] == [
        "decode_short", "decode_long", "prefill", "mixed"]
    assert entry.result.to_table_entry().provenance["compositions"] == RPA.compositions(TINY)


@pytest.mark.parametrize(("args", "refusal"), [
    (["--q-len", "64"], "give them in a --shapes file.*not --q-len"),
    ([], "give them in a --shapes file"),
])
def test_a_serving_kernel_takes_its_problems_from_a_shapes_file(tmp_path, args, refusal):
    result = _tune(*args, "--db", f"sqlite:///{tmp_path / 'tune.db'}")
    assert result.exit_code == 2
    assert re.search(refusal, result.output)


def test_a_bad_serving_problem_is_named(tmp_path):
    shapes = tmp_path / "serving.yaml"
    shapes.write_text(yaml.safe_dump([{**TINY.to_dict(), "page_size": 0}]))
    result = _tune("--shapes", str(shapes), "--db", f"sqlite:///{tmp_path / 'tune.db'}")
    assert result.exit_code == 2 and "problem 0: page_size must be between 1" in result.output


RECORDER = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    import kernel
    from kernel import ServingProblem
    from kernel.aot import topology_device
    from kernel.registry import SERVING_KERNELS

    rpa, device = SERVING_KERNELS["rpa"], topology_device("v5e")
    for data in json.loads(sys.argv[1]):  # serving steps, traced on a deviceless v5e
        problem = ServingProblem.from_dict(data)
        with jax.default_device(device):
            jax.eval_shape(kernel.ragged_paged_attention, *rpa.call_specs(problem, device))
    x = jax.ShapeDtypeStruct((1, 1, 128, 64), jnp.float32)  # an attention call, on the CPU
    jax.eval_shape(lambda q: kernel.flash_attention(q, q, q), x)
""")


def test_serving_misses_are_recorded_as_flashs_and_tune_takes_them(tmp_path, capsys,
                                                                    on_the_reference):
    """Issue 73: a serving step's miss is recorded as an attention call's is.
    ``AUTOTUNE_RECORD_MISSES`` writes the serving misses and borrowers (marked with what they
    borrowed from) beside the attention ones; ``autotune tune --kernel rpa --shapes`` tunes the
    serving steps of that file and ``autotune tune --shapes`` its attention calls, each saying
    what it left out and which command tunes it."""
    borrower = dataclasses.replace(TINY, max_num_seqs=4)  # TINY's nearest entry is legal for it
    missed = dataclasses.replace(TINY, page_size=8)  # a family the table has no entry of
    table = tmp_path / "v5e.json"
    table.write_text(json.dumps(LookupTable(RPA.name, RPA.version, "TPU v5 lite", (
        TableEntry(TINY, RpaConfig(2, 4), time_ms=1.0),)).to_dict()))
    path = tmp_path / "misses.yaml"
    env = {**os.environ, "AUTOTUNE_RECORD_MISSES": str(path), "AUTOTUNE_TABLE": str(table),
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", RECORDER, json.dumps(
        [p.to_dict() for p in (missed, borrower)])], env=env, capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stderr
    header, missed_line, attention_line, borrower_line = path.read_text().splitlines()
    assert "--kernel rpa --shapes FILE" in header
    assert borrower_line.endswith(f"}}  # borrowed from {TINY.label()} (the nearest table "
                                  "entry)")
    capsys.readouterr()
    assert load_shapes(path, problem_type=ServingProblem) == [missed, borrower]
    assert (f"left out 1 attention problem(s) (`autotune tune --shapes {path}` tunes them)"
            in " ".join(capsys.readouterr().err.split()))
    [attention] = load_shapes(path)
    assert (attention.q_len, attention.head_dim) == (128, 64)
    assert (f"left out 2 serving problem(s) (`autotune tune --kernel rpa --shapes {path}` "
            "tunes them)" in " ".join(capsys.readouterr().err.split()))

    path.write_text(f"{header}\n{attention_line}\n{borrower_line}\n")  # one quick tune
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    result = _tune("--shapes", str(path), "--trials", "1", "--db", url)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert f"note: {path}: left out 1 attention problem(s)" in said
    assert (f"note: {path}: 1 problem(s) ran on a config borrowed from the nearest tuned "
            f"problem (borrowed from {TINY.label()} (the nearest table entry))") in said
    with Store(url) as store:
        assert store.lookup("rpa", "cpu", borrower)[1] == "exact"
