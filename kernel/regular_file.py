"""Reading a file a user names (a lookup table, a shapes file), bounded: only a regular file,
of at most a given size, checked before it is read (``/dev/zero`` never ends, a FIFO blocks
a read, a 600 MiB file would be read whole)."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class NotARegularFile(Exception):
    """The path is a device, a FIFO, a directory or a socket."""


class FileTooLarge(Exception):
    """The file holds more than the bytes its reader takes."""


def read_regular_file(path: str | Path, limit: int) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes; opened without
    blocking (a FIFO). Raises ``OSError`` (cannot open or read it), :class:`NotARegularFile`
    or :class:`FileTooLarge`."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return read_regular(descriptor, limit)
    finally:
        os.close(descriptor)


def read_regular(descriptor: int, limit: int) -> bytes:
    """The bytes of the open file ``descriptor`` as :func:`read_regular_file` reads a path's."""
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode):
        raise NotARegularFile
    if status.st_size > limit:
        raise FileTooLarge
    with open(descriptor, "rb", closefd=False) as reader:
        data = reader.read(limit + 1)
    if len(data) > limit:  # it grew while read
        raise FileTooLarge
    return data
