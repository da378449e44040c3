"""The package layout's contracts: no import cycle, layers import downwards only, cheap
doors that import no other door, small files and functions.

Static checks read the source (``import_graph``: every import, lazy and ``TYPE_CHECKING``
ones included); the import-cost checks run a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import hyper_offload

from .import_graph import REPO, cycles, import_graph, library_modules

GRAPH = import_graph()

#: The bottom layer: leaf modules (the standard library only) that every layer may import.
BASE = ("hyper_offload._lazy", "hyper_offload.errors")

#: What each layer may import from the library besides itself and BASE (DESIGN.md,
#: "Layout"; docs/architecture.md): a name ending in "." allows a whole package, any
#: other name exactly that module. No exception: the op declarations live in passes/ir.
ALLOWED: dict[str, tuple[str, ...]] = {
    "hyper_offload.passes.": (),
    "hyper_offload.runtime.": ("hyper_offload.passes.",),
}

#: passes/'s subpackages, lowest first: each imports only those before it (and BASE).
PASSES_ORDER = ("ir", "analysis", "plan", "fx")

#: Size limits (STYLE.md, "Keep it small"), for every Python file of the repository.
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 80


def _allowed(target: str, allowed: tuple[str, ...]) -> bool:
    return any(target.startswith(a) if a.endswith(".") else target == a for a in allowed)


def test_the_graph_sees_every_module_and_lazy_import() -> None:
    # Guards the reader itself: a lazy table entry and a function-level import are edges.
    assert "hyper_offload.compiler.registry" in GRAPH["hyper_offload"]  # _LAZY
    assert "hyper_offload.eager.session" in GRAPH["hyper_offload.eager"]
    assert len(GRAPH) > 80


def test_no_import_cycle_anywhere() -> None:
    found = cycles(GRAPH)
    assert found == [], (
        "import cycles (lazy and TYPE_CHECKING imports count): "
        + "; ".join(" <-> ".join(c) for c in found)
        + ". Move what both sides need into a leaf module, or pass it as data"
    )


def test_layers_import_only_downwards() -> None:
    wrong = [
        (module, target)
        for module, targets in GRAPH.items()
        for layer, allowed in ALLOWED.items()
        if (module + ".").startswith(layer)
        for target in targets
        if not (target + ".").startswith(layer) and not _allowed(target, allowed + BASE)
    ]
    assert wrong == [], (
        f"layer rule broken (module -> import): {wrong}. Passes import nothing of the "
        "runtime (the op declarations are passes/ir/ops.py); the runtime imports no front "
        "door; every layer may import the leaves hyper_offload.errors and hyper_offload._lazy"
    )


def test_the_bottom_layer_imports_nothing_of_the_library() -> None:
    assert {module: GRAPH[module] for module in BASE} == {module: set() for module in BASE}


def _passes_part(module: str) -> str | None:
    """The passes subpackage ``module`` belongs to (``None``: not in one)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["hyper_offload", "passes"] else None


def test_passes_subpackages_import_only_the_ones_before_them() -> None:
    rank = {part: index for index, part in enumerate(PASSES_ORDER)}
    wrong = [
        (module, target)
        for module, targets in GRAPH.items()
        if (part := _passes_part(module)) is not None
        for target in targets
        if (other := _passes_part(target)) is not None and other != part
        and not (part in rank and other in rank and rank[other] < rank[part])
    ]
    assert wrong == [], (
        f"passes/ subpackage order broken (module -> import): {wrong}. The order is "
        f"{' < '.join(PASSES_ORDER)}, and pipeline/ stands apart; move what both sides "
        "need into the lower subpackage"
    )
    assert {_passes_part(m) for m in GRAPH} >= {*PASSES_ORDER, "pipeline"}  # the walk saw them


#: The front doors: a module of one imports no module of another (docs/architecture.md,
#: "Layout"). What two doors need lives below them, in passes/ or runtime/.
DOORS = ("hyper_offload.compiler", "hyper_offload.eager", "hyper_offload.pipeline")


def _door(module: str) -> str | None:
    """The door ``module`` belongs to (``None``: not in one)."""
    return next((door for door in DOORS if module == door or module.startswith(door + ".")),
                None)


def test_a_door_imports_no_other_door() -> None:
    wrong = [
        (module, target)
        for module, targets in sorted(GRAPH.items())
        if (door := _door(module)) is not None
        for target in sorted(targets)
        if (other := _door(target)) is not None and other != door
    ]
    assert wrong == [], (
        f"a door imports another door (module -> import): {wrong}. The doors "
        f"({', '.join(DOORS)}) stand side by side on the passes and the runtime: move what "
        "both need into hyper_offload.passes (pure) or hyper_offload.runtime (moves or "
        "measures bytes), and import it from there"
    )
    assert {_door(m) for m in GRAPH} >= set(DOORS)  # the walk saw every door


