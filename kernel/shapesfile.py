"""Shapes files as ``autotune tune --shapes`` reads them, written without a YAML library.

Each problem is one line, ``- {"batch": 1, ...}``: a YAML block sequence of JSON flow
mappings, so a file stays valid YAML when lines are appended to it, and each line is read
back alone; it may end in a note, a YAML comment (``  # borrowed from ...``). Appends take an
exclusive lock (``fcntl.flock``, where the OS has it) and go out in one ``O_APPEND`` write, so
processes appending at once neither interleave lines nor add a problem twice.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from kernel.problem import FEATURE_FIELDS, Problem
from kernel.serving import ServingProblem, problem_type_of
from kernel.regular_file import FileTooLarge, NotARegularFile, read_regular

# A file may hold attention calls and serving steps (kernel.misses records both); each tune
# takes the problems of its kernel's type (problem_type_of tells a line's).
HEADER = ("# problems for `autotune tune --shapes FILE` (attention calls) and `autotune tune "
          "--kernel rpa --shapes FILE` (serving steps)\n")
# A shapes file of 16k problems is 3 MiB; a file past this is no shapes file.
MAX_SHAPES_BYTES = 64 << 20
NOTE = "  # "  # what starts a line's note


def problem_line(problem: Problem | ServingProblem) -> str:
    """A problem's line (an attention call's or a serving step's); features not in use are
    left out (as in files written before them)."""
    fields = {name: value for name, value in problem.to_dict().items()
              if name not in FEATURE_FIELDS or value not in (None, False)}
    return f"- {json.dumps(fields)}\n"


def save_shapes(path: str | os.PathLike[str],
                problems: Iterable[Problem | ServingProblem]) -> None:
    """Writes ``problems`` (each once, in order) to ``path``, replacing the file."""
    lines = [problem_line(p) for p in dict.fromkeys(problems)]
    Path(path).write_text(HEADER + "".join(lines), encoding="utf-8")


def notes(text: str, problem_type: type | None = None) -> list[str]:
    """The notes the problem lines of a shapes file's ``text`` end in; with ``problem_type``,
    but those of lines that are a problem of another type."""
    out = []
    for line in text.splitlines():
        if not (line.startswith("- ") and NOTE in line):
            continue
        body, note = line[2:].split(NOTE, 1)
        if problem_type is not None:
            try:
                kind = problem_type_of(json.loads(body))
            except ValueError:  # a line written otherwise: no type to tell
                kind = None
            if kind not in (None, problem_type):
                continue
        out.append(note)
    return out


def append_shapes(path: str | os.PathLike[str], problems: Iterable[Problem | ServingProblem],
                  noted: Mapping[Problem | ServingProblem, str] | None = None) -> int:
    """Appends the problems not in ``path`` yet (created if missing), a problem of ``noted``
    with its note; how many were added. Only a regular file is read, up to MAX_SHAPES_BYTES
    (a device or a FIFO is written to, and a write that would block fails); a larger file
    raises ``OSError`` (EFBIG)."""
    noted = noted or {}
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
    try:
        _lock(fd)
        present = _present_text(fd, path)
        known = {line.split(NOTE, 1)[0] for line in present.splitlines()}
        new = [line.rstrip("\n") + (NOTE + noted[p] if p in noted else "") + "\n"
               for p, line in {p: problem_line(p) for p in problems}.items()
               if line.rstrip("\n") not in known]
        text = ("" if present else HEADER) + "".join(new)
        if new:
            if present and not present.endswith("\n"):
                text = "\n" + text
            os.write(fd, text.encode("utf-8"))
        return len(new)
    finally:
        os.close(fd)  # releases the lock


def _present_text(fd: int, path: str | os.PathLike[str]) -> str:
    """What the file of ``fd`` holds: its text if it is a regular file of at most
    MAX_SHAPES_BYTES ("" for anything else: /dev/zero would never end)."""
    try:
        data = read_regular(fd, MAX_SHAPES_BYTES)
    except NotARegularFile:
        return ""
    except FileTooLarge:
        raise OSError(errno.EFBIG, f"over the {MAX_SHAPES_BYTES >> 20} MiB a shapes file may "
                      "have; give a new path", str(path)) from None
    return data.decode("utf-8", errors="replace")  # a line that is no UTF-8 is not ours


def _lock(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the one O_APPEND write still keeps lines whole
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
