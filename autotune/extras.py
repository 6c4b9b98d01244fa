"""Which install extra each ``autotune`` command needs, checked before Typer (itself in an
extra) is imported: a bare ``pip install flash-autotune`` holds only ``kernel`` and jax, and a
command whose extra is missing exits 2 naming it instead of failing on an import.

Standard library only.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

# The modules each extra provides that the commands import (see pyproject.toml).
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "tune": ("typer", "rich", "optuna", "sklearn", "sqlalchemy", "alembic", "pydantic_settings",
             "yaml", "matplotlib", "jinja2"),
    "serve": ("typer", "rich", "fastapi", "uvicorn", "sqlalchemy", "alembic",
              "pydantic_settings", "prometheus_client", "jinja2", "matplotlib", "optuna",
              "httpx"),
    "tpu": ("libtpu",),
}

# Per command, the extra sets that each suffice to run it ("tune,serve": both), first preferred.
COMMAND_EXTRAS: dict[str, tuple[str, ...]] = {
    "tune": ("tune",),
    "precheck": ("tune,tpu",),
    "report": ("tune",),
    "replay": ("tune",),
    "landscape": ("tune",),
    "stale": ("tune", "serve"),
    "export": ("tune", "serve"),
    "import": ("tune", "serve"),
    "db": ("serve", "tune"),
    "serve": ("serve",),
    "demo": ("tune,serve",),
}


def missing_modules(extras: str) -> list[str]:
    """The modules of the comma-separated ``extras`` that are not installed."""
    modules = dict.fromkeys(m for extra in extras.split(",") for m in EXTRA_MODULES[extra])
    return [m for m in modules if importlib.util.find_spec(m) is None]


def install_hint(extras: str) -> str:
    return f"pip install 'flash-autotune[{extras}]'"


def missing_extra(argv: Sequence[str]) -> str | None:
    """Why the command in ``argv`` (the arguments after ``autotune``) cannot run here, naming
    the extra to install; None when it can (or when Typer will answer, e.g. an unknown name)."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command in COMMAND_EXTRAS:
        choices = COMMAND_EXTRAS[command]
        if any(not missing_modules(extras) for extras in choices):
            return None
        missing = missing_modules(choices[0])
        alternatives = "".join(f" or {install_hint(extras)}" for extras in choices[1:])
        return (f"error: autotune {command} needs the '{choices[0]}' extra, which is not "
                f"installed (missing: {', '.join(missing)}); install it with "
                f"{install_hint(choices[0])}{alternatives}")
    if importlib.util.find_spec("typer") is None:  # help, or an unknown command
        per_extra = "; ".join(
            f"[{extras}]: {', '.join(c for c, e in COMMAND_EXTRAS.items() if e[0] == extras)}"
            for extras in dict.fromkeys(e[0] for e in COMMAND_EXTRAS.values()))
        return (f"error: this install has no autotune commands; each needs an extra ({per_extra})."
                f" Everything: {install_hint('all')}")
    return None
