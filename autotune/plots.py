"""What a tuning run found, as data and as plots, for ``autotune report`` and the service's
pages alike (so this module never imports jax).

``read_storage`` opens the Optuna studies that ``autotune tune`` keeps next to the results,
``StudyData.load`` reads one of them, the ``*_figure`` functions draw it with matplotlib's
object API (no pyplot state, so server threads may draw at once, always with the Agg canvas)
and ``images`` renders all four as PNG data URIs. ``template_env`` is the Jinja2 environment
of the HTML templates in ``api/templates`` that both show them in.
"""

from __future__ import annotations

import base64
import importlib.util
import io
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import optuna
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from optuna.storages import BaseStorage, RDBStorage
from sqlalchemy import Engine, inspect

from autotune.failures import first_line
from autotune.search import OK, is_measurement, trial_status
from kernel import Problem, ProblemError
from storage import Entry

PLOTS = ("landscape", "convergence", "confirmation", "failures")
ROW, COLUMN, PANEL = "block_q", "block_kv", "pipeline_depth"
# One letter per failure class in the landscape; other classes get their first letter.
FAILURE_LETTERS = {"compile_error": "C", "vmem_oom": "V", "runtime_error": "R",
                   "wrong_result": "W", "timeout": "T"}
_ABBREVIATIONS = {"block_q": "q", "block_kv": "kv", "block_kv_compute": "kvc",
                  "pipeline_depth": "depth"}
_DPI = 100


def read_storage(url: str, engine: Engine) -> BaseStorage | None:
    """Optuna's storage on ``url`` for reading, or None when no study was ever stored there
    (then nothing is created: opening an Optuna storage normally creates its tables).
    ``engine`` is any engine on the same database (the store's), used to look."""
    if not inspect(engine).has_table("studies"):
        return None
    kwargs = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {}
    return RDBStorage(url, engine_kwargs=kwargs, skip_table_creation=True)


def failure_letter(status: str) -> str:
    return FAILURE_LETTERS.get(status, status[:1].upper() or "?")


def short_label(params: Mapping[str, Any]) -> str:
    """``q256 kv128 kvc128 depth2`` for the searched fields of a config."""
    return " ".join(f"{_ABBREVIATIONS.get(n, n.removeprefix('block_'))}{v}"
                    for n, v in params.items())


@dataclass(frozen=True)
class Point:
    """One measured config: ``status`` is ``ok`` (then ``value_ms`` is its time) or a
    failure class (then ``error`` is the first line of the message, if any)."""

    number: int
    params: dict[str, Any]
    status: str
    value_ms: float | None
    compile_s: float | None
    error: str | None


@dataclass(frozen=True)
class Confirmed:
    """A config re-measured against the default after the search, round by round."""

    params: dict[str, Any]
    samples_ms: tuple[float, ...]
    median_ms: float
    iqr_ms: float
    is_default: bool
    is_winner: bool

    @property
    def label(self) -> str:
        role = " (default)" if self.is_default else ""
        return short_label(self.params) + role + (" (winner)" if self.is_winner else "")


