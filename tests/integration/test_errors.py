"""Every error and warning a user can meet lives in ``hyper_offload.errors``, is exported
from the root, derives from one base, keeps its builtin, and is in docs/errors.md's table."""

from __future__ import annotations

import ast
import builtins
import importlib
import re

import pytest

import hyper_offload
from hyper_offload import errors

from .import_graph import REPO, library_modules

#: Each error's builtin base, as it was before the errors moved (issue 30): an
#: ``except ValueError`` written against an older release keeps catching it.
BUILTIN_OF_ERROR = {
    "CheckUsageError": ValueError,
    "ConfigurationError": ValueError,
    "ConfigurationTypeError": TypeError,
    "DataLostError": RuntimeError,
    "DynamicShapeError": ValueError,
    "HostBudgetError": MemoryError,
    "LoweringError": ValueError,
    "TilingError": ValueError,
    "OffloadRuntimeError": RuntimeError,
    "OffloadSessionError": RuntimeError,
    "OptimalPlannerError": RuntimeError,
    "OptionalDependencyError": ImportError,
    "OrderError": ValueError,
    "PipelineCommError": RuntimeError,
    "PipelineStateError": RuntimeError,
    "PlanningError": ValueError,
    "PlotDependencyError": ImportError,
    "PoolMisuseError": RuntimeError,
    "PrefetchError": ValueError,
    "ReleaseDelayError": ValueError,
    "ReplayMismatchError": RuntimeError,
    "ReportScopeError": AttributeError,
    "ResidencyMisuseError": RuntimeError,
    "ScheduleError": ValueError,
    "StepFormatError": ValueError,
    "SwapStateError": RuntimeError,
    "TimelineError": ValueError,
    "TorchCompatibilityError": RuntimeError,
    "TraceFormatError": ValueError,
    "TransferFailedError": RuntimeError,
    "TransferIntegrityError": RuntimeError,
    "TransferMisuseError": RuntimeError,
    "UnsupportedScheduleError": ValueError,
}
CATEGORY_OF_WARNING = {
    "OffloadBudgetWarning": UserWarning,
    "PageableFallbackWarning": RuntimeWarning,
    "SwapOutsideGroupWarning": UserWarning,
}
BASES = {"HyperOffloadError", "HyperOffloadWarning"}

#: The import paths the errors were documented at before they moved; each still works.
OLD_PATHS = [
    ("hyper_offload.eager", "ReplayMismatchError"),
    ("hyper_offload.eager", "OffloadSessionError"),
    ("hyper_offload.eager", "OffloadBudgetWarning"),
    ("hyper_offload.passes", "PlanningError"),
    ("hyper_offload.passes", "ScheduleError"),
    ("hyper_offload.passes", "TraceFormatError"),
    ("hyper_offload.passes", "OptimalPlannerError"),
    ("hyper_offload.passes.pipeline", "OrderError"),
    ("hyper_offload.passes.pipeline", "TimelineError"),
    ("hyper_offload.runtime", "TransferMisuseError"),
    ("hyper_offload.runtime", "DataLostError"),
    ("hyper_offload.runtime", "PageableFallbackWarning"),
    ("hyper_offload.runtime.pipeline", "SwapStateError"),
    ("hyper_offload.runtime.pipeline", "UnsupportedScheduleError"),
    ("hyper_offload.pipeline", "UnsupportedScheduleError"),
    ("hyper_offload.pipeline", "SwapOutsideGroupWarning"),
    ("hyper_offload.viz", "PlotDependencyError"),
]


def test_the_tables_above_cover_the_module() -> None:
    assert set(errors.__all__) == set(BUILTIN_OF_ERROR) | set(CATEGORY_OF_WARNING) | BASES


@pytest.mark.parametrize("name", sorted([*BUILTIN_OF_ERROR, *CATEGORY_OF_WARNING]))
def test_each_comes_from_the_root_under_its_base_and_keeps_its_builtin(name: str) -> None:
    cls = getattr(hyper_offload, name)
    assert cls is getattr(errors, name) and name in hyper_offload.__all__
    is_error = name in BUILTIN_OF_ERROR
    base = hyper_offload.HyperOffloadError if is_error else hyper_offload.HyperOffloadWarning
    assert issubclass(cls, base) and not issubclass(cls, _other_base(base))
    assert issubclass(cls, BUILTIN_OF_ERROR[name] if is_error else CATEGORY_OF_WARNING[name])
    if is_error:
        with pytest.raises(hyper_offload.HyperOffloadError):
            raise _instance(cls)


def _other_base(base: type) -> type:
    return (hyper_offload.HyperOffloadWarning if base is hyper_offload.HyperOffloadError
            else hyper_offload.HyperOffloadError)


def _instance(error: type[Exception]) -> Exception:
    """``error`` built as its raisers build it (two carry data for the caller)."""
    if error is errors.PlanningError:
        return error("boom", where="test", stage="plan", schedule=None, report=None)
    if error is errors.OrderError:
        return error("boom", violations=[])
    return error("boom")


