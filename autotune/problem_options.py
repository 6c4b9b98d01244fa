"""The problem flags shared by every CLI command that takes a problem, and ``--kernel``."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer

from kernel import ConfigError, Problem, ProblemError, get_kernel, kernel_names

_PANEL = "Problem"
_OPTIONS: list[inspect.Parameter] = [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
    for name, default, annotation in [
        ("batch", 1, Annotated[int, typer.Option(help="Batch size.", rich_help_panel=_PANEL)]),
        ("q_heads", 8, Annotated[int, typer.Option(help="Query heads.", rich_help_panel=_PANEL)]),
        ("kv_heads", None, Annotated[int | None, typer.Option(
            help="Key/value heads (default: --q-heads).", rich_help_panel=_PANEL)]),
        ("q_len", 1024, Annotated[int, typer.Option(help="Query length.", rich_help_panel=_PANEL)]),
        ("kv_len", None, Annotated[int | None, typer.Option(
            help="Key/value length (default: --q-len).", rich_help_panel=_PANEL)]),
        ("head_dim", 128, Annotated[int, typer.Option(help="Head dimension.",
                                                       rich_help_panel=_PANEL)]),
        ("dtype", "bfloat16", Annotated[str, typer.Option(help="bfloat16 | float32.",
                                                          rich_help_panel=_PANEL)]),
        ("causal", False, Annotated[bool, typer.Option("--causal/--no-causal",
                                                       help="Causal mask (top-left aligned).",
                                                       rich_help_panel=_PANEL)]),
        ("mode", "fwd", Annotated[str, typer.Option(help="fwd | fwd_bwd.",
                                                    rich_help_panel=_PANEL)]),
    ]
]
_NAMES = [p.name for p in _OPTIONS]


def known_kernel(name: str | None) -> str | None:
    if name is None:
        return None
    try:
        return get_kernel(name).name
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from None


def known_kernels(names: str | None) -> list[str] | None:
    """``--kernels``: comma-separated registered kernel names (None: not given)."""
    if names is None:
        return None
    out = [name.strip() for name in names.split(",") if name.strip()]
    if not out:
        raise typer.BadParameter("name at least one kernel, e.g. --kernels flash,xla")
    return list(dict.fromkeys(known_kernel(name) for name in out))


# ``--kernel`` of every command that tunes, checks or looks up a kernel (default ``flash``).
KernelOption = Annotated[str, typer.Option(
    "--kernel", callback=known_kernel,
    help=f"Registered kernel: {' | '.join(kernel_names())}.")]


def problem_flags_given(context: typer.Context) -> list[str]:
    """The problem flags given explicitly to the command of ``context`` (not by default)."""
    return [f"--{name.replace('_', '-')}" for name in _NAMES
            if getattr(context.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"]


def with_problem_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Adds the problem flags to a Typer command and passes it ``problem: Problem``.

    A malformed problem exits with status 2 and a message naming the flag.
    """
    hints = typing.get_type_hints(command, include_extras=True)  # resolves string annotations
    signature = inspect.signature(command)
    own = [p.replace(annotation=hints.get(name, p.annotation))
           for name, p in signature.parameters.items() if name != "problem"]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        fields = {name: kwargs.pop(name) for name in _NAMES}
        try:
            problem = Problem.from_dict({k: v for k, v in fields.items() if v is not None})
        except ProblemError as error:
            raise typer.BadParameter(str(error)) from None
        return command(*args, problem=problem, **kwargs)

    parameters = own + _OPTIONS
    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    return wrapper