@dataclass(frozen=True)
class StudyData:
    """One tuning study: its searched space, its measured configs in order, and the
    confirmation of the winner (empty if the run stopped before it)."""

    name: str
    problem: Problem | None
    device_kind: str | None
    space: dict[str, list[Any]]  # declared values of each searched field
    points: tuple[Point, ...]
    confirmation: tuple[Confirmed, ...]

    @classmethod
    def load(cls, storage: BaseStorage, name: str) -> StudyData | None:
        """The study ``name``, or None if the storage has none of that name."""
        try:
            study = optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            return None
        return cls.from_study(study)

    @classmethod
    def from_study(cls, study: optuna.Study) -> StudyData:
        trials = sorted((t for t in study.get_trials(deepcopy=False) if is_measurement(t)),
                        key=lambda t: t.number)
        points = tuple(Point(
            number=t.number, params=dict(t.params), status=trial_status(t),
            value_ms=t.value if trial_status(t) == OK else None,
            compile_s=t.user_attrs.get("compile_s"),
            error=first_line(str(t.user_attrs["error"])) if t.user_attrs.get("error") else None)
            for t in trials)
        attrs = study.user_attrs
        space = {n: list(v) for n, v in attrs.get("params", {}).items()}
        for point in points:  # a study stored without its declared space: the values seen
            for n, v in point.params.items():
                if v not in space.setdefault(n, []):
                    space[n] = sorted([*space[n], v])
        try:
            problem = Problem.from_dict(attrs["problem"]) if "problem" in attrs else None
        except ProblemError:
            problem = None
        searched = [n for n in space if len(space[n]) > 1] or list(space)
        confirmation = tuple(Confirmed(
            params={n: c["config"][n] for n in searched if n in c["config"]},
            samples_ms=tuple(c["samples_ms"]), median_ms=c["median_ms"], iqr_ms=c["iqr_ms"],
            is_default=bool(c["is_default"]), is_winner=bool(c["is_winner"]))
            for c in attrs.get("confirmation", []))
        return cls(name=study.study_name, problem=problem,
                   device_kind=attrs.get("device_kind"), space=space, points=points,
                   confirmation=confirmation)

    @property
    def ok(self) -> list[Point]:
        return [p for p in self.points if p.status == OK]

    @property
    def failed(self) -> list[Point]:
        return [p for p in self.points if p.status != OK]

    def curve(self) -> list[float | None]:
        """The best time after each measured config (None until one succeeded)."""
        out: list[float | None] = []
        best = None
        for point in self.points:
            if point.value_ms is not None and (best is None or point.value_ms < best):
                best = point.value_ms
            out.append(best)
        return out

    def default_point(self) -> Point | None:
        """The default config's measurement during the search, if it was measured."""
        default = next((c for c in self.confirmation if c.is_default), None)
        if default is None:
            return None
        return next((p for p in self.points if p.status == OK
                     and all(p.params.get(n) == v for n, v in default.params.items())), None)

    def outcomes(self) -> Counter[str]:
        """Measured configs per status, ``ok`` first, then failure classes by count."""
        counts = Counter(p.status for p in self.points)
        return Counter({OK: counts.pop(OK, 0), **dict(counts.most_common())})

    def errors(self) -> list[tuple[str, str, int]]:
        """(failure class, first line of the error, how many configs) per distinct error."""
        counts = Counter((p.status, p.error) for p in self.failed if p.error)
        return [(status, error, n) for (status, error), n in
                sorted(counts.items(), key=lambda item: (item[0][0], -item[1]))]


# --- figures ---


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), dpi=_DPI, layout="constrained")


