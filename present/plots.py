"""The four figures of a tuning study (landscape, convergence, confirmation, failures), and
the kernel choice's bar chart, drawn with matplotlib's object API (no pyplot state, so server
threads may draw at once, always with the Agg canvas) and rendered as PNG data URIs by
:func:`images` and :func:`choice_image`.

The landscape's axes come from the tuned kernel's contract
(``kernel.registry.TunableKernel.landscape_axes``), so every kernel's report shows its own
fields."""

from __future__ import annotations

import base64
import io
import logging
import textwrap
from collections.abc import Callable

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from kernel import ConfigError, get_kernel
from kernel.table import KernelChoice
from present.studies import StudyData, failure_letter
from present.text import first_line
from storage.studies import OK

LABEL_WIDTH = 30  # characters per line of a config label on an axis
PLOTS = ("landscape", "convergence", "confirmation", "failures")
MAX_CHOICE_BARS = 20  # candidates a choice's chart draws (fastest first); the rest counted
_DPI = 100
log = logging.getLogger(__name__)
# Names and error texts are data: "$...$" in them is drawn as typed, not as mathtext.
_PLAIN_TEXT = {"text.parse_math": False}


def _figure(width: float, height: float) -> Figure:
    return Figure(figsize=(width, height), dpi=_DPI, layout="constrained")


def landscape_axes(data: StudyData) -> tuple[str, str, str] | None:
    """The tuned kernel's landscape fields (x, y, panel), or None when the kernel is not
    registered here or the study did not search both the x and the y field."""
    try:
        axes = get_kernel(data.kernel).landscape_axes
    except ConfigError:
        return None
    searched = len(axes) == 3 and axes[0] in data.space and axes[1] in data.space
    return axes if searched else None  # a kernel with no tunable field has no landscape


