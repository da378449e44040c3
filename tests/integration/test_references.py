"""Every cross-reference in the library's docstrings resolves, every repository path that
the docstrings and docs name exists, and no docstring points at an issue number.

* Roles (``:mod:``, ``:func:``, ``:class:``, ``:meth:``, ``:data:``, ``:attr:``,
  ``:exc:``): the target imports as Sphinx would find it. ``~`` only shortens the shown
  name; a leading dot is relative to the module's package (``.x``: a sibling, ``..x``:
  the parent's), then to the module itself (``.Class.meth``); a name without a dot
  prefix is absolute (``hyper_offload.x``, ``torch.x``), a name of the module, or a
  member of one of its classes (``:meth:`run``` in a class's docstring).
* Paths: a path to a file (``compiler/backend.py``, ``passes/plan/step/plan.py``,
  ``tests/x.py::test_y``) whose first folder is a folder of the repository or of one of
  the package's folders exists; with ``::test_y``, the file defines ``test_y``. Files
  that commands write (``out/``, ``benchmarks/data/``) and the old names of a ``| was |
  is |`` table need not exist.
  ``tests/integration/test_doc_links.py`` checks the docs' repository-rooted paths,
  links and ``hyper_offload.*`` names; this adds the package-relative ones.
* Issue numbers belong in the docs and the history, not in the code's docstrings: a
  reader of the code has no issue tracker.
* ``scripts/mutation_check.py``: every planted bug's snippet occurs once in its file, as
  the script requires (a snippet the source no longer has is a check that stopped running).

Docstrings are every string statement of a library module (module, class, function and
attribute docstrings), read from the source.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from .doc_blocks import DOCUMENTS
from .test_doc_links import _OUTPUTS, _checked_text
from .import_graph import PACKAGE_DIRS, REPO, library_modules

MODULES = library_modules()

_ROLE = re.compile(r":(mod|func|class|meth|data|attr|exc|obj):`([^`]*)`")
_PATH = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w-]*/)+[\w-]+\.(?:py|md|toml|json|yml|yaml|sh))"
                   r"(?:::(\w+))?")
_ISSUE = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)

#: Folders a path may start from: the repository's, and the package folders' own.
_ROOTS = (REPO, *(REPO / folder for folder in PACKAGE_DIRS))
_FIRST_FOLDERS = frozenset(
    child.name for root in _ROOTS for child in root.iterdir()
    if child.is_dir() and not child.name.startswith(".") and child.name != "__pycache__"
)


class Docstring(NamedTuple):
    module: str
    line: int
    text: str
    owner: str | None
    """The class whose body holds it (its own docstring, a method's or an attribute's)."""


def docstrings(module: str, path: Path) -> Iterator[Docstring]:
    """Every string statement of ``path``: module, class, function, attribute docstrings."""

    def visit(node: ast.AST, owner: str | None) -> Iterator[Docstring]:
        for child in ast.iter_child_nodes(node):
            if (isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant)
                    and isinstance(child.value.value, str)):
                yield Docstring(module, child.lineno, child.value.value, owner)
            inner = child.name if isinstance(child, ast.ClassDef) else owner
            yield from visit(child, inner if owner is None or inner == owner
                             else f"{owner}.{inner}")

    yield from visit(ast.parse(path.read_text()), None)


ALL_DOCSTRINGS = [d for module, path in MODULES.items() for d in docstrings(module, path)]


def _lookup(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or a module's attribute path (a class's dataclass
    or annotated field, or an attribute its methods set on ``self``, counts)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        except Exception:  # noqa: BLE001 - a module that fails to import resolves nothing
            return False
        for index, attribute in enumerate(parts[cut:]):
            try:
                value = getattr(value, attribute)
            except AttributeError:
                return (index == len(parts[cut:]) - 1 and inspect.isclass(value)
                        and _declares(value, attribute))
        return True
    return False


def _declares(cls: type, name: str) -> bool:
    """Whether ``cls`` (or a base) declares ``name`` as a field or sets ``self.name``."""
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]+)?=", source):
            return True
    return False


def resolves(target: str, doc: Docstring) -> bool:
    """Whether a role's ``target`` names something, as Sphinx would find it (module
    docstring)."""
    target = target.removeprefix("~")
    if "<" in target and target.endswith(">"):
        target = target[target.index("<") + 1:-1]
    target = target.removesuffix("()")
    if not re.fullmatch(r"\.*[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", target):
        return False  # a blank, a line break or a stray character inside the target
    path = MODULES[doc.module]
    package = doc.module if path.name == "__init__.py" else doc.module.rpartition(".")[0]
    scopes = [doc.module]
    if doc.owner is not None:
        owner = doc.owner.split(".")
        scopes = [".".join([doc.module, *owner[:k]]) for k in range(len(owner), 0, -1)] + scopes
    if target.startswith("."):
        level = len(target) - len(target.lstrip("."))
        base = package.split(".")
        base = base[: len(base) - (level - 1)] if level > 1 else base
        candidates = [".".join([*base, target.lstrip(".")])]
        candidates += [f"{scope}{target}" for scope in scopes]
    else:
        candidates = [target, *(f"{scope}.{target}" for scope in scopes)]
    return any(_lookup(candidate) for candidate in candidates)


def path_problem(named: str, test: str | None) -> str | None:
    """Why the repository path ``named`` (``::test``: a test in it) does not exist; None
    where it does, or where its first folder is none of ours (``torch/fx/graph.py``)."""
    if named.split("/", 1)[0] not in _FIRST_FOLDERS or named.startswith(_OUTPUTS):
        return None
    found = [root / named for root in _ROOTS if (root / named).is_file()]
    if not found:
        return f"no file {named}"
    if test and not any(re.search(rf"^\s*(?:async )?def {test}\b", p.read_text(), re.M)
                        for p in found):
        return f"no test {test} in {named}"
    return None


def _role_problems(doc: Docstring) -> list[str]:
    problems = []
    for role, target in _ROLE.findall(doc.text):
        if not resolves(target, doc):
            shown = " ".join(target.split())
            problems.append(f"{doc.module}:{doc.line}: :{role}:`{shown}` does not resolve")
    return problems


def _path_problems(text: str, where: str) -> list[str]:
    problems = []
    for match in _PATH.finditer(text):
        problem = path_problem(match.group(1), match.group(2))
        if problem is not None:
            problems.append(f"{where}: {problem}")
    return problems


def test_every_role_in_a_docstring_resolves() -> None:
    problems = [p for doc in ALL_DOCSTRINGS for p in _role_problems(doc)]
    assert problems == [], "\n".join(problems)


def test_every_path_a_docstring_names_exists() -> None:
    problems = [p for doc in ALL_DOCSTRINGS
                for p in _path_problems(doc.text, f"{doc.module}:{doc.line}")]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("path", DOCUMENTS, ids=[p.name for p in DOCUMENTS])
def test_every_path_a_document_names_exists(path: Path) -> None:
    problems = []
    for number, line in enumerate(_checked_text(path), 1):
        problems += _path_problems(line, f"{path.relative_to(REPO)}:{number}")
    assert problems == [], "\n".join(problems)


def test_no_docstring_names_an_issue() -> None:
    found = [f"{d.module}:{d.line}: {m.group(0)!r}"
             for d in ALL_DOCSTRINGS for m in _ISSUE.finditer(d.text)]
    assert found == [], "\n".join(found)


def test_every_planted_bug_names_current_source() -> None:
    spec = importlib.util.spec_from_file_location(
        "mutation_check", REPO / "scripts" / "mutation_check.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclasses look their module up
    try:
        spec.loader.exec_module(script)
    finally:
        del sys.modules[spec.name]
    stale = [f"{m.name}: {m.path} has the snippet {(REPO / m.path).read_text().count(m.old)} "
             "times" if (REPO / m.path).is_file() else f"{m.name}: no file {m.path}"
             for m in script.MUTATIONS
             if not (REPO / m.path).is_file() or (REPO / m.path).read_text().count(m.old) != 1]
    missing = [f"{m.name}: no test file {t}" for m in script.MUTATIONS for t in m.tests
               if not (REPO / t.split("::")[0]).is_file()]
    assert stale + missing == [], "\n".join(stale + missing)


def test_the_checker_finds_what_is_broken() -> None:
    doc = Docstring("hyper_offload.passes.plan.step.plan", 1, "", "StepPlan")
    assert resolves("~.model.RegionFloor", doc) and resolves("..planning.plan_residency", doc)
    assert resolves("keep_for", doc) and resolves("StepPlan.summary", doc)
    assert resolves("hyper_offload.compiler.backend.HyperOffloadBackend", doc)
    assert resolves("torch.library.custom_op", doc) and resolves(".plan_step", doc)
    assert not resolves(".step_plan.StepPlan", doc)
    assert not resolves("hyper_offload.compiler.dynamo_backend", doc)
    assert not resolves("~hyper_offload.passes.plan.step.\n   plan_step", doc)
    assert path_problem("compiler/backend.py", None) is None
    assert path_problem("passes/plan/step/plan.py", None) is None
    assert path_problem("torch/_functorch/partitioners.py", None) is None
    assert path_problem("compiler/dynamo_backend.py", None) == "no file compiler/dynamo_backend.py"
    assert path_problem("tests/integration/test_references.py", "test_no_such") == (
        "no test test_no_such in tests/integration/test_references.py")
    assert _ISSUE.search("(issue 48, item 4)") and _ISSUE.search("Issues #7")
    assert not _ISSUE.search("an issue with 3 ops")
