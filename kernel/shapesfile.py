"""Shapes files as ``autotune tune --shapes`` reads them, written without a YAML library.

Each problem is one line, ``- {"batch": 1, ...}``: a YAML block sequence of JSON flow
mappings, so a file stays valid YAML when lines are appended to it, and each line is read
back alone. Appends take an exclusive lock (``fcntl.flock``, where the OS has it) and go out
in one ``O_APPEND`` write, so processes appending at once neither interleave lines nor add a
problem twice.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from kernel.problem import FEATURE_FIELDS, Problem

HEADER = "# attention problems for `autotune tune --shapes FILE`\n"


def problem_line(problem: Problem) -> str:
    """A problem's line; features not in use are left out (as in files written before them)."""
    fields = {name: value for name, value in problem.to_dict().items()
              if name not in FEATURE_FIELDS or value not in (None, False)}
    return f"- {json.dumps(fields)}\n"


def save_shapes(path: str | os.PathLike[str], problems: Iterable[Problem]) -> None:
    """Writes ``problems`` (each once, in order) to ``path``, replacing the file."""
    lines = [problem_line(p) for p in dict.fromkeys(problems)]
    Path(path).write_text(HEADER + "".join(lines), encoding="utf-8")


def append_shapes(path: str | os.PathLike[str], problems: Iterable[Problem]) -> int:
    """Appends the problems not in ``path`` yet (created if missing); how many were added."""
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        _lock(fd)
        with open(fd, "r", encoding="utf-8", closefd=False) as reader:
            reader.seek(0)
            present = reader.read()
        known = set(present.splitlines())
        new = [line for line in dict.fromkeys(map(problem_line, problems))
               if line.rstrip("\n") not in known]
        text = ("" if present else HEADER) + "".join(new)
        if new:
            if present and not present.endswith("\n"):
                text = "\n" + text
            os.write(fd, text.encode("utf-8"))
        return len(new)
    finally:
        os.close(fd)  # releases the lock


def _lock(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the one O_APPEND write still keeps lines whole
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
