"""The step model on hand-built regions and timelines (pure: no torch, no compile).

Every plan is judged by the one validator on the step trace it was made on, and its
peak against an independent count of what keeping a slot costs at run time (a device
copy from the slot's copy on, beside its source until the source's release)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_offload.passes import (
    ActionKind, ActivationTrace, ResidencyAction, ResidencySchedule, check_schedule,
    resident_bytes_without_offload,
)
from hyper_offload.passes.plan.report import FloorPlanner
from hyper_offload.passes.plan.host_budget import host_curve
from hyper_offload.passes.plan.step import (
    BetweenRegions, Invocation, RegionFloor, StepEvent, StepEventKind, StepTimeline,
    lay_out_step, plan_step,
)
from hyper_offload.passes.plan.step.plan import regions_to_relower

F, B = StepEventKind.FORWARD, StepEventKind.BACKWARD


def _timeline(order, retained=None, between=None) -> StepTimeline:
    events = tuple(StepEvent(kind, inv) for kind, inv in order)
    return StepTimeline(events, retained or {}, between=between)


def region_of(accesses, sizes, num_fw, movable, retained=(), held=(), lowerable=False,
              durations=None) -> RegionFloor:
    """A region from its ops' accesses, planned at its floor (every movable storage's gap
    across the forward/backward boundary offloaded)."""
    trace = ActivationTrace.from_accesses(accesses, sizes, budget_bytes=0, retained=set(retained))
    if durations is not None:
        trace = replace(trace, ops=tuple(replace(op, duration_s=d)
                                         for op, d in zip(trace.ops, durations)))
    floor = FloorPlanner(boundary=num_fw, movable=frozenset(movable)).plan(trace)
    return RegionFloor(trace, num_fw, floor, frozenset(movable), frozenset(held), lowerable)


def block(lowerable: bool = False) -> RegionFloor:
    """Three forward ops, three backward ops. Storage 0 (4 B) is saved and read by the
    last backward op, storage 1 (2 B) by the first; storage 2 (1 B) is the block's working
    memory at every op (never moved); storage 3 (1 B) is the model output."""
    accesses = [{0: "W", 2: "W"}, {0: "R", 1: "W", 2: "R"}, {0: "R", 1: "R", 2: "R", 3: "W"},
                {1: "R", 2: "R"}, {1: "R", 2: "R"}, {0: "R", 2: "R"}]
    return region_of(accesses, {0: 4, 1: 2, 2: 1, 3: 1}, 3, {0, 1}, retained={3},
                     lowerable=lowerable)


def runtime_peak(plan, regions) -> int:
    """The plan's device peak as the runtime holds it: the validator's curve of the plan's
    schedule, plus each kept slot's device copy beside its source (from its copy to the
    source's release, found in the region's own schedule)."""
    report = check_schedule(plan.layout.trace, plan.schedule)
    curve = list(report.resident_bytes)
    positions: list[tuple[Invocation, int]] = []  # (invocation, region op), eager ops skipped
    for index, (kind, inv) in enumerate(plan.timeline.events):
        if plan.timeline.between is not None and plan.timeline.between.gap(index):
            positions.append((None, -1))
        region = regions[inv.region]
        ops = range(region.num_fw_ops) if kind is F else range(region.num_fw_ops,
                                                                  region.trace.num_ops)
        positions += [(inv, op) for op in ops]
    for p in plan.invocations:
        region = regions[p.invocation.region]
        for slot in region.slots:
            if slot.storage not in p.keep:
                continue
            for t, (inv, op) in enumerate(positions):
                if inv == p.invocation and slot.copy < op <= slot.release:
                    curve[t] += slot.nbytes
    return max(max(curve, default=0), report.peak_resident_bytes)


def test_a_step_of_one_region_lays_out_as_the_region_itself() -> None:
    region = block()
    inv = Invocation(0, 0)
    step = lay_out_step(_timeline([(F, inv), (B, inv)]), {0: region})
    assert step.trace.ops == region.trace.ops
    assert step.trace.retained == region.trace.retained
    assert check_schedule(step.trace, step.floor).resident_bytes == region.resident


def test_four_invocations_of_one_block_keep_the_latest_first() -> None:
    invs = [Invocation(0, i) for i in range(4)]
    timeline = _timeline([(F, i) for i in invs] + [(B, i) for i in reversed(invs)])
    regions = {0: block()}
    plain = plan_step(timeline, regions, budget_bytes=10**6)
    assert plain.moved_bytes == 0 and plain.kept_bytes == 4 * 6
    plan = plan_step(timeline, regions, budget_bytes=plain.floor_peak_bytes + 8)
    assert plan.fits and runtime_peak(plan, regions) == plan.peak_bytes
    # The last block's forward is followed at once by its backward: its slots hold the
    # device over the fewest ops and are kept first; the first block's move.
    assert plan.keep_for(invs[3]) == {0, 1} and plan.keep_for(invs[0]) == frozenset()
    assert plan.moved_bytes + plan.kept_bytes == 4 * 6
    assert plan.peak_without_offload_bytes == max(resident_bytes_without_offload(plan.layout.trace))
    assert plan.keep_for(Invocation(0, 9)) == frozenset()  # one the plan never saw: the floor


def test_a_fraction_is_of_the_step_peak_without_offload() -> None:
    invs = [Invocation(0, i) for i in range(3)]
    timeline = _timeline([(F, i) for i in invs] + [(B, i) for i in reversed(invs)])
    plan = plan_step(timeline, {0: block()}, None, budget_fraction=0.75)
    assert plan.budget_bytes == int(0.75 * plan.peak_without_offload_bytes)
    assert plan.peak_bytes <= max(plan.budget_bytes, plan.floor_peak_bytes)


def test_a_region_without_a_trace_holds_its_measured_bytes_from_forward_to_backward() -> None:
    a, b = Invocation(0, 0), Invocation(1, 0)
    timeline = _timeline([(F, a), (F, b), (B, b), (B, a)], retained={a: 100})
    plan = plan_step(timeline, {1: block()}, budget_bytes=10**6)  # region 0: no trace
    alone = plan_step(_timeline([(F, b), (B, b)]), {1: block()}, budget_bytes=10**6)
    # b's whole forward and backward run while a holds its 100 bytes.
    assert plan.floor_peak_bytes == 100 + alone.floor_peak_bytes
    assert plan.invocations[0].retained_bytes == 100


def test_a_blocks_input_is_held_by_its_caller_through_the_whole_forward() -> None:
    # Storage 0 (8 B): the block's input, read at op 1 and by the backward; the floor
    # copies it out after op 1, but the caller holds it until the forward returns.
    accesses = [{1: "W"}, {0: "R", 1: "R"}, {1: "R"}, {0: "R"}]
    region = region_of(accesses, {0: 8, 1: 1}, 3, {0}, held={0})
    inv = Invocation(0, 0)
    step = lay_out_step(_timeline([(F, inv), (B, inv)]), {0: region})
    resident = check_schedule(step.trace, step.floor).resident_bytes
    assert region.resident[:3] == (1, 9, 1)  # the region alone frees it after op 1
    assert resident[:3] == (1, 9, 9)  # on the step, the caller still holds it at op 2


def test_a_model_output_is_the_next_regions_input_and_released_there() -> None:
    a, b = Invocation(0, 0), Invocation(0, 1)
    timeline = _timeline([(F, a), (F, b), (B, b), (B, a)])
    step = lay_out_step(timeline, {0: block()})
    output_a, output_b = step.base[a] + 3, step.base[b] + 3
    assert output_b in step.trace.retained and output_a not in step.trace.retained
    assert check_schedule(step.trace.with_budget(10**6), step.floor).ok


def test_the_peak_without_offload_does_not_depend_on_where_the_floor_releases() -> None:
    # Issue 44: the floor's release waits for its D2H, so a slower link releases later.
    trace = ActivationTrace.from_accesses(
        [{0: "W", 1: "W"}, {1: "R"}, {1: "R"}, {1: "R"}, {0: "R", 1: "R"}], {0: 8, 1: 1},
        budget_bytes=0,
    )
    d2h = ResidencyAction(ActionKind.COPY_D2H, 0)
    release = ResidencyAction(ActionKind.RELEASE_DEVICE, 0)
    pre = ((),) * 4 + ((ResidencyAction(ActionKind.COPY_H2D, 0),
                        ResidencyAction(ActionKind.WAIT_H2D, 0)),)
    last = ((release, ResidencyAction(ActionKind.RELEASE_HOST, 0),
             ResidencyAction(ActionKind.RELEASE_DEVICE, 1)),)
    fast = ResidencySchedule(pre, ((d2h, release), (), (), ()) + last)
    slow = ResidencySchedule(pre, ((d2h,), (), (release,), ()) + last)
    inv = Invocation(0, 0)
    timeline = _timeline([(F, inv), (B, inv)])
    peaks = {plan_step(timeline, {0: RegionFloor(trace, 3, floor, frozenset({0}))}, 100)
             .peak_without_offload_bytes for floor in (fast, slow)}
    assert peaks == {max(resident_bytes_without_offload(trace))} == {9}


def test_eager_bytes_between_regions_are_counted_and_name_the_floor() -> None:
    inv = Invocation(0, 0)
    between = BetweenRegions((0, 50, 0), ("", "nll_loss_backward", ""), (0, 60, 0), (0, 7))
    timeline = _timeline([(F, inv), (B, inv)], between=between)
    plan = plan_step(timeline, {0: block()}, budget_bytes=10**6)
    assert plan.floor_op.region is None and plan.floor_op.op == "nll_loss_backward"
    assert plan.floor_peak_bytes >= 50 and plan.regions_floor_bytes < plan.floor_peak_bytes
    # 7 bytes held through the backward event: at every backward op
    alone = plan_step(_timeline([(F, inv), (B, inv)]), {0: block()}, budget_bytes=10**6)
    step = plan.layout
    assert check_schedule(step.trace, step.floor).resident_bytes[-1] == (
        check_schedule(alone.layout.trace, alone.layout.floor).resident_bytes[-1] + 7)


def test_recompute_is_asked_for_only_where_the_plan_cannot_fit_or_stalls() -> None:
    a, b = Invocation(0, 0), Invocation(1, 0)
    timeline = _timeline([(F, a), (F, b), (B, b), (B, a)])
    slotless = region_of([{0: "W"}, {0: "R"}, {0: "R"}, {0: "R"}], {0: 1}, 2, set())
    regions = {0: block(), 1: slotless}
    movable = {0: True, 1: False}
    small = {0: [1] * 6, 1: [1] * 4}  # every op's own inputs and outputs: 1 byte
    fits = plan_step(timeline, regions, budget_bytes=10**6)
    assert fits.over_budget == frozenset()
    assert regions_to_relower(fits, movable, frozenset(), small) == ()
    stalls = replace(fits, summary=replace(fits.summary, predicted_stall_s=1e-3))
    assert regions_to_relower(stalls, movable, frozenset(), small) == (0,)
    tight = plan_step(timeline, regions, budget_bytes=3)
    tight = replace(tight, summary=replace(tight.summary, predicted_stall_s=0.0))
    assert not tight.fits and any(r == 0 for r, _ in tight.over_budget)
    assert regions_to_relower(tight, movable, frozenset(), small) == (0,)
    assert regions_to_relower(tight, movable, frozenset({0}), small) == ()
    # Over the budget only where an op's own inputs and outputs are: no partition helps.
    heavy = {0: [9] * 6, 1: [9] * 4}
    assert regions_to_relower(tight, movable, frozenset(), heavy) == ()


@st.composite
def regions(draw: st.DrawFn, index: int) -> RegionFloor:
    """A region as a compile door traces one: each storage accessed at every op of its
    span in a graph (a forward span, and a backward one for a saved activation that may
    move; one that may not is accessed from its write to its last backward read, the
    invariant :mod:`~hyper_offload.passes.plan.report` relies on)."""
    fw, bw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    accesses: list[dict[int, str]] = [{} for _ in range(fw + bw)]
    sizes, movable = {}, set()
    for storage in range(draw(st.integers(1, 5))):
        sizes[storage] = draw(st.integers(1, 9))
        start = draw(st.integers(0, fw - 1))
        end = draw(st.integers(start, fw - 1))
        for op in range(start, end + 1):
            accesses[op][storage] = "W" if op == start else "R"
        if draw(st.booleans()):  # saved for the backward
            lo = draw(st.integers(fw, fw + bw - 1))
            hi = draw(st.integers(lo, fw + bw - 1))
            if draw(st.booleans()):
                movable.add(storage)
            else:  # a kept one is accessed at every op of its span, as graph_trace fills it
                lo = start
            for op in range(lo, hi + 1):
                accesses[op][storage] = accesses[op].get(storage, "R")
    durations = draw(st.lists(st.floats(0, 1e-6), min_size=fw + bw, max_size=fw + bw))
    return region_of(accesses, sizes, fw, movable, durations=durations,
                     lowerable=draw(st.booleans()))


@st.composite
def steps(draw: st.DrawFn) -> tuple[StepTimeline, dict[int, RegionFloor], int, int | None]:
    """Regions, invocations in an order where each backward follows its forward, a budget
    between 0 and the peak, and maybe a host budget."""
    found = {r: draw(regions(r)) for r in range(draw(st.integers(1, 3)))}
    invocations = [Invocation(r, i) for r in found for i in range(draw(st.integers(1, 3)))]
    order: list[tuple[StepEventKind, Invocation]] = []
    waiting, started = list(draw(st.permutations(invocations))), []
    while waiting or started:
        if waiting and (not started or draw(st.booleans())):
            order.append((F, waiting[-1]))
            started.append(waiting.pop())
        else:
            order.append((B, started.pop(draw(st.integers(0, len(started) - 1)))))
    timeline = _timeline(order)
    peak = plan_step(timeline, found, 10**9).peak_without_offload_bytes
    host = draw(st.one_of(st.none(), st.integers(0, 8 * 1024)))
    return timeline, found, draw(st.integers(0, peak + 2)), host


@settings(max_examples=120, deadline=None)
@given(steps())
def test_every_plan_is_valid_and_meets_the_budget_wherever_the_floor_does(case) -> None:
    timeline, found, budget, host = case
    plan = plan_step(timeline, found, budget, host_budget_bytes=host)
    step = plan.layout
    floor = check_schedule(step.trace, step.floor)
    assert plan.floor_peak_bytes == floor.peak_resident_bytes
    cap = max(budget, plan.floor_peak_bytes)
    # The one validator accepts the schedule on the step trace (above the cap only where
    # the host budget kept slots on the device).
    reached = max(cap, plan.peak_bytes)
    assert check_schedule(step.trace.with_budget(reached), plan.schedule).ok
    assert plan.peak_bytes == runtime_peak(plan, found)
    if plan.kept_for_host == 0:
        assert plan.peak_bytes <= cap
        if plan.floor_peak_bytes <= budget:
            assert plan.fits
    else:
        assert plan.binding in ("host", "both") or plan.peak_bytes <= cap
    if host is not None:
        assert host_curve(step.trace, plan.schedule).peak <= host
    assert plan.peak_without_offload_bytes == max(resident_bytes_without_offload(step.trace),
                                                  default=0)
    for p in plan.invocations:  # kept and moved are a partition of the region's slots
        slots = {s.storage: s.nbytes for s in found[p.invocation.region].slots}
        assert p.keep <= set(slots) or p.invocation.region in plan.schedules
