"""``autotune report``: one self-contained HTML file of what tuning found.

An index of the stored winners per device kind (speedup over the default, trials, failures,
method, versions), then per problem the kernel choice's bar chart (every candidate kernel's
confirmed time with its spread, the chosen one marked) and the four plots of
``present.plots`` (landscape, convergence, confirmation, failures) embedded as PNG data URIs,
so the file opens offline.
Rendered with the same templates as the service's detail page.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kernel import AutotuneError
from present.views import ProblemView, problem_view, template_env
from storage import Store, shown_url
from storage.studies import get_storage


class ReportError(AutotuneError):
    """Nothing to report; the message says what the database holds instead."""


def collect(store: Store, filters: Mapping[str, Any]) -> dict[str, list[ProblemView]]:
    """The stored winners matching ``filters`` (``Store.list`` fields) with their studies,
    by device kind. Raises ReportError when none match."""
    entries, _ = store.list(filters, limit=None)
    if not entries:
        kinds = store.device_kinds()
        if not kinds:
            raise ReportError(f"no tuned configs in {shown_url(store.url)}; tune one with "
                              "`autotune tune --db URL` first")
        wanted = ", ".join(f"{k}={v!r}" for k, v in filters.items())
        raise ReportError(f"no tuned configs match {wanted}; the database has configs for "
                          f"device kind(s) {', '.join(map(repr, kinds))}")
    storage = get_storage(store.url, create=False)
    choices = {(stored.device_kind, stored.choice.problem): stored
               for stored in store.list_choices(limit=None)[0]}
    devices: dict[str, list[ProblemView]] = {}
    for index, entry in enumerate(sorted(entries, key=lambda e: (
            e.result.device_kind, e.result.problem.label(), e.result.kernel))):
        result = entry.result
        devices.setdefault(result.device_kind, []).append(problem_view(
            entry, storage, anchor=f"problem-{index + 1}",
            choice=choices.get((result.device_kind, result.problem))))
    return devices


def render(store: Store, filters: Mapping[str, Any] | None = None) -> str:
    """The report's HTML for the winners matching ``filters``."""
    filters = dict(filters or {})
    devices = collect(store, filters)
    return template_env().get_template("report.html").render(
        devices=devices, database=shown_url(store.url),
        selection=", ".join(f"{k} = {v}" for k, v in filters.items()),
        generated_at=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))
