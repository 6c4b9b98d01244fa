"""The problem flags shared by every CLI command that takes a problem, and ``--kernel``."""

from __future__ import annotations

import functools
import inspect
import re
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from kernel import ConfigError, Problem, ProblemError, get_kernel, kernel_names
from kernel.registry import SERVING_KERNELS, registered_kernel
from kernel.serving import problem_type_of
from kernel.table import problem_type_name
from kernel.regular_file import FileTooLarge, NotARegularFile, read_regular_file
from kernel.shapesfile import MAX_SHAPES_BYTES
from kernel.problem import SOFTCAP_RANGE, softcap_problem

_PANEL = "Problem"


def _window_option(value: str | None) -> tuple[int, int] | None:
    """``--window L,R``: two non-negative key counts."""
    if value is None:
        return None
    sides = value.split(",")
    if len(sides) != 2 or not all(side.strip().isdecimal() for side in sides):
        raise typer.BadParameter(f"give the keys visible before and after each query as two "
                                 f"non-negative integers L,R (e.g. --window 4095,0), got "
                                 f"{value!r}")
    return int(sides[0]), int(sides[1])


def _softcap_option(value: float | None) -> float | None:
    """``--softcap X``: a positive number in ``kernel.problem.SOFTCAP_RANGE``."""
    if value is not None and softcap_problem("--softcap", value):
        low, high = SOFTCAP_RANGE
        raise typer.BadParameter(f"give a positive finite number (e.g. --softcap 50) from "
                                 f"{low:g} to {high:g} (the kernels apply it in float32); "
                                 f"got {value}; leave the flag out for no capping")
    return value


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
                                                       help="Causal mask (top-left aligned "
                                                       "unless --bottom-right).",
                                                       rich_help_panel=_PANEL)]),
        ("mode", "fwd", Annotated[str, typer.Option(help="fwd | fwd_bwd.",
                                                    rich_help_panel=_PANEL)]),
        ("window", None, Annotated[str | None, typer.Option(
            metavar="L,R", callback=_window_option, rich_help_panel=_PANEL,
            help="Sliding window: keys visible before (L) and after (R) each query; R is 0 "
                 "when causal (default: none).")]),
        ("softcap", None, Annotated[float | None, typer.Option(
            callback=_softcap_option, rich_help_panel=_PANEL,
            help="Logit soft-capping: logits become X * tanh(logits / X) (default: none).")]),
        ("segmented", False, Annotated[bool, typer.Option(
            "--segmented", rich_help_panel=_PANEL,
            help="Segment ids are given (packed sequences).")]),
        ("bottom_right", False, Annotated[bool, typer.Option(
            "--bottom-right", rich_help_panel=_PANEL,
            help="Queries are the last q-len positions (query i at i + kv-len - q-len: decode, "
                 "chunked prefill) for the causal mask and window (default: top-left).")]),
    ]
]
_NAMES = [p.name for p in _OPTIONS]
# YAML nodes a shapes file may expand to, aliases and merges counted at each use: 16k problems
# of nine fields are 0.3M; an alias bomb of 500 bytes is 1e9.
MAX_SHAPES_NODES = 1_000_000
MAX_SHOWN_CHARS = 200  # of a value quoted in an error
ShapesOption = Annotated[Path | None, typer.Option(
    help="YAML/JSON list of problems (instead of the problem flags).")]


def output_file(value: str) -> Path:
    """An ``-o`` value: a file's path, or ``-`` for stdout. An empty one is refused as naming
    no file (Typer's own check took it for the current directory)."""
    if not value:
        raise typer.BadParameter("'' names no file; give a file's path (- for stdout)")
    if Path(value).is_dir():
        raise typer.BadParameter(f"{value} is a directory; give a file's path (- for stdout)")
    return Path(value)


def kernel_option(lookup: Callable[[str], Any]) -> Callable[[str | None], str | None]:
    """A ``--kernel`` callback: the name if ``lookup`` knows it, else its error as a bad
    parameter."""

    def known(name: str | None) -> str | None:
        if name is None:
            return None
        try:
            return lookup(name).name
        except ConfigError as error:
            raise typer.BadParameter(str(error)) from None

    return known


known_kernel = kernel_option(get_kernel)  # an attention kernel
tunable_kernel = kernel_option(registered_kernel)  # an attention or a serving kernel


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


