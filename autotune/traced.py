"""The attention problems a Python function uses, from an abstract trace (no compile, no data).

What ``autotune.tune_model`` and ``autotune tune --from module:function --args ...`` tune:
the function is traced with ``jax.eval_shape`` inside ``kernel.capture()``, so every
``kernel.flash_attention`` call it makes is found in the mode it runs (``fwd_bwd`` when
differentiated). Where a call's shardings are left to XLA (plain ``jax.jit`` on a host of
several devices) the function is lowered too (not compiled): a program over several devices
raises there, naming the fix, rather than yield the global problem (docs/sharded-training.md).
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from kernel import Capture, Problem, capture

_SPEC = re.compile(r"^\s*([A-Za-z0-9_]+)\[([0-9,\s]*)\]\s*$")


class TraceError(ValueError):
    """A function or its arguments could not be found, parsed or traced; says how to fix it."""


def captured_problems(fn: Callable[..., Any], *abstract_args: Any) -> list[Problem]:
    """The problems ``fn(*abstract_args)`` resolves, each once, in trace order. The arguments
    may be arrays, ``jax.ShapeDtypeStruct`` objects or pytrees of them."""
    return captured_calls(fn, *abstract_args).problems


def captured_calls(fn: Callable[..., Any], *abstract_args: Any) -> Capture:
    """The capture of ``fn(*abstract_args)``: its problems (:func:`captured_problems`) and the
    kernels that cannot run each where it is called (``Capture.refused``)."""
    with capture() as problems:
        try:
            jax.eval_shape(fn, *abstract_args)
            if problems.unplaced:  # plain jit on several devices: lowering checks its shardings
                jax.jit(fn).lower(*abstract_args)
        except Exception as error:  # noqa: BLE001 - the user's code: named in one line
            raise TraceError(f"tracing {_name(fn)} failed: {type(error).__name__}: "
                             f"{error}") from error
    if not problems.problems:
        raise TraceError(f"{_name(fn)} makes no kernel.flash_attention call: nothing to tune")
    return problems


def load_function(spec: str, what: str = "--from") -> Callable[..., Any]:
    """The callable named by ``module:attribute`` (``pkg.model:train_step``; a dotted
    attribute like ``Model.step`` too), imported with the working directory on the path."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise TraceError(f"{what} {spec!r}: give module:function, e.g. mymodel:train_step")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - the user's module: named in one line
        raise TraceError(f"{what} {spec!r}: cannot import {module_name!r}: "
                         f"{type(error).__name__}: {error}") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise TraceError(f"{what} {spec!r}: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise TraceError(f"{what} {spec!r} is a {type(target).__name__}, not a function")
    return target


def abstract_args(spec: str | None) -> tuple[Any, ...]:
    """The arguments ``--args`` gives: ``module:function`` (called with no arguments; it
    returns the argument tuple, e.g. of ``jax.ShapeDtypeStruct`` pytrees), or
    whitespace-separated ``dtype[d0,d1,...]`` arrays (``bfloat16[8,512,256] int32[8]``);
    none when not given."""
    if spec is None or not spec.strip():
        return ()
    if ":" in spec:
        function = load_function(spec, "--args")
        try:
            made = function()
        except Exception as error:  # noqa: BLE001 - the user's code: named in one line
            raise TraceError(f"--args {spec!r}: calling it failed: {type(error).__name__}: "
                             f"{error}") from None
        return tuple(made) if isinstance(made, (tuple, list)) else (made,)
    return tuple(_array_spec(token) for token in spec.split())


def _array_spec(token: str) -> jax.ShapeDtypeStruct:
    import jax.numpy as jnp

    match = _SPEC.match(token)
    if match is None:
        raise TraceError(f"--args {token!r}: write an array as dtype[d0,d1,...], e.g. "
                         "bfloat16[8,512,256], or give module:function returning the arguments")
    dtype, dims = match.groups()
    try:
        return jax.ShapeDtypeStruct(tuple(int(d) for d in dims.split(",") if d.strip()),
                                    jnp.dtype(dtype))
    except TypeError:
        raise TraceError(f"--args {token!r}: unknown dtype {dtype!r} (e.g. bfloat16, "
                         "float32, int32)") from None


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
