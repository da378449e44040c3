"""The library's import graph, read from the source with ``ast`` (nothing is imported).

Every import counts: module level, inside functions (lazy), under ``TYPE_CHECKING``, and
the string targets of a package's ``_LAZY`` table (what its ``__getattr__`` imports).
An edge goes to the module an import names: ``from a.b import c`` is an edge to
``a.b.c`` when that is a module of the library, else to ``a.b`` (the package whose
``__init__`` provides ``c``). Folders map to import names as in ``pyproject.toml``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"offload_compile": "hyper_offload", "passes": "hyper_offload.passes",
                "runtime": "hyper_offload.runtime"}


def library_modules() -> dict[str, Path]:
    """Import name -> source file, for every module of the installed package."""
    modules: dict[str, Path] = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _absolute(base: str, level: int, name: str | None) -> str:
    parts = base.split(".")
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join([*parts, name] if name else parts)


def _lazy_targets(tree: ast.Module) -> Iterator[str]:
    """Values of a module-level ``_LAZY = {name: module}`` table."""
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY"
                                                 for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            for value in node.value.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    yield value.value


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Library modules that ``module`` imports, by any route (module docstring)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _package_of(module, path)
    named: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(package, node.level, node.module) if node.level else node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                named.append(submodule if submodule in modules else base)
    for target in _lazy_targets(tree):
        named.append(_absolute(package, 1, target[1:]) if target.startswith(".") else target)
    return {name for name in named if name in modules and name != module}


def import_graph() -> dict[str, set[str]]:
    modules = library_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found
