"""Plan a training step under one budget: :func:`plan_step`, the step model's entry.

::

    lay_out_step(timeline, regions)        the one layout (:mod:`.layout`)
      check_schedule(step.trace, floor)    the floor: every region's lowering in force
    plan_residency(step.trace @ cap,       the one planning pipeline, pricing every
                   StepPlanner(step))      proposal of :mod:`.planner`
    StepPlan                               per invocation: the slots it keeps; per
                                           tailored region: the schedule to lower it with;
                                           one PlanSummary for every report

The budget is ``budget_bytes``, or ``budget_fraction`` of the step's peak without offload
(every storage resident from its first to its last access). ``cap`` is the budget, or the
floor's peak where that is higher: below the floor no plan meets the budget and the
floor's peak is the least any plan reaches.

Invariant: ``peak_bytes <= max(budget, floor peak)`` unless the host budget kept slots on
the device (then ``binding`` is ``"host"`` or ``"both"``). Pure: no torch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ...analysis.liveness import resident_bytes_without_offload
from ...analysis.validator import ScheduleReport, check_schedule
from ...ir.schedule import ActionKind, ResidencyAction, ResidencySchedule
from ..planning import plan_residency
from ..report import PlanSummary
from .layout import StepTrace, lay_out_step, replace_storages, tailorable
from .model import Invocation, RegionFloor, StepTimeline, slots_of
from .planner import StepPlanner, StepProposal, kept_bytes_curve

__all__ = [
    "FloorOp", "InvocationPlan", "StepPlan", "cut_schedule", "plan_step", "regions_to_relower",
]


class InvocationPlan(NamedTuple):
    """What one invocation keeps, moves and retains (bytes; ``keep``: its region's
    ``copy_d2h`` slots it keeps on the device)."""

    invocation: Invocation
    keep: frozenset[int]
    kept_bytes: int
    moved_bytes: int
    retained_bytes: int


class FloorOp(NamedTuple):
    """The op at which the step's floor peaks: where it runs (``region`` index, or None
    for eager code between regions), its name, its own operands' bytes (what no plan
    moves while it runs) and the floor's bytes there; ``operands``: those operands by
    name and bytes, largest first, where the door knows them (a region op:
    ``FxTrace.operands``)."""

    region: int | None
    op: str
    op_bytes: int
    floor_bytes: int
    operands: tuple[tuple[str, int], ...] = ()

    def describe(self) -> str:
        where = ("eager code between compiled regions" if self.region is None
                 else f"region {self.region}")
        text = (f"{self.op} ({where}): its own inputs and outputs {_size(self.op_bytes)} of "
                f"the floor's {_size(self.floor_bytes)}")
        if self.operands:
            shown = ", ".join(f"{name} {_size(nbytes)}" for name, nbytes in self.operands[:6])
            more = len(self.operands) - 6
            text += f" ({shown}{f', {more} more' if more > 0 else ''})"
        return text


def _size(nbytes: int) -> str:
    """MiB with one decimal from 1 MiB on (``192,384.5 MiB``), KiB or bytes below: a
    tiny model's floor reads ``160.0 KiB``, not ``0.2 MiB``."""
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):,.1f} MiB"
    return f"{nbytes / 1024:,.1f} KiB" if nbytes >= 1024 else f"{nbytes} B"


@dataclass(frozen=True)
class StepPlan:
    """:func:`plan_step`'s answer for one step timeline (module docstring)."""

    timeline: StepTimeline
    summary: PlanSummary
    invocations: tuple[InvocationPlan, ...]
    proposal: str = "keep"
    """Which proposal won (:mod:`.planner`)."""
    over_budget: frozenset[tuple[int, int]] = frozenset()
    """``(region, op)`` pairs where the plan is over the budget only because the floor
    is, or the host budget kept it there: where only recompute, or a larger budget,
    could help (eager code between regions is not listed: no partition changes it)."""
    schedules: Mapping[int, ResidencySchedule] = field(default_factory=dict)
    """Regions this plan lowers again with a schedule made for the step: their schedule
    (every other region runs the lowering in force; ``keep_for`` names its slots)."""
    schedule_budget_bytes: int = 0
    """The budget ``check_schedule`` accepted each of ``schedules`` under, on its region's
    trace (the step's budget, or the step's floor peak where that is higher)."""
    floor_op: FloorOp | None = None
    """The op at which ``floor_peak_bytes`` is reached (what sets the floor)."""
    regions_floor_bytes: int | None = None
    """Where the timeline measured its eager code between regions: the floor without it
    (what the regions alone need; None otherwise)."""
    kept_for_host: int = 0
    """Slots kept on the device only because the host budget had no room for them."""
    layout: StepTrace | None = field(default=None, compare=False, repr=False)
    """The step as one trace, as the plan was made on it."""
    schedule: ResidencySchedule | None = field(default=None, compare=False, repr=False)
    """The plan's schedule of ``layout.trace`` (a kept slot has no moves: it costs its
    bytes from its copy on, one window more than this schedule shows, :func:`~.planner.choose_keep`)."""

    budget_bytes = property(lambda self: self.summary.budget_bytes)
    peak_bytes = property(lambda self: self.summary.peak_bytes)
    floor_peak_bytes = property(lambda self: self.summary.floor_peak_bytes)
    peak_without_offload_bytes = property(lambda self: self.summary.peak_without_offload_bytes)
    predicted_stall_s = property(lambda self: self.summary.predicted_stall_s)
    host_budget_bytes = property(lambda self: self.summary.host_budget_bytes)
    peak_host_bytes = property(lambda self: self.summary.peak_host_bytes)
    moved_bytes = property(lambda self: self.summary.moved_bytes)
    kept_bytes = property(lambda self: self.summary.kept_bytes)
    binding = property(lambda self: self.summary.binding)
    fits = property(lambda self: self.summary.fits)

    def keep_for(self, invocation: Invocation) -> frozenset[int]:
        """The slots ``invocation`` keeps; none (the floor) for one the plan never saw."""
        return self._keep.get(invocation, frozenset())

    @functools.cached_property
    def _keep(self) -> dict[Invocation, frozenset[int]]:
        # Built once: keep_for runs at every forward of every invocation.
        return {p.invocation: p.keep for p in self.invocations}

    def __repr__(self) -> str:
        return (
            f"StepPlan({len(self.invocations)} invocations, {self.proposal!r}, "
            f"budget={self.budget_bytes}, floor_peak={self.floor_peak_bytes}, "
            f"peak={self.peak_bytes}, moved={self.moved_bytes}, kept={self.kept_bytes})"
        )


