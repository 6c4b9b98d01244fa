"""Stale configs: tuned under other jax, jaxlib or libtpu versions than the installed ones.
``autotune stale`` lists them and writes the re-tune command; the report and pages mark them."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from autotune.commands.stale import shapes_file_name
from autotune.problem_options import load_shapes
from autotune.report import render
from kernel import Problem, get_kernel
from kernel.resolve import installed_versions
from storage import Store, TunedResult
from tests.conftest import run_cli

# This environment's versions as the provenance fields of a tuned result.
INSTALLED = {f"{package}_version": version for package, version in installed_versions().items()}
default_config = get_kernel("flash").default_config


def _problem(q_len: int) -> Problem:
    return Problem(batch=1, q_heads=2, kv_heads=2, q_len=q_len, kv_len=q_len, head_dim=64,
                   dtype="float32", causal=False, mode="fwd")


# (device kind, problem, versions recorded when it was tuned, stale?)
ENTRIES = [
    ("cpu", _problem(128), INSTALLED, False),
    ("cpu", _problem(256), {**INSTALLED, "jax_version": "0.4.1"}, True),
    ("cpu", _problem(512), {}, False),  # recorded no versions: nothing to compare
    ("TPU v5 lite", _problem(128), {**INSTALLED, "libtpu_version": "0.0.1"}, True),
]


@pytest.fixture
def stale_db(sqlite_db_url: str) -> str:
    with Store(sqlite_db_url) as store:
        for device_kind, problem, versions, _ in ENTRIES:
            store.publish(TunedResult(device_kind=device_kind, problem=problem,
                                      config=default_config(problem), median_ms=1.0,
                                      **versions))
    return sqlite_db_url


def test_stale_lists_the_stale_entries_and_writes_the_retune_commands(stale_db: str,
                                                                     tmp_path: Path) -> None:
    result = run_cli("stale", "--db", stale_db, "--output-dir", str(tmp_path / "shapes"),
                     env={"COLUMNS": "250"})
    assert result.returncode == 0, result.stderr
    stale = {(kind, problem) for kind, problem, _, is_stale in ENTRIES if is_stale}
    listed = {(kind, problem) for kind, problem, _, _ in ENTRIES
              if re.search(rf"{kind}\s+│\s+{re.escape(problem.label())}\s", result.stdout)}
    assert listed == stale, result.stdout
    assert "jax 0.4.1" in result.stdout and "libtpu 0.0.1" in result.stdout
    for kind, problem in stale:
        slug = "cpu" if kind == "cpu" else "tpu-v5-lite"
        path = tmp_path / "shapes" / f"stale-flash-{slug}.json"
        assert load_shapes(path) == [problem]  # what `autotune tune --shapes` reads
        command = f"autotune tune --kernel flash --shapes {path} --force --db {stale_db}"
        assert command in result.stdout


def test_stale_on_an_up_to_date_database_says_so(sqlite_db_url: str, tmp_path: Path) -> None:
    with Store(sqlite_db_url) as store:
        store.publish(TunedResult(device_kind="cpu", problem=_problem(128), median_ms=1.0,
                                  config=default_config(_problem(128)), **INSTALLED))
    result = run_cli("stale", "--db", sqlite_db_url, "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "no stale configs: all 1 were tuned under this environment's versions" in result.stdout
    assert not list(tmp_path.glob("stale-*.json"))


def _marked(html: str, row_start: str) -> dict[str, bool]:
    """Per table row starting with ``row_start``: the problem label -> marked stale."""
    rows = html.split(row_start)[1:]
    return {re.search(r"<code>([^<]+)</code>", row).group(1): 'class="stale"' in
            row.split("</tr>")[0] for row in rows}


def _expected(device_kind: str) -> dict[str, bool]:
    return {problem.label(): is_stale for kind, problem, _, is_stale in ENTRIES
            if kind == device_kind}


def test_report_marks_the_stale_entries(stale_db: str) -> None:
    with Store(stale_db) as store:
        html = render(store, {"device_kind": "cpu"})
    assert _marked(html, '<tr class="index-row">') == _expected("cpu")
    assert "tuned under jax 0.4.1 (installed " in html


def test_pages_mark_the_stale_entries(stale_db: str, start_server) -> None:
    server = start_server(stale_db)
    index = httpx.get(f"{server.url}/", params={"device_kind": "cpu"}, timeout=30)
    assert index.status_code == 200
    assert _marked(index.text, '<tr class="entry"') == _expected("cpu")
    links = dict(zip(re.findall(r"<td><code>([^<]+)</code></td><td>", index.text),
                     re.findall(r'class="detail" href="([^"]+)"', index.text), strict=True))
    for label, is_stale in _expected("cpu").items():
        detail = httpx.get(server.url + links[label].replace("&amp;", "&"), timeout=30)
        assert detail.status_code == 200
        assert ('class="stale"' in detail.text) == is_stale, label


def test_stale_leaves_out_other_kernel_versions_and_lists_each_problem_once(
        sqlite_db_url: str, tmp_path: Path) -> None:
    """An entry of another kernel version is never replaced by a re-tune (which publishes under
    the installed one): it is counted, not listed; a problem stored under two platforms goes
    into the shapes file once (tuned twice, it would be published twice)."""
    old = {**INSTALLED, "jax_version": "0.4.1"}
    problem, other = _problem(256), _problem(512)
    with Store(sqlite_db_url) as store:
        for stored, fields in ((problem, {"platform": "cpu"}), (problem, {"platform": "tpu"}),
                               (other, {"kernel_version": "0"})):
            store.publish(TunedResult(device_kind="cpu", problem=stored, median_ms=1.0,
                                      config=default_config(stored), **old, **fields))
    result = run_cli("stale", "--db", sqlite_db_url, "--output-dir", str(tmp_path),
                     env={"COLUMNS": "250"})
    assert result.returncode == 0, result.stderr
    assert other.label() not in result.stdout
    assert "left out: 1 stale config(s) of other kernel versions" in result.stdout
    assert load_shapes(tmp_path / "stale-flash-cpu.json") == [problem]
    assert "re-tune the 1 stale flash config(s)" in result.stdout


def test_device_kinds_of_the_same_words_get_a_shapes_file_each(sqlite_db_url: str,
                                                               tmp_path: Path) -> None:
    """"TPU v5 lite" and "TPU v5-lite" are two device kinds with the same words: each gets its
    own shapes file, holding its own problems (one overwrote the other, and both commands
    named the one file)."""
    old = {**INSTALLED, "jax_version": "0.4.1"}
    problems = {"TPU v5 lite": _problem(256), "TPU v5-lite": _problem(512)}
    with Store(sqlite_db_url) as store:
        for kind, problem in problems.items():
            store.publish(TunedResult(device_kind=kind, problem=problem, median_ms=1.0,
                                      config=default_config(problem), **old))
    result = run_cli("stale", "--db", sqlite_db_url, "--output-dir", str(tmp_path),
                     env={"COLUMNS": "250"})
    assert result.returncode == 0, result.stderr
    files = sorted(tmp_path.glob("stale-flash-*.json"))
    assert len(files) == 2, files
    assert sorted(load_shapes(f)[0].q_len for f in files) == [256, 512]
    for f in files:
        assert f"--shapes {f} " in result.stdout


def test_device_kinds_whose_hashed_names_collide_get_a_shapes_file_each() -> None:
    """"X" hashes to the words of the kind "x c032adc1": each of the three gets its own file
    (the third overwrote the second's)."""
    taken: set[str] = set()
    for kind in ("x", "x c032adc1", "X"):
        taken.add(shapes_file_name("flash", kind, taken))
    assert len(taken) == 3, taken


def _timed_by_each(db_url: str) -> tuple[Problem, Problem]:
    """Two entries under this environment's versions on a v5e, one timed by the retired
    ``profile`` and one by ``step_profile``: their problems, in that order."""
    retired, current = _problem(256), _problem(512)
    with Store(db_url) as store:
        for problem, timing in ((retired, "profile"), (current, "step_profile")):
            store.publish(TunedResult(device_kind="TPU v5 lite", problem=problem,
                                      median_ms=1.0, config=default_config(problem),
                                      timing=timing, **INSTALLED))
    return retired, current


def test_a_result_timed_by_the_retired_profile_method_is_stale_and_says_why(
        sqlite_db_url: str, tmp_path: Path) -> None:
    """``profile`` timed the named kernels only (on a v5e 13% under flash's whole step): an
    entry it timed is stale under this environment's versions, listed with the reason and a
    re-tune command; one timed by ``step_profile`` is not."""
    retired, current = _timed_by_each(sqlite_db_url)
    with Store(sqlite_db_url) as store:
        stored = {e.result.problem: e.result for e in store.list(limit=None)[0]}
    assert stored[retired].stale_versions() == \
        "timing profile (the named kernels only, not the whole step)"
    assert stored[current].stale_versions() == ""
    result = run_cli("stale", "--db", sqlite_db_url, "--output-dir", str(tmp_path),
                     env={"COLUMNS": "250"})
    assert result.returncode == 0, result.stderr
    assert retired.label() in result.stdout and current.label() not in result.stdout
    assert "timing profile (the named kernels only, not the whole step)" in result.stdout
    assert load_shapes(tmp_path / "stale-flash-tpu-v5-lite.json") == [retired]


def test_the_resolver_marks_a_service_answer_timed_by_profile_stale(sqlite_db_url: str,
                                                                    start_server) -> None:
    """The service's answer carries the entry's timing, so a config the retired ``profile``
    timed resolves marked stale, with the reason; one timed by ``step_profile`` does not."""
    from kernel.resolve import Resolver, ResolverSettings
    from kernel.targets import TARGETS

    retired, current = _timed_by_each(sqlite_db_url)
    resolver = Resolver(ResolverSettings(url=start_server(sqlite_db_url).url, timeout_s=10))
    stale = {problem: resolver.resolve(problem, "TPU v5 lite", "flash", TARGETS["v5e"])
             for problem in (retired, current)}
    assert stale[retired].source == stale[current].source == "service"
    assert stale[retired].stale == "timing profile (the named kernels only, not the whole step)"
    assert stale[current].stale == ""
