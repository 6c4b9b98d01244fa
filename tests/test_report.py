"""``autotune report`` and the plots it shares with the service.

A real small tuning run (``autotune tune`` on the CPU, once for the module) is reported as one
self-contained HTML file; a study with failures, written through Optuna into a real SQLite
file, checks what each plot draws (cells, lines, boxes, bars), not its pixels; the same
database opens in optuna-dashboard with readable parameters and user attributes.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import httpx
import numpy as np
import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from matplotlib.figure import Figure
from optuna.trial import TrialState, create_trial

from autotune.report import render
from autotune.tune import study_name
from conftest import free_port, run_cli, wait_until_answering
from kernel import FlashConfig, Problem, get_kernel
from kernel.table import KernelChoice, KernelTiming
from present.plots import (
    LABEL_WIDTH,
    choice_figure,
    confirmation_figure,
    convergence_figure,
    data_uri,
    failures_figure,
    landscape_figure,
)
from present.studies import FAILURE_LETTERS, StudyData
from present.views import problem_view
from storage import Store, TunedResult, upgrade
from storage.studies import get_storage

TUNED = Problem(1, 1, 1, 256, 256, 128, "float32", False, "fwd")
FAILING = Problem(1, 2, 2, 512, 512, 128, "bfloat16", False, "fwd")
FAILING_STUDY = "flash/TPU v5 lite/" + FAILING.label()
DEFAULT = FlashConfig(block_q=256, block_kv=256, block_kv_compute=128, pipeline_depth=2)
WINNER = DEFAULT.replace(block_q=128, block_kv=128)
IMPORTED = DEFAULT.replace(block_q=128, block_kv=256, pipeline_depth=2)  # measured, not confirmed
PNG = b"\x89PNG\r\n\x1a\n"
EXTERNAL = re.compile(r"""\b(?:src|href)\s*=\s*["']?\s*(?:[a-z][a-z0-9+.-]*:)?//""", re.I)


@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite file holding a real (small) ``autotune tune`` run on this machine's CPU: flash
    tuned, xla confirmed, and the kernel choice between them."""
    url = f"sqlite:///{tmp_path_factory.mktemp('tuned') / 'autotune.db'}"
    tuned = run_cli("tune", "--kernels", "flash,xla", "--q-len", "256", "--q-heads", "1",
                    "--head-dim", "128", "--dtype", "float32", "--trials", "5", "--db", url,
                    timeout=300)
    assert tuned.returncode == 0, tuned.stderr
    return url


# --- a study with failures: every (block_q, block_kv, depth) of a 3 x 3 x 2 grid ---

SPACE = {"block_q": [128, 256, 512], "block_kv": [128, 256, 512], "block_kv_compute": [128],
         "pipeline_depth": [2, 3]}
OOM = "RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem. Used 140M of 128M"
MOSAIC = "Mosaic failed to compile: unsupported layout"


def _outcome(q: int, kv: int, depth: int) -> tuple[str, float | None]:
    if q == 512 and kv == 512:
        return "vmem_oom", None
    if q == 512 and kv == 256 and depth == 3:
        return "compile_error", None
    return "ok", 1 + q / 512 + kv / 1024 + depth / 10


def _write_failing_study(url: str) -> None:
    """The study as ``autotune tune`` stores it (params, user attrs, confirmation)."""
    study = optuna.create_study(study_name=FAILING_STUDY, storage=url)
    study.set_user_attr("params", SPACE)
    study.set_user_attr("problem", FAILING.to_dict())
    study.set_user_attr("device_kind", "TPU v5 lite")
    distributions = {n: CategoricalDistribution(v) for n, v in SPACE.items()}
    cells = [(q, kv, d) for d in (2, 3) for q in (512, 256, 128) for kv in (512, 256, 128)]
    for q, kv, d in cells[:-3]:  # three configs never measured: (128, *, 3)
        status, value = _outcome(q, kv, d)
        params = {"block_q": q, "block_kv": kv, "block_kv_compute": 128, "pipeline_depth": d}
        attrs = {"status": status, "compile_s": 2.5}
        if status != "ok":
            attrs["error"] = f"{OOM if status == 'vmem_oom' else MOSAIC}\n  at line 3"
        study.add_trial(create_trial(
            params=params, distributions=distributions, user_attrs=attrs, value=value,
            state=TrialState.COMPLETE if value is not None else TrialState.PRUNED))
    study.set_user_attr("confirmation", [
        {"config": DEFAULT.to_dict(), "samples_ms": [2.0, 2.1, 2.3, 1.9, 2.2],
         "median_ms": 2.1, "iqr_ms": 0.2, "is_default": True, "is_winner": False},
        {"config": WINNER.to_dict(), "samples_ms": [1.5, 1.6, 1.55, 1.7],
         "median_ms": 1.575, "iqr_ms": 0.1, "is_default": False, "is_winner": True}])


@pytest.fixture(scope="module")
def failing_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A SQLite file with the failing study and its published winner."""
    url = f"sqlite:///{tmp_path_factory.mktemp('failing') / 'autotune.db'}"
    upgrade(url)
    _write_failing_study(url)
    with Store(url) as store:
        store.publish(TunedResult(
            device_kind="TPU v5 lite", problem=FAILING, config=WINNER, median_ms=1.575,
            iqr_ms=0.1, default_median_ms=2.1, trials=15, method="device",
            timing="step_profile", kernel_median_ms=1.26, achieved_tflops=2.72,
            roofline_fraction=0.014, roofline_bound="compute", study=FAILING_STUDY))
    return url