def landscape_figure(data: StudyData) -> Figure:
    """Best time per (block_q, block_kv) cell, one panel per pipeline depth (the best over
    the other fields); cells where only failures were measured are hatched and lettered by
    failure class (a cell with both shows its time and ``+`` the letters), cells never
    measured stay blank, and the confirmed winner's cell is framed."""
    rows, columns = data.space.get(ROW, []), data.space.get(COLUMN, [])
    depths = data.space.get(PANEL, [None])
    panels = {}  # depth -> (best time per cell, failure classes per cell, measured cells)
    for depth in depths:
        best = np.full((len(rows), len(columns)), np.nan)
        failures: dict[tuple[int, int], set[str]] = {}
        measured = set()
        for p in data.points:
            if depth is not None and p.params.get(PANEL) != depth:
                continue
            i, j = rows.index(p.params[ROW]), columns.index(p.params[COLUMN])
            measured.add((i, j))
            if p.value_ms is not None:
                best[i, j] = np.fmin(best[i, j], p.value_ms)
            else:
                failures.setdefault((i, j), set()).add(p.status)
        panels[depth] = best, failures, measured
    times = [t for best, _, _ in panels.values() for t in best[~np.isnan(best)]]
    low, high = (min(times), max(times)) if times else (0.0, 1.0)
    figure = _figure(0.6 + 3.4 * len(depths), 1.2 + 0.5 * max(len(rows), 3))
    axes = figure.subplots(1, len(depths), squeeze=False)[0]
    winner = next((c for c in data.confirmation if c.is_winner
                   and {ROW, COLUMN} <= c.params.keys()), None)
    image = None
    for ax, depth in zip(axes, depths, strict=True):
        best, failures, measured = panels[depth]
        image = ax.imshow(np.ma.masked_invalid(best), cmap="viridis_r", vmin=low, vmax=high,
                          origin="lower", aspect="auto")
        ax.set_facecolor("#f2f2f2")
        for i, j in sorted(measured):
            letters = "".join(sorted(failure_letter(s) for s in failures.get((i, j), ())))
            if np.isnan(best[i, j]):
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="#ffd8d8",
                                       edgecolor="#c0392b", hatch="///", linewidth=0.8))
                text, color = letters, "#7b1d12"
            else:
                text = f"{best[i, j]:.3g}" + (f"\n+{letters}" if letters else "")
                shade = (best[i, j] - low) / (high - low) if high > low else 0.0
                color = "white" if shade > 0.6 else "black"
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color=color,
                    fontweight="bold")
        if winner is not None and (depth is None or winner.params.get(PANEL) == depth):
            i, j = rows.index(winner.params[ROW]), columns.index(winner.params[COLUMN])
            ax.add_patch(Rectangle((j - 0.48, i - 0.48), 0.96, 0.96, fill=False,
                                   edgecolor="#e74c3c", linewidth=2.5))
        ax.set_xticks(range(len(columns)), [str(c) for c in columns])
        ax.set_yticks(range(len(rows)), [str(r) for r in rows])
        ax.set_xlabel(COLUMN)
        ax.set_ylabel(ROW)
        ax.set_title(f"{PANEL}={depth}" if depth is not None else "all configs", fontsize=10)
    if image is not None and times:
        figure.colorbar(image, ax=list(axes), label="best time (ms), lower is better",
                        shrink=0.9)
    notes = ["red frame: the confirmed winner"] if winner is not None else []
    classes = sorted({p.status for p in data.failed})
    if classes:
        notes.append("hatched: only failures; " + ", ".join(
            f"{failure_letter(c)} = {c}" for c in classes))
    if notes:
        figure.suptitle("; ".join(notes), fontsize=9)
    return figure


