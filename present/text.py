"""Error text as tuning trials store it and reports show it."""

from __future__ import annotations


def first_line(message: str, limit: int = 300) -> str:
    """The first informative line of an error message, for reports and trial attributes."""
    for line in message.strip().splitlines():
        line = line.strip()
        if line and not line.startswith(("Traceback", "File ", "===")):
            return line[:limit]
    return message.strip()[:limit]
