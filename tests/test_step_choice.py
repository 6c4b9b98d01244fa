"""``tune_model(..., confirm_step=True)``: the kernel choices confirmed over the model's whole
step (autotune.step_choice, issue 63).

On a quiet CPU the interpreted ``flash`` kernel (its default config) runs this causal attention
(2048 tokens) about 3x faster than ``xla`` (24 against 70 ms per step on the 2-core test
machine), but on a loaded one the rounds' spread was as large as the times (issue 75: flash
68.9 ms +- 71.9, xla 196.0 ms +- 148.5) and the choice flipped. The tests that check a verdict
therefore time each step as :func:`injected_step_times` says (the steps still compile and run
once); the rerun test times them for real and checks only what no timing can change. The
isolated choice is pinned by republishing it, as an isolated timing that favoured that kernel
would have.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import pytest
from conftest import sqlite_copy

import autotune
import autotune.step_choice as step_choice
import kernel
import kernel.table
from autotune.measure import Timing
from autotune.step_choice import confirmed_before
from autotune.tune import TuneOptions
from kernel import LookupTable, get_kernel
from storage import ResultError, Store, upgrade

OPTIONS = TuneOptions(confirm_rounds=5)
STEP_MS = {"flash": 24.0, "xla": 70.0}  # per step, as a quiet 2-core CPU times them


def step(q, k, v):
    return kernel.flash_attention(q, k, v, causal=True).sum()


ARGS = tuple(jax.ShapeDtypeStruct((1, 1, 2048, 128), jnp.float32) for _ in range(3))


@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A database where flash and xla are tuned for the step's one problem (no confirmation)."""
    path = tmp_path_factory.mktemp("tuned") / "autotune.db"
    upgrade(f"sqlite:///{path}")
    autotune.tune_model(step, *ARGS, db=f"sqlite:///{path}", trials=1, kernels="flash,xla",
                        options=OPTIONS)
    return path


def pinned_db(tuned_db: Path, tmp_path: Path, kernel_name: str) -> str:
    """A copy of ``tuned_db`` whose choice is ``kernel_name`` at its tuned config."""
    url = sqlite_copy(tuned_db, tmp_path)
    store = Store(url)
    try:
        device_kind = jax.devices()[0].device_kind
        table = store.export_table(device_kind)
        for choice in table.choices:
            entry = next(e for t in table.kernel_tables() if t.kernel == kernel_name
                         for e in t.entries if e.problem == choice.problem)
            store.publish_choice(device_kind, dataclasses.replace(
                choice, kernel=kernel_name, config=entry.config,
                provenance=choice.provenance | {
                    "kernel_version": get_kernel(kernel_name).version}))
    finally:
        store.close()
    return url