def convergence_figure(data: StudyData) -> Figure:
    """Best time so far against the number of measured configs, each measurement as a dot,
    failures as red ticks on the axis, and the default's time as a horizontal line."""
    figure = _figure(6.4, 3.4)
    ax = figure.subplots()
    x = np.arange(1, len(data.points) + 1)
    ok = [(i + 1, p.value_ms) for i, p in enumerate(data.points) if p.value_ms is not None]
    if ok:
        ax.scatter(*zip(*ok, strict=True), s=14, color="#7f8c8d", alpha=0.7, label="measured",
                   zorder=2)
    curve = [np.nan if v is None else v for v in data.curve()]
    ax.step(x, curve, where="post", color="#1f77b4", linewidth=2, label="best so far",
            zorder=3)
    failed = [i + 1 for i, p in enumerate(data.points) if p.status != OK]
    if failed:
        ax.plot(failed, [0.02] * len(failed), "x", color="#c0392b", markersize=7,
                transform=ax.get_xaxis_transform(), label="failed", clip_on=False)
    default = data.default_point()
    confirmed_default = next((c for c in data.confirmation if c.is_default), None)
    if default is not None:
        ax.axhline(default.value_ms, color="#d35400", linestyle="--", linewidth=1.5,
                   label=f"default ({default.value_ms:.3g} ms)")
    elif confirmed_default is not None:
        ax.axhline(confirmed_default.median_ms, color="#d35400", linestyle="--", linewidth=1.5,
                   label=f"default, confirmation median ({confirmed_default.median_ms:.3g} ms)")
    ax.set_xlabel("measured configs")
    ax.set_ylabel("time (ms)")
    ax.set_xlim(0.5, max(len(data.points), 1) + 0.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return figure


def confirmation_figure(data: StudyData) -> Figure:
    """Every confirmation sample of the confirmed configs (box and dots), the default and the
    winner marked, so their spread is as visible as their medians."""
    items = list(data.confirmation)
    figure = _figure(6.4, 0.9 + 0.55 * len(items))
    ax = figure.subplots()
    positions = np.arange(1, len(items) + 1)
    boxes = ax.boxplot([c.samples_ms for c in items], positions=positions,
                       orientation="horizontal", widths=0.5, showfliers=False,
                       patch_artist=True, medianprops={"color": "black"})
    rng = np.random.default_rng(0)  # fixed jitter: the same data draws the same picture
    for position, item, box in zip(positions, items, boxes["boxes"], strict=True):
        color = "#27ae60" if item.is_winner else "#d35400" if item.is_default else "#95a5a6"
        box.set_facecolor(color)
        box.set_alpha(0.35)
        jitter = rng.uniform(-0.15, 0.15, len(item.samples_ms))
        ax.scatter(item.samples_ms, position + jitter, s=16, color=color, zorder=3,
                   edgecolors="black", linewidths=0.4)
    ax.set_yticks(positions, [c.label for c in items], fontsize=8)
    ax.set_xlabel("time per call (ms), one dot per confirmation round")
    ax.grid(axis="x", alpha=0.3)
    return figure


def failures_figure(data: StudyData) -> Figure:
    """How many measured configs ended in each status: ok and each failure class."""
    outcomes = data.outcomes()
    figure = _figure(6.4, 0.8 + 0.4 * len(outcomes))
    ax = figure.subplots()
    names = list(outcomes)
    counts = [outcomes[n] for n in names]
    bars = ax.barh(names, counts, color=["#27ae60" if n == OK else "#c0392b" for n in names])
    ax.bar_label(bars, padding=3, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("measured configs")
    ax.set_xlim(0, max(counts + [1]) * 1.15)
    return figure


def data_uri(figure: Figure) -> str:
    """The figure as a ``data:image/png;base64,...`` URI (renders with the Agg canvas)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=_DPI, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def images(data: StudyData) -> dict[str, str]:
    """The plots of ``data`` that have something to show, as data URIs, by name (PLOTS)."""
    drawers = {"landscape": landscape_figure, "convergence": convergence_figure,
               "confirmation": confirmation_figure, "failures": failures_figure}
    present = {"landscape": bool(data.points) and ROW in data.space and COLUMN in data.space,
               "convergence": bool(data.points), "confirmation": bool(data.confirmation),
               "failures": bool(data.points)}
    return {name: data_uri(drawers[name](data)) for name in PLOTS if present[name]}


# --- templates ---


def templates_dir() -> Path:
    """``api/templates``, found without importing ``api`` (the report needs no web stack)."""
    spec = importlib.util.find_spec("api")
    if spec is None or spec.origin is None:
        raise RuntimeError("the api package is not installed; reinstall flash-autotune")
    return Path(spec.origin).parent / "templates"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def template_env() -> jinja2.Environment:
    """The templates with autoescaping and the number filters they use (``ms``, ``ratio``)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(templates_dir()),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters.update(ms=_ms, ratio=_ratio, short_label=short_label)
    return env



# --- what the templates show ---


@dataclass(frozen=True)
class ProblemView:
    """A stored winner with its tuning study (None when this database has none, e.g. the
    result was imported from a lookup table) and the study's plots as data URIs."""

    entry: Entry
    study: StudyData | None
    images: dict[str, str]
    anchor: str = ""

    @property
    def failures(self) -> int | None:
        return None if self.study is None else len(self.study.failed)


def problem_view(entry: Entry, storage: BaseStorage | None, anchor: str = "",
                 render: Callable[[StudyData], dict[str, str]] = images) -> ProblemView:
    """The view of ``entry``; ``render`` draws the study's plots (e.g. through a cache)."""
    name = entry.result.study
    study = StudyData.load(storage, name) if storage is not None and name else None
    return ProblemView(entry, study, render(study) if study else {}, anchor)
