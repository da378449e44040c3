"""What planners give: the planner protocol, a plan's summary, a gap-choosing planner's report.

The planner protocol: anything with ``plan(trace) -> ResidencySchedule`` plugs in.

A planner may also offer ``proposals(trace) -> Sequence[ResidencySchedule]`` (optional,
so not part of the runtime-checkable protocol): several schedules, each meeting the same
contract, among which :func:`~.planning.plan_residency` keeps the one its timeline model
predicts to stall least once placed (fewest bytes breaking ties). That is how the
objective becomes step time without the planner knowing a door's placement rules.

One summary of a plan, whatever made it: the figures every report and CLI prints.

A region's plan (the compile door's region scope), the eager session's plan, a step's
plan (the compile door's step scope, ``estimate``) and ``hyper-offload plan`` all answer
the same questions: how high the device bytes go against the budget, how low they could
go (the floor: everything movable moved), how high without offload, how many bytes move
and stay, how many host bytes that takes against the host budget, which budget binds,
and what it costs in time. :class:`PlanSummary` holds those figures and derives
``binding`` and ``fits`` in one place. Pure: no torch.

``PlanReport`` and the one pipeline every gap-choosing planner shares.

A planner that offloads whole gaps differs from another only in *which* gaps it picks:
candidates and per-op excess come from :mod:`..analysis.liveness`, the pick from the
planner, and the schedule from :func:`~.choice_lowering.lower_offload_choice`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..analysis.liveness import InfeasibleOp, OffloadCandidate, budget_excess, offload_candidates
from ..ir.schedule import ResidencySchedule
from ..ir.trace import ActivationTrace, StorageId
from .choice_lowering import lower_offload_choice

__all__ = [
    "Binding",
    "ChooseGaps",
    "PlanReport",
    "PlanSummary",
    "ResidencyPlanner",
    "binding",
    "plan_by_choice",
]


@runtime_checkable
class ResidencyPlanner(Protocol):
    """Decides what to move and when; never touches a device.

    Contract: the returned schedule has one pre/post slot per op of ``trace`` and passes
    ``check_schedule(trace, schedule)`` with no violation other than those the trace's
    infeasible ops force.
    """

    def plan(self, trace: ActivationTrace) -> ResidencySchedule: ...


Binding = str
"""``"device"``, ``"host"``, ``"both"`` or ``"none"`` (see :func:`binding`)."""


def binding(*, budget_bytes: int, floor_peak_bytes: int, peak_bytes: int, moved_bytes: int,
            host_forced: bool) -> Binding:
    """Which budget limits a plan.

    ``"host"``: the host budget kept bytes on the device past the device budget (more
    host memory, or recompute, helps); ``"device"``: the floor alone is over the device
    budget (only recompute or a larger budget helps), or the device budget made the plan
    move bytes and the host had room; ``"both"``: both at once; ``"none"``: nothing had
    to move. ``host_forced``: whether the host budget made the plan keep anything."""
    host = host_forced and peak_bytes > max(budget_bytes, floor_peak_bytes)
    device = floor_peak_bytes > budget_bytes
    if host:
        return "both" if device else "host"
    return "device" if device or moved_bytes else "none"


@dataclass(frozen=True)
class PlanSummary:
    """A plan's figures (bytes; *predicted*, except where a door says it measured them).

    ``moved_bytes`` is what goes to the host per step (each byte also comes back once);
    ``kept_bytes`` what a plan could have moved and keeps on the device; ``floor_peak_bytes``
    the least peak any plan of the same lowering reaches; ``peak_host_bytes`` counts host
    buffers as the pool holds them (power-of-two buckets)."""

    budget_bytes: int
    peak_bytes: int
    floor_peak_bytes: int
    peak_without_offload_bytes: int
    moved_bytes: int
    kept_bytes: int = 0
    peak_host_bytes: int = 0
    host_budget_bytes: int | None = None
    host_forced: bool = False
    """Whether the host budget made the plan keep bytes it would have moved."""
    predicted_stall_s: float = 0.0

    @property
    def fits(self) -> bool:
        """Whether the peak is within the budget (never when the floor is not)."""
        return self.peak_bytes <= self.budget_bytes

    @property
    def binding(self) -> Binding:
        return binding(budget_bytes=self.budget_bytes, floor_peak_bytes=self.floor_peak_bytes,
                       peak_bytes=self.peak_bytes, moved_bytes=self.moved_bytes,
                       host_forced=self.host_forced)


#: Picks the gaps to offload from all candidates and the per-op bytes over budget.
ChooseGaps = Callable[[Sequence[OffloadCandidate], Sequence[int]], Sequence[OffloadCandidate]]


@dataclass(frozen=True)
class PlanReport:
    """What a planner decided, and why it could not do better where it could not.

    ``chosen`` are the offloaded gaps in acceptance order; ``infeasible_ops`` the ops
    whose own operands exceed the budget (with the excess bytes); ``plan_seconds`` the
    wall time of the analysis and lowering.
    """

    schedule: ResidencySchedule
    chosen: tuple[OffloadCandidate, ...]
    infeasible_ops: tuple[InfeasibleOp, ...]
    num_candidates: int
    planner: str
    plan_seconds: float

    @property
    def feasible(self) -> bool:
        return not self.infeasible_ops

    def __repr__(self) -> str:
        return (
            f"PlanReport({self.planner}: {len(self.chosen)}/{self.num_candidates} gaps offloaded, "
            f"{len(self.infeasible_ops)} infeasible ops, {self.plan_seconds * 1e3:.1f} ms)"
        )


def plan_by_choice(
    trace: ActivationTrace,
    choose: ChooseGaps,
    *,
    planner: str,
    movable: frozenset[StorageId] | None = None,
) -> PlanReport:
    """Analyse ``trace``, let ``choose`` pick gaps (of ``movable`` storages only, when
    given), lower the pick; time the whole."""
    started = time.perf_counter()
    candidates = offload_candidates(trace, movable)
    excess, infeasible = budget_excess(trace)
    chosen = choose(candidates, excess)
    return PlanReport(
        schedule=lower_offload_choice(trace, chosen),
        chosen=tuple(chosen),
        infeasible_ops=tuple(infeasible),
        num_candidates=len(candidates),
        planner=planner,
        plan_seconds=time.perf_counter() - started,
    )