@pytest.fixture(scope="module")
def failing(failing_db: str) -> StudyData:
    with Store(failing_db) as store:
        data = StudyData.load(get_storage(store.url, create=False), FAILING_STUDY)
    assert data is not None
    return data


# --- the report file ---


class _Page(HTMLParser):
    """The report's sections (by class) and the images inside each, per problem."""

    def __init__(self) -> None:
        super().__init__()
        self.problems: dict[str, dict[str, list[str]]] = {}
        self.index_rows = 0
        self._problem: str | None = None
        self._section: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "tr" and a.get("class") == "index-row":
            self.index_rows += 1
        if tag == "section" and a.get("class") == "problem":
            self._problem = a["id"] or ""
            self.problems[self._problem] = {}
        elif tag == "section" and self._problem is not None:
            self._section = a.get("class") or ""
            self.problems[self._problem][self._section] = []
        elif tag == "img" and self._problem is not None and self._section is not None:
            self.problems[self._problem][self._section].append(a.get("src") or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "section":
            if self._section is not None:
                self._section = None
            else:
                self._problem = None


def _parse(html: str) -> _Page:
    page = _Page()
    page.feed(html)
    return page


def _png(src: str) -> bytes:
    assert src.startswith("data:image/png;base64,"), src[:40]
    return base64.b64decode(src.split(",", 1)[1])


def test_report_of_a_tuning_run(tuned_db: str, tmp_path: Path) -> None:
    output = tmp_path / "report.html"
    result = run_cli("report", "--db", tuned_db, "-o", str(output))
    assert result.returncode == 0, result.stderr
    assert str(output) in result.stdout
    html = output.read_text()
    assert not EXTERNAL.findall(html), "the report must not load anything from elsewhere"
    page = _parse(html)
    assert page.index_rows == 2  # one per kernel
    assert TUNED.label() in html and "<h2" in html and ">cpu</h2>" in html
    flash, xla = page.problems.values()
    assert list(flash) == ["choice", "landscape", "convergence", "confirmation", "failures"]
    assert list(xla) == ["choice"]  # a one-config kernel has no study
    assert "Kernel <code>xla</code> has no tunable fields" in html  # not "imported", as once
    assert html.count("probably imported from a lookup table") == 0
    for name, sources in [*flash.items(), *xla.items()]:
        assert len(sources) == 1, name
        assert _png(sources[0]).startswith(PNG)
    with Store(tuned_db) as store:
        entry = next(e for e in store.list()[0] if e.result.kernel == "flash")
        [stored] = store.list_choices()[0]
    assert entry.result.trials == 5
    # The default kept within the noise says so (CPU timings often are within noise).
    noise = ", within noise" if stored.choice.provenance.get("within_noise") else ""
    assert f"{stored.choice.kernel} (chosen{noise})" in html
    assert f"{entry.result.speedup:.2f}×" in html
    assert "No failures" in html
    # Issue 55 item 5: where each figure comes from, and that the confirmation re-ranks.
    assert 'id="re-ranks"' in html and "<th>median (ms, confirmation)</th>" in html
    assert "<th>median (ms, kernel choice)</th>" in html
    assert "kernel's time here can differ from its median there" in " ".join(html.split())
    # Timed by wall clock on the CPU, where no roofline figure is made up (index rows of both
    # kernels, and the summary).
    assert len(re.findall(r'<td>wallclock</td>\s*<td class="roofline">–</td>', html)) == 2
    # Nor a kernels' share: wall clock times the step alone.
    assert len(re.findall(r'<td class="num kernel-share">–</td>', html)) == 2
    assert re.search(r'<th>roofline</th><td class="roofline">–</td>', html)


def test_report_names_each_distinct_error(failing_db: str, tmp_path: Path) -> None:
    output = tmp_path / "report.html"
    result = run_cli("report", "--db", failing_db, "--device-kind", "TPU v5 lite",
                     "--dtype", "bfloat16", "-o", str(output))
    assert result.returncode == 0, result.stderr
    html = output.read_text()
    assert not EXTERNAL.findall(html)
    assert OOM in html and MOSAIC in html and "at line 3" not in html  # first lines only
    row = re.search(r"<td>vmem_oom</td><td class=\"num\">(\d+)</td>", html)
    assert row and int(row.group(1)) == 2  # (512, 512) at both depths
    assert "<td>step_profile</td>" in html
    assert html.count("2.7 TFLOP/s, 1% of compute roof") == 2  # the index and the summary


def test_report_shows_the_kernels_share_of_the_step(failing_db: str) -> None:
    """The median is the whole step's device time; its named kernels' part (1.26 of 1.575
    ms) is shown beside it, in the index and the summary."""
    with Store(failing_db) as store:
        html = " ".join(render(store).split())
    assert "<th>kernels' share</th>" in html
    assert '<td class="num">1.575</td> <td class="num kernel-share">80%</td>' in html
    assert '<td class="kernel-share">1.260 ms, 80% of the step</td>' in html
    assert 'class="stale"' not in html  # step_profile is the current method


def test_report_on_an_empty_database_says_so(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    upgrade(url)
    output = tmp_path / "report.html"
    result = run_cli("report", "--db", url, "-o", str(output))
    assert result.returncode == 1
    assert "no tuned configs in" in result.stderr and "autotune tune" in result.stderr
    assert not output.exists()


def test_report_on_an_unknown_device_names_the_known_ones(failing_db: str,
                                                          tmp_path: Path) -> None:
    output = tmp_path / "report.html"
    result = run_cli("report", "--db", failing_db, "--device-kind", "TPU v9", "-o",
                     str(output))
    assert result.returncode == 1
    assert "device_kind='TPU v9'" in result.stderr and "'TPU v5 lite'" in result.stderr
    assert not output.exists()
    bad = run_cli("report", "--db", failing_db, "--dtype", "float8", "-o", str(output))
    assert bad.returncode == 2 and "--dtype" in bad.stderr and "bfloat16" in bad.stderr


# --- what the plots draw ---


def test_study_data_reads_measurements_failures_and_errors(failing: StudyData) -> None:
    assert len(failing.points) == 15
    statuses = [p.status for p in failing.points]
    assert statuses.count("vmem_oom") == 2 and statuses.count("compile_error") == 1
    assert failing.outcomes() == {"ok": 12, "vmem_oom": 2, "compile_error": 1}
    assert list(failing.outcomes()) == ["ok", "vmem_oom", "compile_error"]
    assert failing.errors() == [("compile_error", MOSAIC, 1), ("vmem_oom", OOM, 2)]
    ok = [p.value_ms for p in failing.points if p.value_ms is not None]
    assert failing.curve()[-1] == min(ok)
    curve = [v for v in failing.curve() if v is not None]
    assert curve == sorted(curve, reverse=True)


def test_landscape_draws_one_cell_per_measured_block_pair_per_depth(
        failing: StudyData) -> None:
    figure = landscape_figure(failing)
    panels = [ax for ax in figure.axes if ax.get_title().startswith("pipeline_depth=")]
    assert [ax.get_title() for ax in panels] == ["pipeline_depth=2", "pipeline_depth=3"]
    for ax, depth in zip(panels, (2, 3), strict=True):
        points = [p for p in failing.points if p.params["pipeline_depth"] == depth]
        cells = {(p.params["block_q"], p.params["block_kv"]) for p in points}
        ok_cells = {(p.params["block_q"], p.params["block_kv"]) for p in points if p.value_ms}
        assert len(ax.texts) == len(cells)
        assert int(np.ma.count(ax.images[0].get_array())) == len(ok_cells)
        hatched = [p for p in ax.patches if p.get_hatch()]
        assert len(hatched) == len(cells - ok_cells)
        letters = sorted(t.get_text() for t in ax.texts if not t.get_text()[0].isdigit())
        expected = sorted(FAILURE_LETTERS[p.status] for p in points
                          if (p.params["block_q"], p.params["block_kv"]) not in ok_cells)
        assert letters == expected
    shown = np.ma.concatenate([ax.images[0].get_array().ravel() for ax in panels])
    for ax in panels:  # one colour scale: the fastest and slowest cell over all panels
        assert (ax.images[0].norm.vmin, ax.images[0].norm.vmax) == (shown.min(), shown.max())
    winner_frames = [p for ax in panels for p in ax.patches
                     if not p.get_fill() and p.get_linewidth() > 2]
    assert len(winner_frames) == 1  # only in the depth-2 panel


def test_the_winner_is_framed_when_a_plotted_field_has_one_value(failing: StudyData) -> None:
    """A confirmed config lists the searched fields only: with one block_q in the space the
    winner was never framed (tuning a q_len of 128 has one)."""
    one_row = dataclasses.replace(
        failing, space={**failing.space, "block_q": [WINNER.block_q]},
        points=[p for p in failing.points if p.params["block_q"] == WINNER.block_q],
        confirmation=tuple(dataclasses.replace(c, params={
            k: v for k, v in c.params.items() if k != "block_q"}) for c in failing.confirmation))
    figure = landscape_figure(one_row)
    frames = [p for ax in figure.axes for p in ax.patches
              if not p.get_fill() and p.get_linewidth() > 2]
    assert len(frames) == 1
    assert "red frame: the confirmed winner" in " ".join(figure.get_suptitle().split())


def test_convergence_draws_best_so_far_and_the_default(failing: StudyData) -> None:
    ax = convergence_figure(failing).axes[0]
    best = next(line for line in ax.lines if line.get_label() == "best so far")
    curve = np.array([np.nan if v is None else v for v in failing.curve()])
    assert np.allclose(best.get_ydata(), curve, equal_nan=True)
    default = failing.default_point()
    assert default is not None
    (line,) = [line for line in ax.lines if line.get_label().startswith("default, search")]
    assert set(line.get_ydata()) == {default.value_ms}
    failed = next(line for line in ax.lines if line.get_label() == "failed")
    assert len(failed.get_xdata()) == len(failing.failed)


def test_confirmation_draws_every_sample(failing: StudyData) -> None:
    ax = confirmation_figure(failing).axes[0]
    dots = [c.get_offsets() for c in ax.collections]
    assert [len(d) for d in dots] == [len(c.samples_ms) for c in failing.confirmation]
    for offsets, confirmed in zip(dots, failing.confirmation, strict=True):
        assert sorted(offsets[:, 0]) == sorted(confirmed.samples_ms)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels[0].endswith("(default)") and labels[1].endswith("(winner)")


def test_failures_draws_one_bar_per_outcome(failing: StudyData) -> None:
    ax = failures_figure(failing).axes[0]
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert names == ["ok", "vmem_oom", "compile_error"]
    assert [p.get_width() for p in ax.patches] == [12, 2, 1]


def test_choice_draws_each_candidates_median_and_spread_and_marks_the_chosen() -> None:
    choice = KernelChoice(TUNED, "xla", get_kernel("xla").default_config(TUNED), {
        "flash": KernelTiming(2.0, 0.4), "xla": KernelTiming(0.5, 0.1),
        "jax_tpu_flash": KernelTiming(failure="compile_error")})
    ax = choice_figure(choice).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["flash", "xla", "jax_tpu_flash"]
    assert [p.get_width() for p in ax.patches] == [2.0, 0.5, 0.0]
    chosen = [p.get_facecolor() for p in ax.patches]
    assert chosen[1] != chosen[0] == chosen[2]  # only the chosen bar stands out
    [whiskers] = [c for c in ax.collections if len(c.get_segments()) == 3]
    spans = [segment[1][0] - segment[0][0] for segment in whiskers.get_segments()]
    assert spans == pytest.approx([0.4, 0.1, 0.0])
    labels = [t.get_text() for t in ax.texts]
    assert labels == ["2.000 ms", "0.500 ms (chosen)", "failed: compile_error"]
    # Issue 55 item 5: not called "confirmed" like the config confirmation's (other) times.
    assert ax.get_xlabel().startswith("median time per call in the kernel choice's rounds")


# --- optuna-dashboard ---


@pytest.fixture
def dashboard(tuned_db: str, tmp_path: Path) -> Iterator[str]:
    """optuna-dashboard on the tuned database, on a free loopback port."""
    executable = Path(sys.executable).with_name("optuna-dashboard")
    if not executable.exists():
        pytest.fail("optuna-dashboard is not installed; pip install -e '.[test]'")
    port = free_port()
    command = [str(executable), tuned_db,
               "--host", "127.0.0.1", "--port", str(port)]
    log = tmp_path / "dashboard.log"
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answering(process, f"{url}/api/studies", "optuna-dashboard", log.read_text)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=15)


def test_optuna_dashboard_shows_the_study(dashboard: str) -> None:
    studies = httpx.get(f"{dashboard}/api/studies", timeout=10).json()["study_summaries"]
    (summary,) = studies
    assert summary["study_name"] == study_name(TUNED, "cpu", get_kernel("flash"), "wallclock")
    study_attrs = {a["key"] for a in summary["user_attrs"]}
    assert {"problem", "device_kind", "confirmation", "params"} <= study_attrs
    detail = httpx.get(f"{dashboard}/api/studies/{summary['study_id']}", params={"after": 0},
                       timeout=10).json()
    declared = json.loads(next(a["value"] for a in summary["user_attrs"]
                               if a["key"] == "params"))
    assert len(detail["trials"]) >= 5
    for trial in detail["trials"]:
        params = {p["name"]: p["param_external_value"] for p in trial["params"]}
        assert {"block_q", "block_kv", "pipeline_depth"} <= params.keys()
        for name, value in params.items():  # the real block sizes, not indices
            assert int(value) in declared[name], (name, value)
        attrs = {a["key"]: a["value"] for a in trial["user_attrs"]}
        assert attrs["status"] == "ok" and float(attrs["compile_s"]) > 0


def test_a_fwd_bwd_confirmation_draws_without_a_layout_warning(failing: StudyData) -> None:
    """Issue 46 item 11: a fwd_bwd config's 70-character label on one line left the
    confirmation axes no width, and matplotlib warned on every report (constrained_layout not
    applied); labels are wrapped and the figure grows with their lines."""
    data = dataclasses.replace(failing, confirmation=tuple(
        dataclasses.replace(c, config_label=DEFAULT.replace(**c.params).label("fwd_bwd"))
        for c in failing.confirmation))
    assert min(len(c.label) for c in data.confirmation) > 2 * LABEL_WIDTH  # three lines
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert data_uri(confirmation_figure(data)).startswith("data:image/png")


def test_the_report_s_figures_say_where_they_come_from(failing: StudyData) -> None:
    """Issue 55 item 5: one report showed the winner framed on a 20.2 ms cell beside a 9.37 ms
    one, the default at 29.6 ms (search) and 11.3 ms (confirmation) unlabelled, and the
    confirmation's labels (``q_dkv128 kv_dkv256 ...``) unlike the summary's
    (``dkv128x256/depth3``): the confirmation's configs carry their kernel's label, the frame
    sits on the winner's cell and says its confirmed time, and both default times are named."""
    assert [c.label for c in failing.confirmation] == [
        f"{DEFAULT.label('fwd')} (default)", f"{WINNER.label('fwd')} (winner)"]
    labels = [t.get_text().replace("\n", " ") for t in
              confirmation_figure(failing).axes[0].get_yticklabels()]
    assert labels == [c.label for c in failing.confirmation]
    figure = landscape_figure(failing)
    assert _framed_cell(figure) == _cell(WINNER)
    title = " ".join(figure.get_suptitle().split())
    assert "cells: best search time" in title and "(1.57 ms in the confirmation" in title
    lines = {line.get_label() for line in convergence_figure(failing).axes[0].lines}
    assert {"default, search (1.95 ms)", "default, confirmation median (2.1 ms)"} <= lines


def _cell(config: FlashConfig) -> tuple[str, int, int]:
    """The landscape panel and (block_q, block_kv) cell of ``config``."""
    return f"pipeline_depth={config.pipeline_depth}", config.block_q, config.block_kv


def _framed_cell(figure: Figure) -> tuple[str, int, int]:
    """The panel and (block_q, block_kv) cell of the landscape's one red frame (block_q along
    the columns, block_kv along the rows)."""
    [(ax, frame)] = [(ax, p) for ax in figure.axes for p in ax.patches
                     if not p.get_fill() and p.get_linewidth() > 2]
    column, row = (round(frame.get_x() + frame.get_width() / 2),
                   round(frame.get_y() + frame.get_height() / 2))
    return ax.get_title(), SPACE["block_q"][column], SPACE["block_kv"][row]


def test_a_winner_stored_from_elsewhere_is_the_one_the_page_frames(failing_db: str,
                                                                   tmp_path: Path) -> None:
    """Issue 55 item 5: a table from another machine that tuned the same problem (so the same
    study name) replaced the winner of this database's study, whose confirmation had chosen
    another config: the summary named the imported winner while the landscape framed the
    study's pick and the confirmation plot called that one the winner."""
    table = tmp_path / "table.json"
    exported = run_cli("export", "--db", failing_db, "--device-kind", "TPU v5 lite",
                       "-o", str(table))
    assert exported.returncode == 0, exported.stderr
    data = json.loads(table.read_text())
    [entry] = data["entries"]
    entry["config"], entry["time_ms"] = IMPORTED.to_dict(), 1.2
    table.write_text(json.dumps(data))
    url = f"sqlite:///{tmp_path / 'autotune.db'}"
    upgrade(url)
    _write_failing_study(url)
    imported = run_cli("import", str(table), "--db", url)
    assert imported.returncode == 0, imported.stderr
    with Store(url) as store:
        [stored] = store.list()[0]
        view = problem_view(stored, get_storage(url, create=False))
    assert stored.result.config == IMPORTED and view.study is not None
    assert _framed_cell(landscape_figure(view.study)) == _cell(IMPORTED)
    assert [c.label for c in view.study.confirmation if c.is_winner] == []
    output = tmp_path / "report.html"
    assert run_cli("report", "--db", url, "-o", str(output)).returncode == 0
    assert 'id="not-confirmed-here"' in output.read_text()


def test_the_confirmation_table_shows_each_config_s_search_time(failing_db: str) -> None:
    """Issue 55 item 5: the default ran 29.6 ms in the search and 11.3 ms in the confirmation,
    and only the convergence's legend had the first: the confirmation's table puts each
    config's search time beside its confirmation median."""
    with Store(failing_db) as store:
        html = " ".join(render(store).split())
    assert "<th>search (ms)</th><th>median (ms, confirmation)</th>" in html
    for config, role, search, median in ((DEFAULT, "default", 1.95, 2.1),
                                         (WINNER, "winner", 1.575, 1.575)):
        assert (f'<td><code>{config.label("fwd")} ({role})</code></td> '
                f'<td class="num">{search:.3f}</td><td class="num">{median:.3f}</td>') in html


def test_a_confirmed_config_its_kernel_cannot_read_is_named_not_relabelled(
        failing_db: str, tmp_path: Path) -> None:
    """Issue 55 item 5: one label format: a confirmed config is labelled by its kernel, as the
    summary's winner, or the study is named as unreadable (it was labelled by its searched
    fields, ``q128 kv128 depth2``, a format of its own)."""
    url = f"sqlite:///{tmp_path / 'autotune.db'}"
    upgrade(url)
    _write_failing_study(url)
    study = optuna.load_study(study_name=FAILING_STUDY, storage=url)
    study.set_user_attr("confirmation", [{**c, "config": {**c["config"], "block_x": 1}}
                                         for c in study.user_attrs["confirmation"]])
    with Store(failing_db) as store:
        [entry] = store.list()[0]
    view = problem_view(entry, get_storage(url, create=False))
    assert view.study is None and "block_x" in view.unreadable_study
