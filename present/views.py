"""The Jinja2 templates (package data of :mod:`present`) shared by ``autotune report`` and the
service's pages, and what they show per stored winner."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jinja2
from optuna.storages import BaseStorage

from kernel.table import KernelChoice
from present.plots import choice_image, images, landscape_axes
from present.studies import StudyData
from present.text import first_line
from storage import Entry, StoredChoice, TunedResult


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _speedup(result: TunedResult) -> str:
    """The speedup over the default, marked when it was measured in interpret mode (a CPU
    running the TPU kernel's emulation), which says nothing of a device."""
    text = _ratio(result.speedup)
    if result.speedup is not None and result.method == "interpret":
        return f"{text} (interpret mode, not a device figure)"
    return text


def _roofline(result: TunedResult) -> str:
    """Achieved TFLOP/s and the fraction of the binding roof, as far as the result knows."""
    if result.achieved_tflops is None:
        return "–"
    text = f"{result.achieved_tflops:.1f} TFLOP/s"
    if result.roofline_fraction is None:
        return text
    return f"{text}, {result.roofline_fraction:.0%} of {result.roofline_bound} roof"


def _kernel_share(result: TunedResult) -> str:
    """The named kernels' part of the step's median and their share of it, where measured
    (``step_profile`` timing of a kernel that names its ``pallas_call``s)."""
    if result.kernel_share is None:
        return "–"
    return f"{_ms(result.kernel_median_ms)} ms, {result.kernel_share:.0%} of the step"


def template_env() -> jinja2.Environment:
    """The templates with autoescaping and the filters they use (``ms``, ``ratio``,
    ``speedup``, ``roofline``, ``kernel_share``)."""
    env = jinja2.Environment(loader=jinja2.PackageLoader("present"),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters.update(ms=_ms, ratio=_ratio, speedup=_speedup, roofline=_roofline,
                       kernel_share=_kernel_share)
    return env


@dataclass(frozen=True)
class ProblemView:
    """A stored winner with its tuning study (None when this database has none, e.g. the
    result was imported from a lookup table), the kernel choice stored for its problem (None
    when none), and their plots as data URIs (the choice's as ``choice``)."""

    entry: Entry
    study: StudyData | None
    images: dict[str, str]
    anchor: str = ""
    choice: StoredChoice | None = None
    unreadable_study: str = ""  # why the study of that name could not be read, if it could not

    def note(self, plot: str) -> str | None:
        """Why ``plot`` was not drawn (present.plots.drawn), or None."""
        return self.images.get(f"note:{plot}")

    @property
    def axes(self) -> tuple[str, str, str] | None:
        """The landscape's (x, y, panel) fields, None without one."""
        return None if self.study is None else landscape_axes(self.study)

    @property
    def failures(self) -> int | None:
        return None if self.study is None else len(self.study.failed)


def problem_view(entry: Entry, storage: BaseStorage | None, anchor: str = "",
                 render: Callable[[StudyData], dict[str, str]] = images,
                 choice: StoredChoice | None = None,
                 render_choice: Callable[[KernelChoice], dict[str, str]] = choice_image,
                 ) -> ProblemView:
    """The view of ``entry`` and the kernel ``choice`` of its problem; ``render`` draws the
    study's plots (e.g. through a cache), ``render_choice`` the choice's bar chart."""
    name = entry.result.study
    try:
        study = (StudyData.load(storage, name, entry.result.kernel,
                                entry.result.config.to_dict())
                 if storage is not None and name else None)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        # A study of that name that autotune did not write (another tool's, same database).
        study, unreadable = None, f"{type(error).__name__}: {first_line(str(error))}"
    else:
        unreadable = ""
    drawn = render(study) if study else {}
    if choice is not None:
        drawn = {**drawn, **render_choice(choice.choice)}
    return ProblemView(entry, study, drawn, anchor, choice, unreadable)