def landscape_figure(data: StudyData) -> Figure:
    """Best time per cell of the kernel's x and y fields, one panel per value of its panel
    field (the best over the other fields; :func:`landscape_axes`); cells where only failures
    were measured are hatched and lettered by failure class (a cell with both shows its time
    and ``+`` the letters), cells never measured stay blank, and the winner's cell
    (``StudyData.winner_params``) is framed. Raises ValueError when the study has no
    landscape."""
    axes_fields = landscape_axes(data)
    if axes_fields is None:
        raise ValueError(f"study {data.name!r} of kernel {data.kernel!r} has no landscape")
    x, y, panel = axes_fields  # x along the columns, y down the rows
    rows, columns = data.space[y], data.space[x]
    depths = data.space.get(panel, [None])
    panels = {}  # depth -> (best time per cell, failure classes per cell, measured cells)
    for depth in depths:
        best = np.full((len(rows), len(columns)), np.nan)
        failures: dict[tuple[int, int], set[str]] = {}
        measured = set()
        for p in data.points:
            if depth is not None and p.params.get(panel) != depth:
                continue
            i, j = rows.index(p.params[y]), columns.index(p.params[x])
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
    # A confirmed config lists the searched fields; a field with one value is that value.
    fixed = {name: values[0] for name, values in data.space.items() if len(values) == 1}
    winner = None if data.winner_params is None else {**fixed, **data.winner_params}
    if winner is not None and not (winner.get(y) in rows and winner.get(x) in columns):
        winner = None  # a stored winner outside the searched values has no cell
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
        if winner is not None and (depth is None or winner.get(panel) == depth):
            i, j = rows.index(winner[y]), columns.index(winner[x])
            ax.add_patch(Rectangle((j - 0.48, i - 0.48), 0.96, 0.96, fill=False,
                                   edgecolor="#e74c3c", linewidth=2.5))
        ax.set_xticks(range(len(columns)), [str(c) for c in columns])
        ax.set_yticks(range(len(rows)), [str(r) for r in rows])
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.set_title(f"{panel}={depth}" if depth is not None else "all configs", fontsize=10)
    if image is not None and times:
        figure.colorbar(image, ax=list(axes), label="best time (ms), lower is better",
                        shrink=0.9)
    notes = ["cells: best search time"]
    confirmed = data.winner()
    if winner is not None and confirmed is not None:
        notes.append(f"red frame: the confirmed winner ({confirmed.median_ms:.3g} ms in the "
                     "confirmation, which re-measures the best and re-ranks them)")
    elif winner is not None:
        notes.append("red frame: the stored winner, which this study's confirmation did not "
                     "measure (stored from elsewhere)")
    classes = sorted({p.status for p in data.failed})
    if classes:
        notes.append("hatched: only failures; " + ", ".join(
            f"{failure_letter(c)} = {c}" for c in classes))
    figure.suptitle(textwrap.fill("; ".join(notes), 110), fontsize=9)
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
                   label=f"default, search ({default.value_ms:.3g} ms)")
    if confirmed_default is not None:
        ax.axhline(confirmed_default.median_ms, color="#d35400", linestyle=":", linewidth=1.5,
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
    # A fwd_bwd config's label runs to 70 characters: on one line it left the axes no width
    # (matplotlib: "constrained_layout not applied because axes sizes collapsed to zero").
    labels = [textwrap.fill(c.label, LABEL_WIDTH) for c in items]
    lines = sum(label.count("\n") + 1 for label in labels)
    figure = _figure(6.4, 0.9 + 0.55 * max(len(items), 0.6 * lines))
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
    ax.set_yticks(positions, labels, fontsize=8)
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


def choice_figure(choice: KernelChoice) -> Figure:
    """Every candidate kernel's median in the kernel choice's own rounds (not its config
    confirmation's) with its spread (IQR), the chosen one marked; a failed candidate is a
    labelled row without a bar."""
    ranked = choice.ranked()
    shown = {*[*ranked, *(n for n in choice.candidates if n not in ranked)][:MAX_CHOICE_BARS]}
    names = [name for name in choice.candidates if name in shown]  # in the choice's order
    figure = _figure(6.4, 0.9 + 0.45 * len(names))
    ax = figure.subplots()
    timings = [choice.candidates[name] for name in names]
    medians = [t.median_ms or 0.0 for t in timings]
    spreads = [t.iqr_ms or 0.0 for t in timings]
    colors = ["#27ae60" if name == choice.kernel else "#95a5a6" for name in names]
    bars = ax.barh(names, medians, xerr=[[s / 2 for s in spreads], [s / 2 for s in spreads]],
                   color=colors, capsize=4, error_kw={"elinewidth": 1})
    ax.bar_label(bars, labels=[
        f"failed: {t.failure}" if t.failure else
        f"{t.median_ms:.3f} ms" + (" (chosen)" if name == choice.kernel else "")
        for name, t in zip(names, timings, strict=True)], padding=6, fontsize=8)
    ax.invert_yaxis()
    left_out = len(choice.candidates) - len(names)
    ax.set_xlabel("median time per call in the kernel choice's rounds (ms); whiskers: IQR"
                  + (f"; {left_out} slower or failed candidates not shown" if left_out else ""))
    ax.set_xlim(0, max(m + s / 2 for m, s in zip(medians, spreads, strict=True)) * 1.45 or 1)
    return figure


def choice_image(choice: KernelChoice) -> dict[str, str]:
    """The choice's bar chart as ``{"choice": data URI}`` (or why not: :func:`drawn`)."""
    return drawn({"choice": lambda: choice_figure(choice)})


def drawn(drawers: dict[str, Callable[[], Figure]]) -> dict[str, str]:
    """Each figure as a data URI by name; a figure that cannot be drawn (data at the edge of
    what matplotlib takes: a time of 1e308 ms, ...) is left out, its name mapped under
    ``note:<name>`` to why, so one bad entry costs its plot, not the page or the report."""
    out = {}
    with matplotlib.rc_context(_PLAIN_TEXT):
        for name, draw in drawers.items():
            try:
                out[name] = data_uri(draw())
            except (ValueError, OverflowError, RuntimeError, KeyError, IndexError,
                    TypeError) as error:
                log.warning("plot %s not drawn: %s", name, error)
                out[f"note:{name}"] = f"{type(error).__name__}: {first_line(str(error))}"
    return out


def data_uri(figure: Figure) -> str:
    """The figure as a ``data:image/png;base64,...`` URI (renders with the Agg canvas)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=_DPI, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def images(data: StudyData) -> dict[str, str]:
    """The plots of ``data`` that have something to show, as data URIs, by name (PLOTS)."""
    drawers = {"landscape": landscape_figure, "convergence": convergence_figure,
               "confirmation": confirmation_figure, "failures": failures_figure}
    present = {"landscape": bool(data.points) and landscape_axes(data) is not None,
               "convergence": bool(data.points), "confirmation": bool(data.confirmation),
               "failures": bool(data.points)}
    return drawn({name: lambda name=name: drawers[name](data)
                  for name in PLOTS if present[name]})