@pytest.mark.parametrize(("module", "name"), OLD_PATHS)
def test_documented_import_paths_still_work(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


def test_no_other_module_defines_a_public_exception() -> None:
    defined = []
    for module, path in library_modules().items():
        if module == "hyper_offload.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and any(
                isinstance(base, ast.Name) and base.id.endswith(("Error", "Exception", "Warning"))
                for base in node.bases
            ):
                defined.append(f"{module}.{node.name}")
    assert defined == [], f"define user-facing errors in hyper_offload.errors: {defined}"


def test_the_guide_says_when_each_is_raised_and_what_to_do() -> None:
    section = (REPO / "docs" / "errors.md").read_text()
    rows = re.findall(r"^\| (`\w+`(?:, `\w+`)*) \[", section, flags=re.M)
    in_table = {name.strip("`") for row in rows for name in row.split(", ")}
    public = set(errors.__all__) - BASES - {"OffloadRuntimeError"}
    assert in_table == public


#: Builtin exceptions a module may raise because a Python protocol requires that class:
#: (exception, the function raising it). An abstract method's ``NotImplementedError``,
#: a module ``__getattr__``'s ``AttributeError``, ``python -m``'s exit status.
PROTOCOL_RAISES = {
    ("NotImplementedError", "*"),
    ("AttributeError", "__getattr__"),
    ("SystemExit", "<module>"),
}
_BUILTIN_ERRORS = {
    name for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}


def _builtin_raises(tree: ast.Module) -> list[tuple[str, str, int]]:
    """``(exception, enclosing function, line)`` of every ``raise Builtin(...)``."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name) and exc.id in _BUILTIN_ERRORS:
                    found.append((exc.id, function, child.lineno))
            visit(child, function)

    visit(tree, "<module>")
    return found


def test_the_library_raises_no_bare_builtin_on_purpose() -> None:
    """Issue 45: ``except hyper_offload.HyperOffloadError`` must catch every error raised
    on purpose; a ``raise ValueError(...)`` in the library would slip past it."""
    bare = []
    for module, path in library_modules().items():
        for name, function, line in _builtin_raises(ast.parse(path.read_text())):
            if (name, function) not in PROTOCOL_RAISES and (name, "*") not in PROTOCOL_RAISES:
                bare.append(f"{path.relative_to(REPO)}:{line} raise {name} in {function}")
    assert bare == [], (
        "raise a hyper_offload.errors class instead (ConfigurationError for a bad value, "
        f"ConfigurationTypeError for a bad type, ...): {bare}"
    )


def test_the_scan_finds_a_bare_raise() -> None:
    """The scan above is not vacuous: it sees a raise nested in a method and a branch."""
    source = "class A:\n    def f(self, x):\n        if x:\n            raise ValueError(x)\n"
    assert _builtin_raises(ast.parse(source)) == [("ValueError", "f", 4)]


def _bad_calls() -> dict[str, tuple[type[Exception], object]]:
    """Calls with a bad knob -> (the builtin the caller used to catch, the call)."""
    from hyper_offload.passes import GreedyResidencyPlanner
    from hyper_offload.passes.pipeline.build import compute_orders
    from hyper_offload.runtime import PinnedMemoryPool

    return {
        "negative budget": (ValueError, lambda: hyper_offload.OffloadConfig(
            max_resident_activation_mb=-1)),
        "NaN host cap": (ValueError, lambda: hyper_offload.OffloadConfig(
            max_offload_activation_mb=float("nan"))),
        "planner without plan()": (TypeError, lambda: hyper_offload.OffloadConfig(planner=3)),
        "bad verify": (ValueError, lambda: hyper_offload.OffloadConfig(verify="always")),
        "unknown options key": (ValueError, lambda: hyper_offload.backend(budget_mb=512)),
        "fraction out of range": (ValueError, lambda: hyper_offload.backend(
            max_resident_activation_fraction=2)),
        "options value of the wrong type": (TypeError, lambda: hyper_offload.backend(
            planner="greedy")),
        "session given a dict": (TypeError, lambda: hyper_offload.OffloadSession({})),
        "skip_offload of a number": (TypeError, lambda: hyper_offload.skip_offload(3)),
        "planner objective": (ValueError, lambda: GreedyResidencyPlanner(objective="speed")),
        "negative host pool": (ValueError, lambda: PinnedMemoryPool(max_host_bytes=-1)),
        "unknown pipeline schedule": (ValueError, lambda: compute_orders(
            "zigzag", num_ranks=2, stages_per_rank=1, num_microbatches=4)),
    }


@pytest.mark.parametrize("case", sorted(_bad_calls()))
def test_a_bad_knob_raises_a_configuration_error_that_keeps_its_builtin(case: str) -> None:
    """Issue 45: ``except hyper_offload.HyperOffloadError`` missed bad configuration."""
    builtin, call = _bad_calls()[case]
    with pytest.raises(hyper_offload.ConfigurationError) as error:
        call()  # type: ignore[operator]
    assert isinstance(error.value, builtin) and isinstance(error.value, ValueError)
    assert isinstance(error.value, hyper_offload.HyperOffloadError)
