"""``hyper_offload.check``: is the library exact on *your* model?

Runs a few training steps of the user's own model twice from the same weights, inputs and
seed: once plainly (``torch.compile`` with the inner compiler alone, or eager), once with
everything movable moved (budget 0), and compares the loss and every gradient with
``torch.equal`` at every step. A third, plain run first makes sure the model is
deterministic at all (otherwise no comparison can judge anything).

On a mismatch in the compile door it bisects the moved set: it moves only half of the
moved storages (option ``move_only``; a storage moves whole), keeps the half that still
reproduces the mismatch, and ends at the smallest set it can reach, usually one saved
tensor, named with what the backward observes of it. That costs about ``2 log2(N)``
more runs for N moved storages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from hyper_offload.errors import CheckUsageError, OffloadBudgetWarning
from hyper_offload.progress import note

from .runs import (
    CheckReport,
    Door,
    Mismatch,
    Problem,
    RunResult,
    SavedTensor,
    Verdict,
    first_mismatch,
    measure_tiling,
    offload_compile,
    offload_eager,
    plain_compile,
    plain_eager,
    train,
    weighted_sum_loss,
)

__all__ = ["check"]

DOORS = ("compile", "eager")

Unit = frozenset[tuple[int, str]]
"""The saved tensors of one moved storage, as ``(region, saved name)``: they move together."""


def check(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    door: str = "compile",
    steps: int = 2,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    inner_compiler: str = "aot_eager",
    options: dict[str, Any] | None = None,
    bisect: bool = True,
) -> CheckReport:
    """Train ``model`` on ``example_inputs`` for ``steps`` steps without the library and
    with everything movable moved through ``door`` ("compile" or "eager"), and compare
    loss and gradients bit for bit (module docstring). ``model`` is not changed: every
    run trains a deep copy.

    ``loss_fn(output)`` makes the scalar loss (default: every floating or complex tensor
    of the output, summed with fixed pseudo-random weights). ``options``: further
    backend options (compile door; ``recompute`` defaults to "off" so that the
    bisection's runs partition alike) or ``OffloadConfig`` fields (eager door).
    ``inner_compiler``: the compile door's ("aot_eager" by default: quick to compile;
    "inductor" checks Inductor's code too, under deterministic algorithms).

    With ``options={"tile_sequence": ...}`` (not "off") the verdict is still the exact
    check's (every other option, tiling off), and one more run with tiling measures how
    far sequence tiling, which is not bit-exact, moves the loss and each gradient from
    plain training: ``report.tiling`` (max abs and relative deviation per value).

    Run it once on a small configuration of the model before a long run. It resets
    Dynamo's caches (each run compiles anew) and runs under
    ``torch.use_deterministic_algorithms(True, warn_only=True)``, restoring both settings'
    previous values where torch lets it (the caches are gone).
    """
    if door not in DOORS:
        raise CheckUsageError(f"hyper_offload.check: door must be one of {DOORS}, got {door!r}")
    if not isinstance(steps, int) or steps < 1:
        raise CheckUsageError(f"hyper_offload.check: steps must be an int >= 1, got {steps!r}")
    problem = Problem(model, tuple(example_inputs), loss_fn or weighted_sum_loss, steps)
    options = dict(options or {})
    tiling = options.pop("tile_sequence", "off")
    if tiling != "off" and door != "compile":
        raise CheckUsageError(
            f"hyper_offload.check: tile_sequence={tiling!r} is an option of the compile door; "
            "pass door='compile'")
    with _deterministic(), _quiet_about_its_own_budget():
        if door == "eager":
            return _check_eager(problem, options)
        options.setdefault("recompute", "off")
        want, undecided = _baseline(problem, lambda: plain_compile(inner_compiler))
        if undecided is not None:
            return undecided
        report = _check_compile(problem, want, inner_compiler, options, bisect)
        if tiling == "off":
            return report
        note(f"training once more with sequence tiling (tile_sequence={tiling!r})")
        deviation = measure_tiling(problem, want, inner_compiler,
                                   {**options, "tile_sequence": tiling})
        return dataclasses.replace(report, tiling=deviation, runs=report.runs + 1)


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """Deterministic kernels (plain Inductor on CPU differs from itself without them)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@contextlib.contextmanager
def _quiet_about_its_own_budget() -> Iterator[None]:
    """``check`` runs the doors at budget 0 (everything movable moved), under every
    model's floor on purpose: the doors' warnings that the budget is under the floor
    (eager ``OffloadBudgetWarning``, the compile door's log records marked
    ``UNDER_FLOOR``) are about that choice, not about the user's model or settings."""
    from hyper_offload.compiler.region_report import LOGGER, UNDER_FLOOR

    def not_under_floor(record: logging.LogRecord) -> bool:
        return not getattr(record, UNDER_FLOOR, False)

    LOGGER.addFilter(not_under_floor)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OffloadBudgetWarning)
            yield
    finally:
        LOGGER.removeFilter(not_under_floor)


def _baseline(problem: Problem, make: Callable[[], Door]) -> tuple[RunResult, CheckReport | None]:
    """The plain run, and a NOT_DETERMINISTIC report when a second one differs."""
    note("training without the library, twice (is the model deterministic?)")
    want = train(problem, make())
    again = train(problem, make())
    mismatch = first_mismatch(want.steps, again.steps)
    if mismatch is None:
        return want, None
    return want, CheckReport(
        door=make().name, verdict=Verdict.NOT_DETERMINISTIC, steps=problem.steps,
        moved_storages=0, moved_bytes=0, mismatch=mismatch, runs=2,
        note="two runs without the library already differ there; make the model "
             "deterministic (seeded dropout, deterministic kernels) and check again",
    )


