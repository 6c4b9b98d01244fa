"""Writing the CLI's output files: a file whole or not at all, never replacing what is no file.

``-`` is stdout. A new path or a regular file is written through a temporary file renamed
over it (an existing file keeps its mode; one this process may not write is refused, as a
shell's ``>`` refuses it). A symbolic link stays a link: the regular file it leads to is
replaced so (a full disk keeps its old bytes), and anything else it leads to
(``/dev/stdout``) is written through, as a shell's ``>`` does. Anything else is written
through, never replaced: a character device (``/dev/null``) or a FIFO takes the bytes (one
without a reader is refused, not waited on); a block device, a directory or a socket is
refused.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import tempfile
from pathlib import Path

STDOUT = "-"


def write_output(path: str | Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` as the module says; raises ``OSError`` naming what failed."""
    if str(path) == STDOUT:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        _replace(Path(path), data, mode=None)
        return
    if stat.S_ISLNK(status.st_mode) and not is_stdout(path):
        path = os.path.realpath(path, strict=True)  # the link stays; what it leads to is written
        status = os.stat(path)
    if stat.S_ISREG(status.st_mode):
        _check_writable(path)
        _replace(Path(path), data, mode=stat.S_IMODE(status.st_mode))
    else:
        _write_through(path, data)


def _check_writable(path: str | Path) -> None:
    """Raises ``PermissionError`` if this process may not write the file ``path`` (as a
    shell's ``>`` would find opening it): a 0444 file is not replaced by a write beside it."""
    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def is_stdout(path: str | Path) -> bool:
    """Whether ``path`` is this process's stdout (``-``, ``/dev/stdout``, the file stdout goes
    to): a command's line saying what it wrote then goes to stderr, after the output."""
    if str(path) == STDOUT:
        return True
    try:
        return os.path.samestat(os.stat(path), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError):  # no such path; a stdout without a descriptor (a test's)
        return False


def _replace(path: Path, data: bytes, mode: int | None) -> None:
    """Writes ``data`` to a temporary file in ``path``'s directory, renamed over ``path``: a
    failed or interrupted write leaves the old file, never a truncated one. The file gets
    ``mode``, or (None) the mode a plain ``open`` would give it (0666 less the umask)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if mode is None:
            umask = os.umask(0o22)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_through(path: str | Path, data: bytes) -> None:
    """Writes ``data`` into what ``path`` opens as (a link followed, a file truncated), if it
    is a file, a character device or a FIFO; opened without blocking, so that a FIFO nobody
    reads is refused (ENXIO) rather than waited on."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NONBLOCK)
    except OSError as error:
        if error.errno == errno.ENXIO:
            error.strerror = "nothing reads it (a FIFO without a reader, or a socket)"
        raise
    with os.fdopen(fd, "wb") as f:
        kind = os.fstat(fd).st_mode
        if not (stat.S_ISREG(kind) or stat.S_ISCHR(kind) or stat.S_ISFIFO(kind)):
            raise OSError(errno.EINVAL, "not a file, a character device or a FIFO; give the "
                          "path of a file", str(path))
        os.set_blocking(fd, True)
        f.write(data)
