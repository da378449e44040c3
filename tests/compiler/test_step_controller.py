"""The compile door's step lifecycle, one transition per test (issue 49 item 2).

:class:`StepController` is driven here with a scripted :class:`StepLowering` (plans made
by the real step model on a hand-built region; lowerings only counted) and a recorder fed
by hand: no compile, no autograd graph."""

from __future__ import annotations

from dataclasses import replace

import torch

from hyper_offload.compiler.step.controller import StepController, StepEventName, StepState
from hyper_offload.passes.plan.step import (
    Invocation, StepEvent, StepEventKind, StepPlan, StepTimeline, plan_step,
)
from tests.passes.plan.step.test_step_plan import block

F, B = StepEventKind.FORWARD, StepEventKind.BACKWARD
INV = Invocation(0, 0)
ONE = StepTimeline((StepEvent(F, INV), StepEvent(B, INV)))


class Scripted:
    """A :class:`StepLowering` over one region: ``lowers`` says whether the plans want a
    lowering the region does not run yet; ``search`` the regions to search; ``tile`` the
    regions the next plan asks to be tiled again (asked once), ``tiles`` whether tiling
    them changes them."""

    def __init__(self, lowers: bool = False, search: tuple[int, ...] = (),
                 tile: tuple[int, ...] = (), tiles: bool = True) -> None:
        self.lowers, self.search, self.tile, self.tiles = lowers, search, tile, tiles
        self.lowered = False
        self.applied = 0
        self.retiled = 0
        self.asked_with: list[StepPlan] = []
        self.failed_searches: list[int] = []

    def plan(self, timeline, budget, fraction):
        plan = plan_step(timeline, {0: block()}, budget, budget_fraction=fraction)
        return plan, self.lowered_as(plan)

    def plan_in_force(self, timeline, budget, fraction):
        return replace(plan_step(timeline, {0: block()}, budget), proposal="in force")

    def lowered_as(self, plan: StepPlan) -> bool:
        return not self.lowers or self.lowered or plan.proposal == "in force"

    def apply(self, plan, timeline) -> bool:
        self.applied += 1
        self.lowered, self.search = True, ()
        return False

    def wants_search(self, plan):
        return self.search

    def retiling(self, plan: StepPlan) -> tuple[int, ...]:
        self.asked_with.append(plan)
        asked, self.tile = self.tile, ()
        return asked

    def retile(self) -> bool:
        self.retiled += 1
        if self.tiles:
            self.lowered = False  # a new graph: the lowerings made for the old one are gone
        return self.tiles

    def recomputes(self, plan) -> bool:
        return False

    def slots(self, region, sizes=()):
        return block().slots, max(block().resident)


def controller(lowering: Scripted, budget: int | None = 10**6) -> StepController:
    return StepController(lowering, device=lambda: torch.device("cpu"), budget_bytes=budget,
                          fraction=None, recompute=True)


def test_a_training_forward_leaves_cold_for_learning() -> None:
    c = controller(Scripted())
    assert c.state is StepState.COLD
    c.before_forward(grad=True)
    assert c.state is StepState.LEARNING
    assert c.transitions == [(StepState.COLD, StepEventName.FORWARD, StepState.LEARNING)]


def test_a_forward_without_grad_changes_nothing_in_any_state() -> None:
    for lowers in (False, True):
        c = controller(Scripted(lowers=lowers))
        c.before_forward(grad=False)
        assert c.state is StepState.COLD and c.plan is None
        c.before_forward(grad=True)
        c._step_done(ONE)
        state, plan, made = c.state, c.plan, c.plans_made
        for _ in range(3):
            c.before_forward(grad=False)
        assert (c.state, c.plan, c.plans_made) == (state, plan, made)
        assert c._lowering.applied == 0  # no lowering inside a forward without grad


def test_a_step_done_plans_it_and_a_plan_that_needs_nothing_is_in_force() -> None:
    c = controller(Scripted())
    c.before_forward(grad=True)
    c._step_done(ONE)
    assert c.state is StepState.PLANNED and c.plan.timeline == ONE and c.plans_made == 1
    c._step_done(ONE)  # the same step again: nothing is planned again
    assert c.plans_made == 1 and c.replans == 1


def test_a_plan_that_wants_lowerings_waits_for_the_next_training_forward() -> None:
    lowering = Scripted(lowers=True)
    c = controller(lowering)
    c.before_forward(grad=True)
    c._step_done(ONE)
    assert c.state is StepState.RELOWERING and c.plan.proposal == "in force"
    assert c.wanted is not None and lowering.applied == 0
    c.before_forward(grad=False)  # validation: still waiting, nothing compiled
    assert c.state is StepState.RELOWERING and lowering.applied == 0
    c.before_forward(grad=True)
    assert lowering.applied == 1 and c.state is StepState.PLANNED
    assert c.plan.proposal != "in force" and c.wanted is None


