"""Property test of the loaders (issue 55 item 9): random JSON, and valid tables with one value
replaced by random JSON, fed to every loader of tables, problems and shapes files. Each reads
it or refuses it with its own error (``TableError``, ``ProblemError``, ``--shapes``'s usage
error; the service's import then answers 422); never another exception, which failed every
trace under ``AUTOTUNE_TABLE``, printed a traceback on ``autotune import`` and answered 500."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from autotune.problem_options import load_shapes
from kernel import FlashConfig, LookupTable, Problem, get_kernel
from kernel.errors import ProblemError, TableError
from kernel.table import KernelChoice, KernelTiming, TableEntry
from storage import ResultError, Store, upgrade

PROBLEM = Problem(batch=1, q_heads=2, kv_heads=2, q_len=256, kv_len=256, head_dim=128,
                  causal=True, window=(64, 0), softcap=30.0)
CONFIG = FlashConfig(block_q=128, block_kv=128)
XLA_CONFIG = get_kernel("xla").default_config(PROBLEM)
# A valid table with an entry, a choice and another kernel's entries: every part to break.
VALID = json.loads(json.dumps(LookupTable(
    kernel="flash", kernel_version="1", device_kind="cpu", jax_version="0.4.1",
    entries=(TableEntry(PROBLEM, CONFIG, 1.0, 2.0, 2.0, {"trials": 4}),),
    choices=(KernelChoice(PROBLEM, "flash", CONFIG, {"flash": KernelTiming(1.0, 0.1),
                                                     "xla": KernelTiming(failure="oom")}),),
    others=(LookupTable(kernel="xla", kernel_version="1", device_kind="cpu",
                        entries=(TableEntry(PROBLEM, XLA_CONFIG, 3.0),)),)).to_dict()))
# The cases the issue found: others[0].kernel a list or an object, softcaps no float holds.
HUGE_SOFTCAP = {**VALID["entries"][0]["problem"], "softcap": 10 ** 400}
FOUND = [{**VALID, "others": [{**VALID["others"][0], "kernel": ["xla"]}]},
         {**VALID, "others": [{**VALID["others"][0], "kernel": {"name": "xla"}}]},
         {**VALID, "entries": [{**VALID["entries"][0], "problem": HUGE_SOFTCAP}]},
         {**VALID, "choices": [{**VALID["choices"][0], "problem": HUGE_SOFTCAP}]}]
EXAMPLES = settings(max_examples=300, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))

scalars = (st.none() | st.booleans() | st.text(max_size=8)
           | st.sampled_from(["flash", "xla", "splash", "fwd", "bfloat16", "1", ""])
           | st.integers(-2, 2048) | st.integers() | st.sampled_from([10 ** 400, -(10 ** 400)])
           | st.floats())  # NaN and infinities too: Python's json reads them
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=8) | st.sampled_from(sorted(VALID)), inner, max_size=3), max_leaves=8)


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document: each dict value and list item, the root first."""
    children = (value.items() if isinstance(value, dict)
                else enumerate(value) if isinstance(value, list) else ())
    return [path, *(p for key, item in children for p in _paths(item, (*path, key)))]


def _replaced(document: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    out = copy.deepcopy(document)
    parent = out
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return out


@st.composite
def broken_tables(draw: st.DrawFn) -> Any:
    """``VALID`` with one value, anywhere in it, replaced by random JSON."""
    return _replaced(VALID, draw(st.sampled_from(_paths(VALID))), draw(json_values))


def test_the_valid_table_loads() -> None:
    table = LookupTable.from_dict(VALID)
    assert [len(t.entries) for t in table.kernel_tables()] == [1, 1] and table.choices


@EXAMPLES
@given(data=broken_tables() | json_values)
@example(data=FOUND[0])
@example(data=FOUND[1])
@example(data=FOUND[2])
@example(data=FOUND[3])
def test_a_table_loads_or_is_a_table_error(data: Any) -> None:
    try:
        LookupTable.from_dict(data)
    except TableError:
        pass


@EXAMPLES
@given(data=json_values | st.dictionaries(st.sampled_from(sorted(PROBLEM.to_dict())),
                                          json_values, max_size=9))
@example(data=HUGE_SOFTCAP)
def test_a_problem_loads_or_is_a_problem_error(data: Any) -> None:
    try:
        Problem.from_dict(data)
    except ProblemError:
        pass


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module")
def fuzz_store(fuzz_dir: Path) -> Iterator[Store]:
    url = f"sqlite:///{fuzz_dir / 'import.db'}"
    upgrade(url)
    with Store(url) as store:
        yield store


@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=broken_tables())
@example(data=FOUND[0])
@example(data=FOUND[2])
def test_a_table_file_loads_or_is_a_table_error_and_imports_or_is_a_result_error(
        data: Any, fuzz_dir: Path, fuzz_store: Store) -> None:
    """As ``AUTOTUNE_TABLE``, ``autotune import`` and ``POST /v1/tables`` read it."""
    path = fuzz_dir / "table.json"
    path.write_text(json.dumps(data))
    try:
        table = LookupTable.load(path)
    except TableError:
        return
    try:
        fuzz_store.import_table(table)
    except ResultError:
        pass


@EXAMPLES
@given(data=st.lists(st.dictionaries(st.sampled_from(sorted(PROBLEM.to_dict())), json_values,
                                     max_size=9), max_size=3) | json_values)
@example(data=[HUGE_SOFTCAP])
def test_a_shapes_file_loads_or_is_refused_naming_shapes(data: Any, fuzz_dir: Path) -> None:
    path = fuzz_dir / "shapes.json"
    path.write_text(json.dumps(data))
    try:
        load_shapes(path)
    except typer.BadParameter as error:
        assert error.param_hint == "--shapes"
