"""The project's one error root and the kernel layer's errors.

Every error the project raises on purpose derives from :class:`AutotuneError` (a
``ValueError``), whose message names the problem and the fix: the CLI and the service turn any
of them into a clear message (exit 2, or a 4xx) without catching each kind.
"""

from __future__ import annotations


MESSAGE_HEAD, MESSAGE_TAIL = 1000, 500  # characters of a long message kept on each side


class AutotuneError(ValueError):
    """Root of every flash-autotune error; the message says what is wrong and how to fix it."""

    def __str__(self) -> str:
        # A message quotes the bad value, which may be megabytes of a request body or a
        # table: its middle is cut, keeping what is wrong (the head) and the fix (the tail).
        message = super().__str__()
        cut = len(message) - MESSAGE_HEAD - MESSAGE_TAIL
        if cut <= 0:
            return message
        return f"{message[:MESSAGE_HEAD]}[... {cut} characters ...]{message[-MESSAGE_TAIL:]}"


class ProblemError(AutotuneError):
    """A problem description is malformed; the message names the field and the fix."""


class ConfigError(AutotuneError):
    """A config is malformed or illegal; the message names the field or rule and the fix."""


class TableError(AutotuneError):
    """A lookup table is malformed; the message names the file, entry and field."""


class ShardingError(AutotuneError):
    """Attention is called where the problem each device computes cannot be known; the
    message names where and the fix."""


class StrictMiss(AutotuneError):
    """A strict build (``AUTOTUNE_STRICT``) traced attention its pinned tables do not answer;
    the message lists the problems and the fix."""