#: The modules outside passes/ that import no torch, each with the job that keeps it out of
#: passes/. Torch-free *planning* lives in passes/ (issue 48: the compile door once held a
#: second planner of 1,200 torch-free lines); a new torch-free module elsewhere must be
#: listed here with a job that is not planning, or move to passes/.
TORCH_FREE_OUTSIDE_PASSES: dict[str, str] = {
    "hyper_offload": "package (lazy names)",
    "hyper_offload.__main__": "entry point",
    "hyper_offload._lazy": "lazy names (bottom layer)",
    "hyper_offload.cli": "command line (parser)",
    "hyper_offload.cli.plan": "command line (reads a trace, runs passes, prints)",
    "hyper_offload.cli.pp_order": "command line (prints pipeline orders passes build)",
    "hyper_offload.compiler": "package (lazy names)",
    "hyper_offload.compiler.estimate": "package (lazy names)",
    "hyper_offload.compiler.estimate.report": "report (what estimate returns)",
    "hyper_offload.compiler.recompute": "package",
    "hyper_offload.compiler.region_report": "report (one region, for users and logs)",
    "hyper_offload.compiler.step": "package",
    "hyper_offload.compiler.step_report": "report (the step plan in force)",
    "hyper_offload.eager": "package (lazy names)",
    "hyper_offload.eager.lifecycle": "state machine (the eager door's step lifecycle)",
    "hyper_offload.errors": "errors (bottom layer)",
    "hyper_offload.exactness": "package (lazy names)",
    "hyper_offload.integrations": "package (lazy names)",
    "hyper_offload.integrations.lightning_callback": "trainer hook (Lightning)",
    "hyper_offload.pipeline": "package (lazy names)",
    "hyper_offload.progress": "progress notes",
    "hyper_offload.viz": "plots",
    "hyper_offload.runtime": "package",
    "hyper_offload.runtime.pipeline": "package",
    "hyper_offload.runtime.pipeline.footprint": "measurement (a stage's bytes in one step)",
    "hyper_offload.runtime.stats": "counters (the runtime's syncs and pool figures)",
}


def _imports_torch(path: Path) -> bool:
    """Whether the file imports torch itself, anywhere in it (lazy imports count)."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import) and any(
                a.name.split(".")[0] == "torch" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (
                (node.module or "").split(".")[0] == "torch"):
            return True
    return False


def test_torch_free_planning_lives_in_passes() -> None:
    torch_free = {module for module, path in library_modules().items()
                  if not module.startswith("hyper_offload.passes") and not _imports_torch(path)}
    unlisted = sorted(torch_free - set(TORCH_FREE_OUTSIDE_PASSES))
    assert unlisted == [], (
        f"torch-free modules outside passes/ that are not listed: {unlisted}. Planning that "
        "needs no torch belongs in hyper_offload.passes (pure: data in, data out); if the "
        "module's job is not planning (a report, a command, a state machine), add it to "
        "TORCH_FREE_OUTSIDE_PASSES with that job")
    stale = sorted(set(TORCH_FREE_OUTSIDE_PASSES) - torch_free)
    assert stale == [], f"listed but gone or importing torch now (drop them): {stale}"


#: The folders of the repository that hold Python (the library, tests, and the rest).
SOURCE_FOLDERS = ("offload_compile", "passes", "runtime", "tests", "benchmarks", "examples",
                  "scripts")


def _python_files() -> list[Path]:
    return sorted(path for folder in SOURCE_FOLDERS for path in (REPO / folder).rglob("*.py"))


def test_no_file_or_function_is_too_long() -> None:
    files = _python_files()
    assert len(files) > 200  # the walk saw the repository
    long_files, long_functions = [], []
    for path in files:
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            long_files.append(str(path.relative_to(REPO)))
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} "
                                          f"({length} lines)")
    assert long_files == [], f"files over {MAX_FILE_LINES} lines, split by job: {long_files}"
    assert long_functions == [], (
        f"functions over {MAX_FUNCTION_LINES} lines, split into steps: {long_functions}")


def test_the_root_holds_only_the_first_names_and_the_errors() -> None:
    errors = hyper_offload.errors.__all__
    assert sorted(hyper_offload.__all__) == sorted(
        ["OffloadConfig", "OffloadSession", "__version__", "backend", "check", "estimate",
         "register_backend", "skip_offload", "step_report", *errors])
    for name in hyper_offload.__all__:
        assert getattr(hyper_offload, name) is not None


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


@pytest.mark.parametrize("statement", [
    "import hyper_offload",
    "import hyper_offload.cli",
    "from hyper_offload.cli import build_parser; build_parser()",
    "import hyper_offload.passes, hyper_offload.passes.pipeline",
])
def test_planning_and_the_cli_do_not_import_torch(statement: str) -> None:
    loaded = _loaded_after(statement)
    assert "torch" not in loaded, f"{statement!r} imported torch"
