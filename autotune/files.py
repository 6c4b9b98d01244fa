"""Writing the CLI's output files whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: str | Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file in the same directory, renamed over
    ``path``: a failed or interrupted write leaves the old file, never a truncated one. The
    file gets the mode a plain ``open`` would give it (0666 less the umask)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0o22)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
