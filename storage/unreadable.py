"""Stored rows this build cannot read: written by a newer build (a kernel not registered here,
a config field this version does not know). Readers skip such a row, with one warning per row
(not per request), and count it where lists are shown, so that one row does not break every
reader of the database."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from kernel.errors import AutotuneError

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class Rows(list[_T]):
    """The rows of one read that this build could decode; ``skipped`` says, per row left
    out, why this build cannot read it."""

    def __init__(self, items: Iterable[_T] = (), skipped: Sequence[str] = ()) -> None:
        super().__init__(items)
        self.skipped = list(skipped)


class UnreadableRows:
    """Decodes stored rows, skipping those this build cannot read; remembers each one met
    (by table and id), so that it is warned about once."""

    def __init__(self) -> None:
        self._reasons: dict[tuple[str, int], str] = {}
        self._lock = threading.Lock()
        self.log_each = True  # False: the reader sums them up itself (``reasons``)

    def read(self, table: str, row_id: int, decode: Callable[[], _T]) -> _T | None:
        """``decode()``, or None when it raises ``AutotuneError``: the row names a kernel or a
        config field this build does not know."""
        try:
            return decode()
        except AutotuneError as error:
            reason = str(error).split(";")[0]  # the problem, without the known names
            with self._lock:
                new = (table, row_id) not in self._reasons
                self._reasons[table, row_id] = reason
            if new and self.log_each:
                log.warning("skipped row %d of %s, written by a newer build (%s); upgrade "
                            "flash-autotune to read it", row_id, table, reason)
            return None

    def read_all(self, table: str, rows: Iterable[Any], decode: Callable[[Any], _T]) -> Rows[_T]:
        """The rows (mappings with an ``id``) that decode, and why the others do not."""
        out: Rows[_T] = Rows()
        for row in rows:
            item = self.read(table, row["id"], lambda row=row: decode(row))
            if item is None:
                out.skipped.append(self._reasons[table, row["id"]])
            else:
                out.append(item)
        return out

    def reasons(self) -> list[str]:
        """Why each row met so far was skipped."""
        with self._lock:
            return list(self._reasons.values())


def skipped_note(reasons: Sequence[str]) -> str:
    """One line for the rows skipped (``reasons``, one per row), '' when none were."""
    if not reasons:
        return ""
    count = len(reasons)
    return (f"skipped {count} row{'' if count == 1 else 's'} written by a newer build "
            f"({', '.join(sorted(set(reasons)))}); upgrade flash-autotune to read "
            f"{'it' if count == 1 else 'them'}")
