"""Recompute co-planned with the step (``budget_scope="step"``, ``recompute="auto"``).

A region's first lowering is its floor under torch's own partition: nothing is known of
the step yet, and the step plan later keeps what fits. Once a step is known, the step
plan may still fall short in two ways only recompute can fix:

* it does not fit: the floor is over the budget somewhere (a region's working memory
  and what the rest of the step holds there), and offloading cannot go lower;
* it stalls: the bytes it must move take longer than the compute that could hide them.

Then (:func:`regions_to_relower`; a step that misses the budget only at ops whose own
inputs and outputs are over it is left alone: no partition changes those) every region
of the step that saves anything is
*re-lowered once*: the recompute search (:func:`~.recompute_search.choose_partition`)
runs again on the region's joint graph, each candidate partition planned at its floor
and ranked by :class:`StepScorer`: the step plan made with that partition in the
region's place (every other region as it is; the region may be lowered again with a
schedule made for the step) and its predicted stall, plus the step's compute (the
region's once per invocation). The fastest predicted step that fits wins;
with none fitting, the lowest predicted peak. The time objective and the search are the
region scope's, only priced on the whole step. Before the next step's first forward the
regions are searched one at a time, each against the others as lowered then (one pass
of coordinate descent; a region is never searched twice, so a step cannot oscillate),
on graphs only; a region whose search keeps torch's partition is not compiled again.

When a region changed, the step is planned at once with the new floor profiles (the
last step's order and retained bytes), so the next step runs planned; at its end the
step is re-planned if its measured bytes differ. With a fraction the budget stays the
one resolved on the first step's plan (torch's partitions), as the region scope
resolves its fraction against the default partition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hyper_offload.passes.analysis.predicted_timeline import op_durations

from hyper_offload.passes.ir.schedule import ResidencySchedule

from .recompute_search import PlanScore
from .region_plan import GraphPlan
from .step_model import StepTimeline
from .step_plan import RegionProfile, StepPlan
from .step_planner import plan_step_schedules
from .step_trace import RegionTrace, region_trace

__all__ = ["StepScorer", "regions_to_relower"]


def regions_to_relower(
    plan: StepPlan,
    stall_s: float,
    profiles: Mapping[int, RegionProfile],
    done: frozenset[int],
    working: Mapping[int, Sequence[int]],
) -> tuple[int, ...]:
    """The regions to re-lower with the recompute search (module docstring): none when
    the plan fits and is predicted not to stall, nor when it only misses the budget at
    ops whose own working memory (``working[region][op]``: ``required_bytes`` of the
    region's floor trace, the op's inputs and outputs and what cannot move) is over it,
    which a partition does not change; else every
    region of the step with a saved activation it could move (a slot), except those in
    ``done``."""
    helpable = any(working[region][op] <= plan.budget_bytes for region, op in plan.over_budget)
    if stall_s <= 0 and (plan.fits or not helpable):
        return ()
    regions = dict.fromkeys(p.invocation.region for p in plan.invocations)
    return tuple(r for r in regions if r not in done and profiles[r].slots)


class StepScorer:
    """The objective of ``region``'s re-lowering: a candidate partition's floor put in the
    region's place on ``timeline`` (which may be lowered again with a schedule made for
    the step, as the backend would), the step planned under ``budget_bytes``
    (:func:`~.step_planner.plan_step_schedules`), and its predicted compute, stall, fit
    and peak. ``schedules[id(plan)]``: the schedule (and the budget it was checked
    under) the step plan made for the region with that candidate, if any: the lowering
    the backend compiles when the candidate wins.

    ``regions`` / ``resident``: every other region as the step plan sees it now;
    ``tailor``: those of them that may be lowered again; ``host_budget_bytes``: the host
    budget every step plan keeps (a partition that recomputes needs less of it)."""

    def __init__(
        self,
        timeline: StepTimeline,
        regions: Mapping[int, RegionTrace],
        resident: Mapping[int, tuple[int, ...]],
        budget_bytes: int,
        region: int,
        tailor: frozenset[int],
        host_budget_bytes: int | None = None,
    ) -> None:
        self.timeline, self.regions, self.resident = timeline, dict(regions), dict(resident)
        self.budget_bytes, self.region, self.tailor = budget_bytes, region, tailor | {region}
        invocations = [i.region for i in timeline.invocations]
        self.others_s = sum(
            sum(op_durations(regions[r].trace)) for r in invocations if r != region
        )
        self.count = invocations.count(region)
        self.schedules: dict[int, tuple[ResidencySchedule, int]] = {}
        self.host_budget_bytes = host_budget_bytes

    def __call__(self, plan: GraphPlan) -> PlanScore:
        fx_trace = plan.fx_trace
        candidate = region_trace(fx_trace, plan.schedule)
        step = plan_step_schedules(
            self.timeline, {**self.regions, self.region: candidate},
            {**self.resident, self.region: plan.check.resident_bytes}, self.budget_bytes,
            tailor=self.tailor, host_budget_bytes=self.host_budget_bytes,
        )
        if self.region in step.schedules:
            self.schedules[id(plan)] = (step.schedules[self.region], step.schedule_budget_bytes)
        return PlanScore(self.others_s + self.count * plan.compute_s, step.predicted_stall_s,
                         step.fits, step.peak_bytes)
