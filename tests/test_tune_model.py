"""autotune.tune_model and ``autotune tune --from``: tune the problems a model's function uses.

Kept tiny: the ``xla`` kernel (one config: nothing to search), small shapes, few rounds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import autotune
import kernel
from autotune.tune import TuneOptions
from conftest import AUTOTUNE
from kernel import Problem
from storage import Store

ROOT = Path(__file__).resolve().parents[1]
MODEL = textwrap.dedent("""
    import jax
    import jax.numpy as jnp
    import kernel

    def attention(x, heads, causal):
        b, s, d = x.shape
        q = x.reshape(b, s, heads, d // heads).transpose(0, 2, 1, 3)
        return kernel.flash_attention(q, q[:, :1], q[:, :1], causal=causal).sum()

    def step(w, x, y):
        # trained: causal attention over x @ w; evaluated only: attention over y
        grads = jax.grad(lambda w: attention(x @ w, 2, True))(w)
        return grads, attention(y, 1, False)

    def forward(x):
        return attention(x, 2, True)

    def broken_args():
        raise RuntimeError("no weights here")

    def example_args():
        return (jax.ShapeDtypeStruct((256, 256), jnp.float32),
                jax.ShapeDtypeStruct((1, 128, 256), jnp.float32),
                jax.ShapeDtypeStruct((1, 256, 128), jnp.float32))
""")
TRAINED = Problem(batch=1, q_heads=2, kv_heads=1, q_len=128, kv_len=128, head_dim=128,
                  dtype="float32", causal=True, mode="fwd_bwd")
EVALUATED = Problem(batch=1, q_heads=1, kv_heads=1, q_len=256, kv_len=256, head_dim=128,
                    dtype="float32", causal=False, mode="fwd")


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "tiny_model.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    import tiny_model

    return tiny_model


def test_tune_model_tunes_exactly_the_problems_and_resumes(model, sqlite_db_url, capsys):
    args = model.example_args()
    options = TuneOptions(confirm_rounds=2)
    table = autotune.tune_model(model.step, *args, db=sqlite_db_url, trials=1, kernels="xla",
                                options=options)
    assert [c.problem for c in table.choices] == [TRAINED, EVALUATED]
    assert {c.kernel for c in table.choices} == {"xla"}
    assert sorted(e.problem.label() for t in table.kernel_tables() for e in t.entries) == sorted(
        p.label() for p in (TRAINED, EVALUATED))
    assert "chosen: xla" in capsys.readouterr().out  # the CLI's display
    with kernel.tables(table):
        jax.eval_shape(model.step, *args)
        sources = kernel.resolution_sources()
    for problem in (TRAINED, EVALUATED):  # each in the mode it runs
        assert "choice in scoped table 'xla table on cpu'" in sources[("xla", "cpu", problem)]
    with Store(sqlite_db_url) as store:
        stamps = [c.updated_at for c in store.list_choices(limit=None)[0]]
    again = autotune.tune_model(model.step, *args, db=sqlite_db_url, trials=1, kernels="xla",
                                options=options)
    assert again == table
    assert capsys.readouterr().out.count("already tuned under the installed versions") == 2
    with Store(sqlite_db_url) as store:
        assert [c.updated_at for c in store.list_choices(limit=None)[0]] == stamps


def test_tune_model_of_a_function_without_attention_says_so(sqlite_db_url):
    from autotune.traced import TraceError

    with pytest.raises(TraceError, match="makes no kernel.flash_attention call"):
        autotune.tune_model(jnp.sin, jax.ShapeDtypeStruct((4,), jnp.float32),
                            db=sqlite_db_url, kernels="xla")


def test_tune_model_into_an_unusable_database_says_so(model, tmp_path, capsys):
    with pytest.raises(RuntimeError, match="cannot tune into database"):
        autotune.tune_model(model.step, *model.example_args(), kernels="xla",
                            db=f"sqlite:///{tmp_path / 'missing' / 'dir' / 'a.db'}")
    assert "error:" in capsys.readouterr().err
    # Issue 75 item 11h: a password, in the URL's user part or its query, is masked.
    for db in ("postgresql+psycopg://u:hunter2@127.0.0.1:1/db",
               "postgresql+psycopg://u@127.0.0.1:1/db?password=hunter2"):
        with pytest.raises(RuntimeError, match="cannot tune into database") as raised:
            autotune.tune_model(model.step, *model.example_args(), kernels="xla", db=db)
        assert "hunter2" not in str(raised.value) + capsys.readouterr().err


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "tiny_model.py").write_text(MODEL)
    return subprocess.run([*AUTOTUNE, "tune", *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"})


def test_tune_from_a_function_tunes_what_its_trace_uses(tmp_path, sqlite_db_url):
    done = cli(tmp_path, "--from", "tiny_model:forward", "--args", "float32[1,128,256]",
               "--kernels", "xla", "--trials", "1", "--db", sqlite_db_url, "--json")
    assert done.returncode == 0, done.stderr
    summaries = [json.loads(line) for line in done.stdout.splitlines()
                 if line.startswith('{"summary"')]
    assert [Problem.from_dict(s["problem"]) for s in summaries] == [
        dataclasses.replace(TRAINED, mode="fwd")]


def test_args_from_a_function_are_its_tuple(model):
    from autotune.traced import abstract_args, captured_problems, load_function

    args = abstract_args("tiny_model:example_args")
    assert args == model.example_args()
    assert captured_problems(load_function("tiny_model:step"), *args) == [TRAINED, EVALUATED]


@pytest.mark.parametrize(("spec", "args", "message"), [
    ("no_such_module:step", None, "cannot import 'no_such_module'"),
    ("tiny_model:missing", None, "has no attribute 'missing'"),
    ("tiny_model", None, "give module:function"),
    ("tiny_model:step", "float32(1,2)", "write an array as dtype[d0"),
    ("tiny_model:step", "floaty[1]", "unknown dtype 'floaty'"),
    ("tiny_model:forward", "float32[1,128,255]", "tracing forward failed"),
    ("tiny_model:forward", "tiny_model:broken_args",
     "calling it failed: RuntimeError: no weights here"),
])
def test_a_bad_function_or_arguments_is_named(model, spec, args, message):
    from autotune.traced import TraceError, abstract_args, captured_problems, load_function

    with pytest.raises(TraceError) as error:
        captured_problems(load_function(spec), *abstract_args(args))
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(("args", "message"), [
    (["--from", "tiny_model:missing"], "has no attribute 'missing'"),
    (["--from", "tiny_model:step", "--q-len", "256"], "give --from, --shapes or the problem"),
    (["--args", "float32[1]"], "give --from too"),
    (["--from", "tiny_model:forward", "--args", "tiny_model:broken_args"],
     "Invalid value: --args 'tiny_model:broken_args': calling it failed: RuntimeError: no "
     "weights here"),
])
def test_tune_from_refuses_bad_input_in_one_line(tmp_path, args, message):
    done = cli(tmp_path, *args, "--kernels", "xla", "--db", f"sqlite:///{tmp_path / 'a.db'}")
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("trials", [0, -1, True, 2.5])
def test_tune_model_refuses_a_trial_count_below_one(model, sqlite_db_url, trials):
    """Issue 55 item 13: ``tune_model(trials=0)`` (or -1) was accepted; the CLI refuses
    ``--trials`` below 1."""
    with pytest.raises(kernel.ConfigError, match="trials must be an integer of at least 1"):
        autotune.tune_model(model.forward, *model.example_args()[1:2], db=sqlite_db_url,
                            trials=trials, kernels="xla")


@pytest.mark.parametrize("options, field", [
    (dict(patience=0), "patience"), (dict(patience=-2), "patience"),
    (dict(patience=1.5), "patience"), (dict(timeout=-1.0), "timeout"),
    (dict(timeout=float("nan")), "timeout"), (dict(timeout="60"), "timeout")])
def test_tune_options_refuse_what_the_cli_refuses(options, field):
    """``tune_model(options=TuneOptions(patience=0))`` or a negative timeout was accepted (the
    search stopped at once), where ``--patience`` and ``--timeout`` refuse them."""
    with pytest.raises(kernel.ConfigError, match=f"^{field} must be None or"):
        TuneOptions(**options)


@pytest.mark.parametrize("options, field", [
    (dict(confirm_rounds=0), "confirm_rounds"), (dict(confirm_rounds=2.0), "confirm_rounds"),
    (dict(confirm_top=-1), "confirm_top"), (dict(compile_timeout_s=-1), "compile_timeout_s"),
    (dict(compile_timeout_s=0), "compile_timeout_s"),
    (dict(compile_timeout_s=float("inf")), "compile_timeout_s"),
    (dict(seed="x"), "seed"), (dict(seed=-1), "seed"), (dict(seed=2**32), "seed"),
    (dict(seed=10**5000), "seed"), (dict(sampler="bayes"), "sampler"),
    (dict(device_index=-1), "device_index"), (dict(device_index=True), "device_index")])
def test_tune_options_refuse_values_no_tune_runs_with(options, field):
    """Issue 62 item 7: confirm_rounds=0 ran the whole search, then raised StatisticsError;
    compile_timeout_s=-1 stored every config as a timeout never measured again; seed='x' was a
    numpy TypeError, seed=-1 a numpy ValueError after the setup."""
    with pytest.raises(kernel.ConfigError, match=f"^{field} must be ") as refused:
        TuneOptions(**options)
    assert refused.value.field == field and len(str(refused.value)) < 200
