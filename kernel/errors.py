"""The project's one error root and the kernel layer's errors.

Every error the project raises on purpose derives from :class:`AutotuneError` (a
``ValueError``), whose message names the problem and the fix: the CLI and the service turn any
of them into a clear message (exit 2, or a 4xx) without catching each kind.
"""

from __future__ import annotations


class AutotuneError(ValueError):
    """Root of every flash-autotune error; the message says what is wrong and how to fix it."""


class ProblemError(AutotuneError):
    """A problem description is malformed; the message names the field and the fix."""


class ConfigError(AutotuneError):
    """A config is malformed or illegal; the message names the field or rule and the fix."""


class TableError(AutotuneError):
    """A lookup table is malformed; the message names the file, entry and field."""
