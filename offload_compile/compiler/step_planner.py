"""The step plan of ``budget_scope="step"``: proposals, each priced on the one timeline.

Two ways to hold a step under one budget, which this module weighs:

* **keep on the floor** (:func:`.step_plan.plan_step`): every region runs its floor
  lowering (everything movable copied out, placed before the step was known) and, per
  invocation, the runtime keeps the slots that fit. Nothing is compiled again; it is
  the only way for a region invoked several times per step (one compiled graph serves
  every invocation, and their decisions differ).
* **a schedule made for the step** (:mod:`.step_trace`): the step laid out as one trace
  and planned by the region scope's own pipeline (the time-aware greedy, release
  holding, prefetch placement, the least predicted stall among its proposals), every
  region invoked once in the step free to move what that plan moves, where it places
  it; the others run their floor. Each such region is then lowered with its cut of the
  step's schedule (the backend compiles it once per schedule; a step of one region
  gets exactly the region scope's plan). Slots of those lowerings may still be kept.

:func:`plan_step_schedules` builds the proposals (keep on the floor; the step's
schedule, with and without run-time keeping), prices each with
:func:`~.step_timeline.predicted_step_stall` and keeps, among those whose peak is within
``max(budget, floor peak)``, the least predicted stall, then the fewest bytes moved,
then the first. Every input is a trace, a schedule or a timeline: the plan depends on
the model, never on the machine that plans it.

**Below the floor** (the budget is under the floor's peak: no plan can meet it). The
floor proposal moves everything movable; the step's schedule planned at the floor's
peak reaches that same peak moving only what it must (``benchmarks/peers.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import NamedTuple

from hyper_offload.errors import HyperOffloadError
from hyper_offload.passes.analysis.candidates import offload_candidates
from hyper_offload.passes.analysis.validator import check_schedule
from hyper_offload.passes.plan.choice_lowering import lower_offload_choice
from hyper_offload.passes.plan.greedy import GreedyResidencyPlanner
from hyper_offload.passes.plan.planning import plan_residency

from .step_model import Invocation, StepTimeline
from .step_plan import RegionProfile, StepPlan, plan_step, region_profile
from .step_timeline import RegionFloor, predicted_step_stall
from .step_trace import RegionTrace, StepTrace, build_step_trace, cut_schedule, kept_across

__all__ = [
    "StepProposal", "plan_step_schedules", "region_floor_profile", "step_floor_peak", "tailorable",
]

LOGGER = logging.getLogger("hyper_offload")


class StepProposal(NamedTuple):
    """One way to run the step: its plan, and what it was made as."""

    plan: StepPlan
    name: str


def region_floor_profile(
    index: int, region: RegionTrace, resident: tuple[int, ...]
) -> RegionProfile:
    """The floor profile :func:`.step_plan.plan_step` lays out for ``region``
    (``resident``: ``check_schedule``'s curve of its floor)."""
    return region_profile(index, region.num_fw_ops, resident, region.floor, region.trace,
                          region.held)


def tailorable(timeline: StepTimeline, regions: frozenset[int]) -> frozenset[Invocation]:
    """The invocations the step's schedule may plan: each of ``regions`` that runs once
    in ``timeline`` (forward and backward)."""
    counts: dict[int, int] = {}
    for invocation in timeline.invocations:
        counts[invocation.region] = counts.get(invocation.region, 0) + 1
    backward = {e.invocation for e in timeline.events if e.kind.value == "backward"}
    return frozenset(
        i for i in timeline.invocations
        if i.region in regions and counts[i.region] == 1 and i in backward
    )


def plan_step_schedules(
    timeline: StepTimeline,
    regions: Mapping[int, RegionTrace],
    floor_resident: Mapping[int, tuple[int, ...]],
    budget_bytes: int | None,
    *,
    budget_fraction: float | None = None,
    tailor: frozenset[int] = frozenset(),
    host_budget_bytes: int | None = None,
) -> StepPlan:
    """The step plan of ``timeline`` (module docstring). ``regions``: each region's floor
    (:class:`~.step_trace.RegionTrace`) and ``floor_resident`` its floor's bytes curve;
    ``tailor``: the regions that may be lowered again with a schedule of their own (the
    backend's choice: static sizes, a partition it can reproduce).
    ``host_budget_bytes``: every proposal keeps it (:func:`.step_plan.plan_step`)."""
    floors = {r: region_floor_profile(r, regions[r], floor_resident[r]) for r in regions}
    base = plan_step(timeline, floors, budget_bytes, budget_fraction=budget_fraction,
                     host_budget_bytes=host_budget_bytes)
    budget = base.budget_bytes
    proposals = [StepProposal(base, "keep on the floor")]
    planned = tailorable(timeline, tailor)
    if planned:
        proposals += [
            p._replace(plan=dataclasses.replace(
                p.plan, floor_peak_bytes=base.floor_peak_bytes, over_budget=base.over_budget,
                peak_without_offload_bytes=base.peak_without_offload_bytes,
                floor_op=base.floor_op, regions_floor_bytes=base.regions_floor_bytes,
            ))
            for p in _step_schedule_proposals(timeline, regions, floors, planned, budget,
                                              host_budget_bytes)
        ]
    cap = max(budget, base.floor_peak_bytes)
    priced = [
        (p._replace(plan=_priced(p.plan, timeline, regions)), index)
        for index, p in enumerate(proposals) if p.plan.peak_bytes <= cap or index == 0
    ]
    best, _ = min(priced, key=lambda pi: (pi[0].plan.predicted_stall_s,
                                          pi[0].plan.moved_bytes, pi[1]))
    return best.plan


def _step_schedule_proposals(
    timeline: StepTimeline,
    regions: Mapping[int, RegionTrace],
    floors: Mapping[int, RegionProfile],
    planned: frozenset[Invocation],
    budget: int,
    host_budget_bytes: int | None = None,
) -> list[StepProposal]:
    """The step's schedule, cut per region, with and without run-time keeping under
    ``budget``; none when planning fails (the floor stays). The step's trace is planned
    under ``budget``, or under its own floor's peak where that is higher (below the
    floor no plan meets the budget, and only the floor's peak can be reached: moving
    what does not lower it only costs time)."""
    step = build_step_trace(timeline, regions, planned, budget)
    at = max(budget, step_floor_peak(step))
    step = dataclasses.replace(step, trace=step.trace.with_budget(at))
    planner = GreedyResidencyPlanner(movable=step.movable,
                                     earliest_prefetch_op=step.earliest_reload)
    try:
        made = plan_residency(
            step.trace, planner, earliest_prefetch_op=step.earliest_reload,
            release_waits_for_d2h=True, latest_release_op=step.latest_release,
            where="hyper_offload step plan",
        )
    except HyperOffloadError as error:  # a bug: the floor still holds the step exactly
        LOGGER.warning("hyper_offload step plan: planning the step as one trace failed (%s); "
                       "every region keeps its floor lowering", error)
        return []
    schedules, profiles = {}, dict(floors)
    retained = dict(timeline.retained_bytes)
    for invocation in sorted(planned):
        region = regions[invocation.region]
        cut = cut_schedule(step, made.schedule, invocation, region, at)
        if cut is None:
            continue
        schedule, report = cut
        schedules[invocation.region] = schedule
        retained[invocation] = retained.get(invocation, 0) + kept_across(region, schedule)
        profiles[invocation.region] = region_profile(
            invocation.region, region.num_fw_ops, report.resident_bytes, schedule,
            region.trace, region.held,
        )
    if not schedules:
        return []
    # What the lowerings keep from forward to backward is held while the rest of the step
    # runs: the measured retained bytes are the floor's.
    held = dataclasses.replace(timeline, retained_bytes=retained)
    name = f"the step's schedule at {at} B"  # (for debugging: proposals are not reported)
    return [
        StepProposal(
            dataclasses.replace(plan_step(held, profiles, budget, keep=keep,
                                          host_budget_bytes=host_budget_bytes),
                                timeline=timeline,
                                schedules=dict(schedules), schedule_budget_bytes=at),
            f"{name}{'' if keep else ', nothing kept'}",
        )
        for keep in (True, False)
    ]


def step_floor_peak(step: StepTrace) -> int:
    """The least peak any plan of ``step``'s trace reaches: every movable gap offloaded
    (a floor of the one trace; the invocations it does not plan run their floor)."""
    floor = lower_offload_choice(step.trace, offload_candidates(step.trace, step.movable))
    return check_schedule(step.trace, floor).peak_resident_bytes


def _priced(plan: StepPlan, timeline: StepTimeline, regions: Mapping[int, RegionTrace]) -> StepPlan:
    """``plan`` with its predicted stall (each region running its lowering in ``plan``)."""
    lowered = {
        r: RegionFloor(region.trace, plan.schedules.get(r, region.floor), region.num_fw_ops)
        for r, region in regions.items()
    }
    stall = predicted_step_stall(timeline, lowered, plan.keep_for)
    return dataclasses.replace(plan, predicted_stall_s=stall)