def plan_step(
    timeline: StepTimeline,
    regions: Mapping[int, RegionFloor],
    budget_bytes: int | None,
    *,
    budget_fraction: float | None = None,
    host_budget_bytes: int | None = None,
    where: str = "hyper_offload step plan",
) -> StepPlan:
    """The plan of ``timeline`` (module docstring). ``regions``: every region the door
    has a trace of (:class:`~.model.RegionFloor`); one it lacks is laid out from the
    measured ``retained_bytes`` of its invocations."""
    step = lay_out_step(timeline, regions, tailored=tailorable(timeline, regions))
    floor = check_schedule(step.trace, step.floor)
    peak_without = max(resident_bytes_without_offload(step.trace), default=0)
    if budget_bytes is None:
        budget_bytes = int((budget_fraction or 1.0) * peak_without)
    cap = max(budget_bytes, floor.peak_resident_bytes)
    planner = StepPlanner(step, cap, host_budget_bytes, where=where)
    made = plan_residency(
        step.trace.with_budget(cap), planner, release_waits_for_d2h=True,
        fixed=frozenset(step.trace.storage_sizes), host_budget_bytes=host_budget_bytes,
        where=where,
    )
    won = next(p for p in planner.made if p.schedule is made.planned)
    plans = _invocation_plans(timeline, step, won)
    summary = PlanSummary(
        budget_bytes=budget_bytes,
        peak_bytes=max(won.keep.peak_bytes, made.check.peak_resident_bytes),
        floor_peak_bytes=floor.peak_resident_bytes, peak_without_offload_bytes=peak_without,
        moved_bytes=sum(p.moved_bytes for p in plans), kept_bytes=sum(p.kept_bytes for p in plans),
        peak_host_bytes=won.keep.peak_host_bytes, host_budget_bytes=host_budget_bytes,
        host_forced=won.keep.kept_for_host > 0, predicted_stall_s=made.predicted_stall_s,
    )
    return StepPlan(
        timeline, summary, plans, won.name,
        over_budget=_over_budget(step, floor.resident_bytes, won, budget_bytes),
        schedules=_cut_all(step, won),
        schedule_budget_bytes=won.tailored_budget_bytes,
        floor_op=_floor_op(timeline, step, floor.resident_bytes),
        regions_floor_bytes=_regions_floor(timeline, regions),
        kept_for_host=won.keep.kept_for_host, layout=step, schedule=won.schedule,
    )


def _invocation_plans(
    timeline: StepTimeline, step: StepTrace, won: StepProposal
) -> tuple[InvocationPlan, ...]:
    """Per invocation: the region slots it keeps, and the bytes it keeps and moves."""
    plans = []
    for invocation in timeline.invocations:
        storages = step.storages_of(invocation)
        mine = [s for s in won.slots if s.storage in storages]
        kept = [s for s in mine if s.storage in won.keep.kept]
        kept_bytes = sum(s.nbytes for s in kept)
        plans.append(InvocationPlan(
            invocation, frozenset(s.storage - step.base[invocation] for s in kept), kept_bytes,
            sum(s.nbytes for s in mine) - kept_bytes, timeline.retained_bytes.get(invocation, 0),
        ))
    return tuple(plans)


