"""The package layout's contracts: no import cycle, layers import downwards only, cheap doors.

Static checks read the source (``import_graph``: every import, lazy and ``TYPE_CHECKING``
ones included); the import-cost checks run a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import hyper_offload

from .import_graph import REPO, cycles, import_graph

GRAPH = import_graph()

#: What each layer may import from the library besides itself (DESIGN.md, "Layout"): a
#: name ending in "." allows a whole package, any other name exactly that module.
ALLOWED = {
    "hyper_offload.passes.": ("hyper_offload.runtime.op_declarations",),
    "hyper_offload.runtime.": ("hyper_offload.passes.",),
}


def _allowed(target: str, allowed: tuple[str, ...]) -> bool:
    return any(target.startswith(a) if a.endswith(".") else target == a for a in allowed)


def test_the_graph_sees_every_module_and_lazy_import() -> None:
    # Guards the reader itself: a lazy table entry and a function-level import are edges.
    assert "hyper_offload.compiler.dynamo_backend" in GRAPH["hyper_offload"]  # _LAZY
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
        if not (target + ".").startswith(layer) and not _allowed(target, allowed)
    ]
    assert wrong == [], (
        f"layer rule broken (module -> import): {wrong}. Passes import only the op "
        "declarations of the runtime; the runtime imports no front door"
    )


def test_the_root_holds_only_the_first_names() -> None:
    assert sorted(hyper_offload.__all__) == sorted(
        ["OffloadConfig", "OffloadSession", "__version__", "backend", "estimate", "skip_offload"])
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
