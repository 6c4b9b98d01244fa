"""``autotune tune --kernel rpa --shapes FILE`` on a CPU, its kernel replaced by the float32
reference of one call (upstream's kernel runs on a TPU only, docs/serving.md): the serving
problems of the file are tuned over the batch compositions, the gate checks every batch, and
the published result records the compositions in its provenance, and the summary times JAX's
own choice beside the winner, as a chip run does."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from typer.testing import CliRunner

from autotune.cli import app
from kernel import ServingProblem
from kernel.backends.rpa import RpaKernel, paged_reference
from kernel.registry import SERVING_KERNELS
from storage import Store

RPA = SERVING_KERNELS["rpa"]
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