def _check_compile(
    problem: Problem, want: RunResult, inner: str, options: dict[str, Any], bisect: bool
) -> CheckReport:
    note("training through the compile door, everything movable moved")
    door = offload_compile(inner, options)
    mismatch, error = _compare(problem, want, door)
    units = _moved_units(door.state)
    report = dict(door="compile", steps=problem.steps, moved_storages=len(units),
                  moved_bytes=door.state.runtime.bytes_d2h // problem.steps, error=error)
    if mismatch is None and not error:
        verdict = Verdict.PASS if units else Verdict.NOTHING_MOVED
        return CheckReport(verdict=verdict, runs=3, **report)
    if not bisect:
        return CheckReport(verdict=Verdict.FAIL, mismatch=mismatch, runs=3, **report)

    def fails(subset: Sequence[Unit]) -> bool:
        note(f"bisecting: moving {len(subset)} of {len(units)} storage(s) only")
        bad, raised = _compare(problem, want, offload_compile(inner, options,
                                                             frozenset().union(*subset)))
        return bad is not None or bool(raised)

    culprits, runs = _narrow(units, fails)
    return CheckReport(
        verdict=Verdict.FAIL, mismatch=mismatch, runs=3 + runs,
        responsible=_describe(door.state, culprits) if len(culprits) < len(units) else (),
        **report,
    )


def _compare(problem: Problem, want: RunResult, door: Door) -> tuple[Mismatch | None, str]:
    """The first mismatch of a run through ``door`` against ``want``, or what it raised
    (a run that raises is a failure too: the library must not break a model)."""
    try:
        got = train(problem, door)
    except Exception as error:  # reported, never swallowed: it is the check's finding
        return None, f"{type(error).__name__}: {error}"
    return first_mismatch(want.steps, got.steps), ""


def _narrow(units: list[Unit], fails: Callable[[Sequence[Unit]], bool]) -> tuple[list[Unit], int]:
    """The smallest part of ``units`` that still ``fails``, halving while one half does
    on its own; and how many runs that took. Stops at a set whose halves both pass (the
    mismatch needs tensors of both) or at one unit."""
    runs = 0
    while len(units) > 1:
        half = len(units) // 2
        for part in (units[:half], units[half:]):
            runs += 1
            if fails(part):
                units = part
                break
        else:
            break
    return units, runs


def _moved_units(backend: Any) -> list[Unit]:
    """The storages the backend's regions moved in any lowering they ran (or meant to,
    where lowering raised), each as the saved tensors on it."""
    units: dict[tuple[int, int], set[tuple[int, str]]] = {}
    for region in backend.regions:
        for plan in _plans_of(region):
            movable = plan.fx_trace.movable()
            for _, _, action in plan.schedule.actions():
                if action.kind.value == "COPY_D2H" and action.storage in movable:
                    units.setdefault((region.index, action.storage), set()).update(
                        (region.index, saved.name) for saved in movable[action.storage])
    return [frozenset(names) for _, names in sorted(units.items())]


def _plans_of(region: Any) -> list[Any]:
    """Every plan a region lowered (its floor, schedules made for the step) and the one
    last handed to the lowering."""
    plans = [lowering.planned for lowering in region.variants.values()]
    return plans + ([region.attempted] if region.attempted is not None else [])


def _saved_tensors(backend: Any) -> dict[tuple[int, str], Any]:
    return {
        (region.index, saved.name): saved
        for region in backend.regions for plan in _plans_of(region)
        for saved in plan.fx_trace.saved
    }


def _describe(backend: Any, units: Sequence[Unit]) -> tuple[SavedTensor, ...]:
    """Each saved tensor of ``units`` with what its backward observes."""
    saved_by_name = _saved_tensors(backend)
    found = []
    for region, name in sorted(set().union(*units)):
        saved = saved_by_name[(region, name)]
        props = saved.properties
        if props is None:
            description = f"{saved.nbytes} B"
        else:
            bits = "".join(f", {bit} bit" for bit, on in (("conjugate", props.conj),
                                                            ("negative", props.neg)) if on)
            description = (f"{str(props.dtype).removeprefix('torch.')}, size {list(props.size)}, "
                           f"stride {list(props.stride)}, offset {props.offset}{bits}; "
                           f"storage of {saved.base}")
        found.append(SavedTensor(region, name, description))
    return tuple(found)


def _check_eager(problem: Problem, config: dict[str, Any]) -> CheckReport:
    want, undecided = _baseline(problem, plain_eager)
    if undecided is not None:
        return undecided
    note("training through the eager door, everything movable moved")
    door = offload_eager(config)
    got = train(problem, door)
    session = door.state
    schedule = session.schedule
    moved = {a.storage for _, _, a in schedule.actions() if a.kind.value == "COPY_D2H"} \
        if schedule is not None else set()
    moved_bytes = session.last_stats.bytes_d2h if session.last_stats is not None else 0
    mismatch = first_mismatch(want.steps, got.steps)
    verdict = (Verdict.FAIL if mismatch is not None
               else Verdict.PASS if moved_bytes else Verdict.NOTHING_MOVED)
    return CheckReport(
        door="eager", verdict=verdict, steps=problem.steps, moved_storages=len(moved),
        moved_bytes=moved_bytes, mismatch=mismatch, runs=3,
        note="" if mismatch is None else (
            "the eager door restores each storage in place (every tensor on it keeps its "
            "metadata), so it has no saved tensor to bisect; run with "
            "OffloadConfig(verify=True) to find the transfer that differs"),
    )