def test_a_recompute_search_is_asked_for_once_and_made_at_the_next_training_forward() -> None:
    lowering = Scripted(search=(0,))
    c = controller(lowering)
    c.before_forward(grad=True)
    c._step_done(ONE)
    assert c.state is StepState.RELOWERING
    c.before_forward(grad=True)
    assert lowering.applied == 1 and c.state is StepState.PLANNED


def test_another_step_shape_gets_its_own_plan_and_a_seen_one_its_cached_plan() -> None:
    c = controller(Scripted())
    c.before_forward(grad=True)
    c._step_done(ONE)
    first = c.plan
    two = StepTimeline(ONE.events, sizes={INV: (("s0", 8),)})
    c._step_done(two)
    assert c.plan.timeline == two and c.plans_made == 2
    c._step_done(ONE)  # back to the first shape: its plan, not made again
    assert c.plan is first and c.plans_made == 2


def test_an_absolute_budget_keeps_what_it_holds_before_any_plan() -> None:
    c = controller(Scripted(), budget=10**6)
    c.before_forward(grad=True)
    assert c.keep_for(INV, ()) == {s.storage for s in block().slots}
    peak = max(block().resident)
    for budget in range(peak + 8):  # never more than the room the region's peak leaves
        tight = controller(Scripted(), budget=budget)
        tight.before_forward(grad=True)
        kept = sum(s.nbytes for s in block().slots if s.storage in tight.keep_for(INV, ()))
        assert kept <= max(budget - peak, 0)


def test_a_floor_a_region_may_tile_lower_waits_retiling_for_the_next_training_forward() -> None:
    lowering = Scripted(tile=(0,))
    c = controller(lowering, budget=None)
    c._fraction = 0.5
    c.before_forward(grad=True)
    c._step_done(ONE)
    first = c.plan
    assert c.state is StepState.RETILING and lowering.asked_with == [first]
    assert c._budget_args() == (first.budget_bytes, None)  # the tiled step: the same budget
    c.before_forward(grad=False)  # validation: nothing tiled, nothing compiled
    assert c.state is StepState.RETILING and lowering.retiled == 0
    c.before_forward(grad=True)
    assert lowering.retiled == 1 and lowering.applied == 0 and c.state is StepState.PLANNED
    assert c.plans_made == 2 and c.plan is not first  # planned again on the tiled graphs
    assert c.transitions[-2:] == [
        (StepState.LEARNING, StepEventName.STEP_DONE, StepState.RETILING),
        (StepState.RETILING, StepEventName.FORWARD, StepState.PLANNED),
    ]


def test_retiling_drops_the_lowerings_wanted_for_the_graphs_before_it() -> None:
    lowering = Scripted(lowers=True, tile=(0,))
    c = controller(lowering)
    c.before_forward(grad=True)
    c._step_done(ONE)
    assert c.state is StepState.RETILING and lowering.asked_with[0] is not c.plan  # the wanted
    assert lowering.asked_with[0].proposal != "in force"
    c.before_forward(grad=True)  # tiled: the new graphs' plan wants lowerings of its own
    assert lowering.retiled == 1 and lowering.applied == 0
    assert c.state is StepState.RELOWERING and c.plans_made == 2
    c.before_forward(grad=True)
    assert lowering.applied == 1 and c.state is StepState.PLANNED


def test_a_tiling_that_changes_nothing_makes_the_lowerings_wanted() -> None:
    lowering = Scripted(lowers=True, tile=(0,), tiles=False)
    c = controller(lowering)
    c.before_forward(grad=True)
    c._step_done(ONE)
    c.before_forward(grad=True)
    assert lowering.retiled == 1 and lowering.applied == 1
    assert c.state is StepState.PLANNED and c.plans_made == 1  # its plan, kept


def test_a_planned_step_whose_floor_a_region_may_tile_lower_is_retiled_once() -> None:
    lowering = Scripted()
    c = controller(lowering)
    c.before_forward(grad=True)
    c._step_done(ONE)
    assert c.state is StepState.PLANNED
    lowering.tile = (0,)  # e.g. the recompute search's partition works on more bytes
    c._step_done(ONE)
    assert c.state is StepState.RETILING and lowering.asked_with[-1] is c.plan
    c.before_forward(grad=True)
    assert lowering.retiled == 1 and c.state is StepState.PLANNED
    c._step_done(ONE)  # asked once: the lowering does not ask again
    assert c.state is StepState.PLANNED and lowering.retiled == 1
