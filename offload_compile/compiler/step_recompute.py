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
and ranked by :func:`step_scorer`: the step plan made with that partition in the
region's place (every other region as it is) and its predicted stall, plus the step's
compute (the region's once per invocation). The fastest predicted step that fits wins;
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

from .recompute_search import PlanScore, Scorer
from .region_plan import GraphPlan
from .step_model import StepTimeline
from .step_plan import RegionProfile, StepPlan, held_inputs, plan_step, region_profile
from .step_timeline import RegionFloor, predicted_step_stall

__all__ = ["regions_to_relower", "step_scorer"]


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


def step_scorer(
    timeline: StepTimeline,
    profiles: Mapping[int, RegionProfile],
    floors: Mapping[int, RegionFloor],
    budget_bytes: int,
    region: int,
) -> Scorer:
    """The objective of ``region``'s re-lowering: a candidate partition's floor plan put
    in the region's place on ``timeline``, the step planned under ``budget_bytes``, and
    its predicted compute, stall, fit and peak."""
    invocations = [i.region for i in timeline.invocations]
    others_s = sum(
        sum(op_durations(floors[r].trace)) for r in invocations if r != region
    )
    count = invocations.count(region)

    def score(plan: GraphPlan) -> PlanScore:
        trace = plan.fx_trace
        profile = region_profile(
            region, trace.num_fw_ops, plan.check.resident_bytes, plan.schedule, trace.trace,
            held_inputs(trace.node_storage, trace.activation_inputs),
        )
        floor = RegionFloor(trace.trace, plan.schedule, trace.num_fw_ops)
        step = plan_step(timeline, {**profiles, region: profile}, budget_bytes)
        stall = predicted_step_stall(timeline, {**floors, region: floor}, step.keep_for)
        return PlanScore(others_s + count * plan.compute_s, stall, step.fits, step.peak_bytes)

    return score