@pytest.fixture
def injected_step_times(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each compiled step (still compiled and run once) timed at ``STEP_MS`` of the kernel its
    table chooses, every run alike: a verdict no load on the machine can flip."""
    compiled = step_choice._compiled
    kernel_of: dict[int, str] = {}

    def recording(fn, args, tables, failures):  # noqa: ANN001, ANN202
        executables = compiled(fn, args, tables, failures)
        for name, executable in executables.items():
            [kernel_of[id(executable)]] = {c.kernel for c in tables[name].choices}
        return executables

    def timer(executable, args, method, runs):  # noqa: ANN001, ANN202
        return lambda: Timing((STEP_MS[kernel_of[id(executable)]],) * runs)

    monkeypatch.setattr(step_choice, "_compiled", recording)
    monkeypatch.setattr(step_choice, "_step_timer", timer)


def stored_choices(url: str) -> LookupTable:
    store = Store(url)
    try:
        return store.export_table(jax.devices()[0].device_kind)
    finally:
        store.close()


def test_a_choice_slower_over_the_step_is_replaced_and_stored(tuned_db, tmp_path, capsys,
                                                              start_server, injected_step_times):
    url = pinned_db(tuned_db, tmp_path, "xla")
    table = autotune.tune_model(step, *ARGS, db=url, trials=1, kernels="flash,xla",
                                options=OPTIONS, confirm_step=True)
    assert [c.kernel for c in table.choices] == ["flash"]
    exported = stored_choices(url)
    assert exported.choices == table.choices  # the service and export answer the same
    provenance = exported.choices[0].provenance
    assert provenance["method"] == "model_step"
    record = provenance["step_confirmation"]
    assert record["chosen"] == "flash" and record["rounds"] == OPTIONS.confirm_rounds
    assert record["variants"]["tuned"] == record["variants"]["xla"]  # one program
    assert {name: times["median_ms"] for name, times in record["variants"].items()} == {
        "tuned": STEP_MS["xla"], **STEP_MS}
    assert "flash at its own tuned configs replaces the tuned table" in capsys.readouterr().err
    served = httpx.get(f"{start_server(url).url}/v1/choices",
                       params={"device_kind": exported.device_kind}).json()["items"]
    assert [(c["kernel"], c["provenance"]["step_confirmation"]) for c in served] == [
        ("flash", record)]
    # an exported table carries the record into another database
    copy = tmp_path / "copy.db"
    upgrade(f"sqlite:///{copy}")
    store = Store(f"sqlite:///{copy}")
    try:
        store.import_table(LookupTable.from_dict(json.loads(json.dumps(exported.to_dict()))))
    finally:
        store.close()
    again = stored_choices(f"sqlite:///{copy}").choices[0].provenance
    assert again["step_confirmation"] == record


def test_a_choice_that_holds_over_the_step_is_kept(tuned_db, tmp_path, capsys,
                                                   injected_step_times):
    url = pinned_db(tuned_db, tmp_path, "flash")
    table = autotune.tune_model(step, *ARGS, db=url, trials=1, kernels="flash,xla",
                                options=OPTIONS, confirm_step=True)
    assert [c.kernel for c in table.choices] == ["flash"]
    provenance = stored_choices(url).choices[0].provenance
    assert provenance["method"] == "interpret"  # the isolated choice's, kept
    assert provenance["step_confirmation"]["chosen"] == "tuned"
    assert "replaces" not in capsys.readouterr().err


def test_a_rerun_that_tunes_nothing_keeps_the_step_confirmation(tuned_db, tmp_path, capsys):
    """A second ``tune_model(..., confirm_step=True)`` of a confirmed step read the tune back
    but timed the step again, so on a loaded machine it could flip a choice the first call
    kept (CI: bench/chip/model_step's rerun under a memory limit). Now it keeps the stored
    confirmation, as the tune keeps a finished problem; a step with other problems, or
    ``force``, confirms again. The first call times the steps for real (wall clock): which
    table it keeps is the machine's load's to say, and this test checks none."""
    url = pinned_db(tuned_db, tmp_path, "flash")
    autotune.tune_model(step, *ARGS, db=url, trials=1, kernels="flash,xla", options=OPTIONS,
                        confirm_step=True)
    [confirmed] = stored_choices(url).choices
    first = confirmed.provenance["step_confirmation"]
    assert (first["timing"], first["rounds"]) == ("wallclock", OPTIONS.confirm_rounds)
    assert all(times["median_ms"] > 0 for times in first["variants"].values())
    capsys.readouterr()
    table = autotune.tune_model(step, *ARGS, db=url, trials=1, kernels="flash,xla",
                                options=OPTIONS, confirm_step=True)
    assert stored_choices(url).choices[0].provenance["step_confirmation"] == first
    assert [c.kernel for c in table.choices] == [confirmed.kernel]
    assert "step confirmation: kept from an earlier call" in capsys.readouterr().err
    choice = table.choices[0]
    other_step = dataclasses.replace(table, choices=(choice, dataclasses.replace(
        choice, problem=dataclasses.replace(choice.problem, q_len=1024, kv_len=1024))))
    assert confirmed_before(step, ARGS, table) and not confirmed_before(step, ARGS, other_step)


def test_another_step_with_the_same_problems_is_confirmed_on_its_own(tuned_db, tmp_path,
                                                                     capsys):
    """Issue 75 item 11l: a step with the same attention problem among other ops was said
    "kept from an earlier call for this step", never timed: the record named the problems
    only."""
    url = pinned_db(tuned_db, tmp_path, "flash")
    autotune.tune_model(step, *ARGS, db=url, trials=1, kernels="flash,xla", options=OPTIONS,
                        confirm_step=True)
    first = stored_choices(url).choices[0].provenance["step_confirmation"]
    capsys.readouterr()

    def other_step(q, k, v):
        return jnp.tanh(kernel.flash_attention(q, k, v, causal=True)).mean()

    autotune.tune_model(other_step, *ARGS, db=url, trials=1, kernels="flash,xla",
                        options=OPTIONS, confirm_step=True)
    assert "kept from an earlier call" not in capsys.readouterr().err
    again = stored_choices(url).choices[0].provenance["step_confirmation"]
    assert again["step"] != first["step"]


def test_abstract_arguments_are_synthesized_on_their_sharding():
    from autotune.model import concrete_args

    mesh = jax.make_mesh((1,), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    floats = jax.ShapeDtypeStruct((2, 3), jnp.bfloat16, sharding=sharding)
    ints = jax.ShapeDtypeStruct((4,), jnp.int32)
    given = jnp.ones(5)
    made_floats, (made_ints, kept) = concrete_args((floats, (ints, given)))
    assert made_floats.dtype == jnp.bfloat16 and made_floats.sharding == sharding
    assert float(jnp.std(made_floats.astype(jnp.float32))) > 0
    assert made_ints.dtype == jnp.int32 and not made_ints.any()
    assert kept is given


@pytest.mark.parametrize("record", ["fast", {"x": float("nan")}, {"x": "y" * 5000}])
def test_a_step_confirmation_that_is_no_small_json_object_is_refused(sqlite_db_url, record):
    table = stored_choices(sqlite_db_url)
    problem = kernel.Problem(1, 1, 1, 128, 128, 128, "float32", True, "fwd")
    choice = kernel.table.KernelChoice(
        problem, "xla", get_kernel("xla").config_type(),
        {"xla": kernel.table.KernelTiming(1.0, 0.1)},
        {"method": "model_step", "step_confirmation": record})
    store = Store(sqlite_db_url)
    try:
        with pytest.raises(ResultError, match="step_confirmation must be a JSON object"):
            store.publish_choice(table.device_kind, choice)
    finally:
        store.close()