def _flag(name: str) -> str:
    """The flag of problem field ``name``: ``q_len`` -> ``--q-len``."""
    return f"--{name.replace('_', '-')}"


def _given_names(context: typer.Context) -> list[str]:
    """The problem fields whose flags were given explicitly to the command of ``context``."""
    return [name for name in _NAMES
            if getattr(context.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"]


def problem_flags_given(context: typer.Context) -> list[str]:
    """The problem flags given explicitly to the command of ``context`` (not by default)."""
    return [_flag(name) for name in _given_names(context)]


def _shapes_error(message: str) -> typer.BadParameter:
    return typer.BadParameter(message, param_hint="--shapes")


def _shortened(text: str) -> str:
    """``text`` up to MAX_SHOWN_CHARS: an error quoting a value never prints it in full."""
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    return f"{text[:MAX_SHOWN_CHARS]}... ({len(text):,} characters)"


def _expanded_nodes(root: Any) -> int:
    """How many YAML nodes ``root`` stands for, each alias counted at each use, up to a little
    over MAX_SHAPES_NODES (-1: an alias refers to a node that holds it). Linear in the
    document: a shared node is counted once and its count reused."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack = [root]
    while stack:
        node = stack[-1]
        if id(node) in sizes:  # reached again through another alias
            stack.pop()
            continue
        children = [] if isinstance(node.value, str) else [
            child for item in node.value for child in (item if isinstance(item, tuple)
                                                      else (item,))]
        pending = [child for child in children if id(child) not in sizes]
        if id(node) in open_ and not pending:
            stack.pop()
            open_.discard(id(node))
            sizes[id(node)] = min(1 + sum(sizes[id(c)] for c in children), MAX_SHAPES_NODES + 1)
        elif id(node) in open_ or any(id(child) in open_ for child in pending):
            return -1
        else:
            open_.add(id(node))
            stack.extend(pending)
    return sizes[id(root)]


# A number with an exponent, with or without a point: JSON's 1e+20, 1e-05 and 5e1, which YAML
# 1.1 (PyYAML) reads as strings: a shapes file of JSON lines, as kernel.shapesfile writes them,
# would refuse its own softcaps.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


@functools.cache
def _shapes_loader() -> Any:
    """PyYAML's safe loader (the C one where built), reading exponent numbers as floats."""
    import yaml

    class ShapesLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
        pass

    ShapesLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT,
                                       list("-+.0123456789"))
    return ShapesLoader


def _written_nodes(text: str) -> int:
    """How many YAML nodes the document ``text`` writes out (an alias once), read as a stream
    of parser events, up to a little over MAX_SHAPES_NODES: counting stops there, before the
    nodes of a large file take gigabytes (60 MiB took 4.6 GB and 200 s)."""
    import yaml

    loader = _shapes_loader()(text)
    nodes = 0
    try:
        while nodes <= MAX_SHAPES_NODES and loader.check_event():
            nodes += isinstance(loader.get_event(), yaml.NodeEvent)
    finally:
        loader.dispose()
    return nodes


def _parse_shapes(path: Path) -> Any:
    """The YAML (or JSON) document of ``path``, refused before it is built if it writes out
    more than MAX_SHAPES_NODES nodes, or expands (with its aliases) to more."""
    import yaml

    try:
        text = read_regular_file(path, MAX_SHAPES_BYTES).decode("utf-8")
    except OSError as error:
        raise _shapes_error(f"cannot read {path}: {error.strerror}") from None
    except NotARegularFile:
        raise _shapes_error(f"{path} is not a regular file; give the path of a YAML or JSON "
                            "file") from None
    except FileTooLarge:
        raise _shapes_error(f"{path} is over the {MAX_SHAPES_BYTES >> 20} MiB a shapes file "
                            "may have; split it in several") from None
    except UnicodeDecodeError as error:
        raise _shapes_error(f"{path} is not UTF-8 text (byte {error.start})") from None
    loader = _shapes_loader()(text)
    try:
        if _written_nodes(text) > MAX_SHAPES_NODES:
            raise _shapes_error(f"{path} holds more than {MAX_SHAPES_NODES:,} YAML nodes (a "
                                "problem has about 20): split it in several")
        node = loader.get_single_node()
        nodes = 0 if node is None else _expanded_nodes(node)
        if nodes < 0 or nodes > MAX_SHAPES_NODES:
            what = ("holds a recursive alias" if nodes < 0 else
                    f"expands to more than {MAX_SHAPES_NODES:,} YAML nodes")
            raise _shapes_error(f"{path} {what} (its aliases repeat what they name): write "
                                "each problem out in full")
        return None if node is None else loader.construct_document(node)
    except yaml.YAMLError as error:
        raise _shapes_error(f"{path} is not valid YAML/JSON: {error}") from None
    except ValueError as error:  # an integer of 5000 digits, a 30th of February
        reason = str(error).split(";")[0]  # not Python's advice to raise its digit limit
        raise _shapes_error(f"{path} holds a value no problem field takes: "
                            f"{_shortened(reason)}") from None
    finally:
        loader.dispose()


def load_shapes(path: Path, defaults: dict[str, Any] | None = None,
                problem_type: type = Problem) -> list[Any]:
    """Problems of ``problem_type`` from a YAML or JSON list of problem objects (a model's
    attention shapes, or a server's serving problems), each once, in the file's order: a repeat
    is left out, and said so once (tuned twice, it would be published twice). ``defaults``:
    problem fields for the objects that omit them (the problem flags given with the file);
    one that every object overrides is said so."""
    data = _parse_shapes(path)
    if not isinstance(data, list) or not data:
        raise _shapes_error(f"{path} must hold a non-empty list of problems")
    defaults = defaults or {}
    used: set[str] = set()  # defaults some object omits
    first: dict[Problem, int] = {}  # each problem's first index
    repeats: list[str] = []
    others: dict[type, int] = {}  # problems of another type (AUTOTUNE_RECORD_MISSES): how many
    for index, item in enumerate(data):
        given = item
        if isinstance(item, dict):
            item = {**defaults, **item}
        try:
            problem = problem_type.from_dict(item)
        except ProblemError as error:
            other = problem_type_of(given)
            if other is not None and other is not problem_type:
                others[other] = others.get(other, 0) + 1
                continue
            raise _shapes_error(f"{path}, problem {index}: {_shortened(str(error))}") from None
        if isinstance(given, dict):
            used.update(defaults.keys() - given.keys())
        if problem in first:
            repeats.append(f"{index} (= {first[problem]})")
        else:
            first[problem] = index
    if repeats:
        typer.echo(f"note: {path}: problem(s) {', '.join(repeats)} repeat earlier ones; each "
                   "problem is tuned once", err=True)
    left_out = [f"{count} {problem_type_name(other)} problem(s) ({_tune_command(other, path)} "
                "tunes them)" for other, count in others.items()]
    if not first:
        raise _shapes_error(f"{path} holds no {problem_type_name(problem_type)} problems, only "
                            f"{'; '.join(left_out)}")
    if left_out:
        typer.echo(f"note: {path}: left out {'; '.join(left_out)}", err=True)
    unused = [_flag(name) for name in defaults if name not in used]
    if unused:
        typer.echo(f"note: {path}: {', '.join(unused)} not used: every problem gives its "
                   "own", err=True)
    return list(first)


def _tune_command(problem_type: type, path: Path) -> str:
    """The command that tunes the problems of ``problem_type`` in the shapes file ``path``."""
    if problem_type is Problem:
        return f"`autotune tune --shapes {path}`"
    kernel = next(k for k in SERVING_KERNELS.values() if k.problem_type is problem_type)
    return f"`autotune tune --kernel {kernel.name} --shapes {path}`"


def given_problems(context: typer.Context, problem: Problem, shapes: Path | None,
                   problem_type: type = Problem) -> list[Any]:
    """The problems of the ``--shapes`` file (of ``problem_type``), the problem flags given
    with it filling the fields its problems omit, or else the one problem of the flags."""
    if not shapes:
        return [problem]
    return load_shapes(shapes, {name: context.params[name] for name in _given_names(context)},
                       problem_type)


def _flag_of(message: str) -> str | None:
    """The flag a problem error is about: its message starts with the field's name."""
    return next((_flag(name) for name in _NAMES if message.startswith(name)), None)


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
            raise typer.BadParameter(str(error), param_hint=_flag_of(str(error))) from None
        return command(*args, problem=problem, **kwargs)

    parameters = own + _OPTIONS
    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    return wrapper
