"""The import graph of the project's packages: no cycles and the layering that
docs/architecture.md promises.

Every import counts: module level, inside functions, and dotted module names loaded by string
(``importlib.import_module``, ``find_spec``, ``importlib.resources.files``, lazy tables of dotted
names), and, as the shared ``import_cycles.py`` counts them, a package's bare name in any string
(a logger or a JSON field called "storage" or "kernel"): name those another way.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernel", "storage", "present", "api", "autotune")


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The project module a dotted name is, or lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


LOADERS = {"import_module", "find_spec", "__import__", "files"}  # importlib's, by name


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _imports(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and _callee(node) in LOADERS:
            targets.update(arg.value for arg in node.args  # a module loaded by name
                           if isinstance(arg, ast.Constant) and isinstance(arg.value, str))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and node.value.split(".")[0] in PACKAGES
              and all(part.isidentifier() for part in node.value.split("."))):
            targets.add(node.value)  # a module's name, e.g. in a lazy-import table
    return {owner for t in targets if (owner := _owner(t)) and owner != module}


# The bottom layer of kernel/: plain data and pure functions, importing only each other.
CORE = {"kernel.errors", "kernel.problem", "kernel.serving", "kernel.config", "kernel.targets",
        "kernel.rules", "kernel.tolerance"}
GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return out


def test_the_walk_sees_imports_inside_functions_and_by_string():
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert _cycles(graph) == [["a", "b"]]
    # kernel.contract imports jax inside functions only, and its backends by no name at all.
    assert "kernel.contract" in GRAPH["kernel.backends.flash"]
    assert "kernel.backends.flash.pallas" in GRAPH["kernel.backends.flash"]  # in a method


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_kernel_layers_point_one_way():
    """kernel never imports the service, storage or the tuner; backends import no registry,
    resolver or public wrapper; nothing outside kernel names one backend."""
    layers_above_backends = {"kernel.registry", "kernel.table", "kernel.resolve",
                             "kernel.attention", "kernel"}
    for module, imports in GRAPH.items():
        if module.startswith("kernel"):
            assert not {i for i in imports if i.split(".")[0] in ("storage", "api", "autotune")}
        if module.startswith("kernel.backends"):
            assert not imports & layers_above_backends, (module, imports & layers_above_backends)
        if module in CORE:
            assert imports <= CORE, (module, imports)
        if not module.startswith("kernel"):
            assert not {i for i in imports if i.startswith("kernel.backends")}, module
        if module.split(".")[0] in ("storage", "present"):  # below the service and the tuner
            assert not {i for i in imports if i.split(".")[0] in ("api", "autotune")}, module