def _over_budget(
    step: StepTrace, floor: tuple[int, ...], won: StepProposal, budget_bytes: int
) -> frozenset[tuple[int, int]]:
    """Region ops where the floor is over the budget, and where the host budget kept the
    plan over it (eager code between regions is never listed)."""
    curves = [floor]
    if won.keep.kept_for_host:
        kept = [s for s in won.slots if s.storage in won.keep.kept]
        tree = kept_bytes_curve(check_schedule(step.trace, _base_of(step, won)).resident_bytes,
                                kept)
        curves.append(tuple(tree.values()))
    return frozenset(
        (owner.invocation.region, owner.op)
        for curve in curves for owner, value in zip(step.owners, curve)
        if value > budget_bytes and owner.invocation is not None and owner.op >= 0
    )


def _base_of(step: StepTrace, won: StepProposal) -> ResidencySchedule:
    """The schedule ``won`` kept slots of (the floor, or the step schedule laid in it)."""
    if won.tailored is None:
        return step.floor
    storages = frozenset(s for i in step.tailored for s in step.storages_of(i))
    return replace_storages(step.floor, storages, won.tailored)


def _cut_all(step: StepTrace, won: StepProposal) -> dict[int, ResidencySchedule]:
    """Each tailored invocation's region schedule cut from ``won`` (a cut its region's
    trace rejects is left out: that region keeps the lowering it runs)."""
    if won.tailored is None:
        return {}
    schedules = {}
    for invocation in sorted(step.tailored):
        cut = cut_schedule(step, won.tailored, invocation, won.tailored_budget_bytes)
        if cut is not None:
            schedules[invocation.region] = cut[0]
    return schedules


def cut_schedule(
    step: StepTrace, schedule: ResidencySchedule, invocation: Invocation, budget_bytes: int,
) -> tuple[ResidencySchedule, ScheduleReport] | None:
    """``invocation``'s part of the step's ``schedule`` as a schedule of its region's
    trace, and ``check_schedule``'s report of it there under ``budget_bytes``; None when
    the check rejects it or one of its actions lies outside the invocation's ops. The
    final release of a storage its region's trace retains (a model output: on the step,
    the next region's input) is left out."""
    region = step.regions[invocation.region]
    storages = step.storages_of(invocation)
    lo = storages.start
    reloaded = {a.storage for _, _, a in schedule.actions() if a.kind is ActionKind.COPY_H2D}
    ops = step.ops_of(invocation)
    inside = set(ops)
    for op, _where, action in schedule.actions():
        if action.storage in storages and op not in inside:
            return None

    def local(actions: tuple[ResidencyAction, ...]) -> tuple[ResidencyAction, ...]:
        return tuple(
            ResidencyAction(a.kind, a.storage - lo) for a in actions
            if a.storage in storages and not (
                a.kind is ActionKind.RELEASE_DEVICE and a.storage - lo in region.trace.retained
                and a.storage not in reloaded)
        )

    cut = ResidencySchedule(tuple(local(schedule.pre[op]) for op in ops),
                            tuple(local(schedule.post[op]) for op in ops))
    report = check_schedule(region.trace.with_budget(budget_bytes), cut)
    return None if report.violations else (cut, report)


def _floor_op(
    timeline: StepTimeline, step: StepTrace, floor: tuple[int, ...]
) -> FloorOp | None:
    """The op at the floor's peak (the first such op)."""
    if not floor:
        return None
    at = max(range(len(floor)), key=lambda i: (floor[i], -i))
    owner = step.owners[at]
    if owner.invocation is None:
        between = timeline.between
        assert between is not None
        return FloorOp(None, between.gap_ops[owner.op], between.gap_op_bytes[owner.op], floor[at])
    region = step.regions.get(owner.invocation.region)
    if region is None or owner.op < 0:
        return FloorOp(owner.invocation.region, step.trace.ops[at].name, 0, floor[at])
    return FloorOp(owner.invocation.region, region.trace.ops[owner.op].name,
                   region.trace.operand_bytes(owner.op), floor[at])


def _regions_floor(timeline: StepTimeline, regions: Mapping[int, RegionFloor]) -> int | None:
    """Where the eager code was measured: the floor's peak with it left out."""
    if timeline.between is None:
        return None
    alone = lay_out_step(dataclasses.replace(timeline, between=None), regions)
    return check_schedule(alone.trace, alone.floor).peak_resident_bytes


def regions_to_relower(
    plan: StepPlan,
    movable: Mapping[int, bool],
    done: frozenset[int],
    working: Mapping[int, Sequence[int]],
) -> tuple[int, ...]:
    """The regions the recompute search should re-lower for ``plan``: none when the plan
    fits and is predicted not to stall, nor when it only misses the budget at ops whose
    own working memory (``working[region][op]``: ``required_bytes`` of the region's floor
    trace, the op's inputs and outputs and what cannot move) is over it, which a partition
    does not change; else every region of the step that has a slot it could move
    (``movable``), except those in ``done``."""
    helpable = any(working[region][op] <= plan.budget_bytes for region, op in plan.over_budget)
    if plan.predicted_stall_s <= 0 and (plan.fits or not helpable):
        return ()
    regions = dict.fromkeys(p.invocation.region for p in plan.invocations)
    return tuple(r for r in regions if r not in done and movable.get(r, False))
