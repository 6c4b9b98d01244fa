"""Text as tuning trials store it and the CLI and reports show it."""

from __future__ import annotations


def first_line(message: str, limit: int = 300) -> str:
    """The first informative line of an error message, for reports and trial attributes."""
    for line in message.strip().splitlines():
        line = line.strip()
        if line and not line.startswith(("Traceback", "File ", "===")):
            return line[:limit]
    return message.strip()[:limit]


# What a time measured in interpret mode is (the demo and the tune's summary say it on a CPU).
INTERPRET_NOTE = ("interpret mode: the TPU kernel emulated on a CPU; these times and their ratio "
                  "are no device figure")


def counted(number: int, noun: str) -> str:
    """``number`` and ``noun``, plural unless it is 1: "1 kernel choice", "2 kernel choices"."""
    return f"{number} {noun}" + ("" if number == 1 else "s")
