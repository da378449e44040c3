"""plan_step on hand-built floor profiles and step timelines (pure: no torch, no compile).

The bound is checked against an independent, naive recomputation of the step's bytes at
every position, never against the plan's own figures."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_offload.compiler.step_model import Invocation, StepEvent, StepEventKind, StepTimeline
from hyper_offload.compiler.step_plan import (
    RegionProfile,
    SlotRange,
    plan_step,
    region_profile,
)
from hyper_offload.passes import (
    ActionKind, ActivationTrace, ResidencyAction, ResidencySchedule, check_schedule,
    resident_bytes_without_offload,
)

F, B = StepEventKind.FORWARD, StepEventKind.BACKWARD


def _timeline(order: list[tuple[StepEventKind, Invocation]], retained: dict | None = None):
    events = tuple(StepEvent(kind, inv) for kind, inv in order)
    return StepTimeline(events, retained or {})


def naive_bytes(timeline: StepTimeline, profiles: dict[int, RegionProfile], keep) -> list[int]:
    """Device bytes at every position of the step, position by position (no tree)."""
    positions: list[tuple[Invocation, int]] = []  # (invocation, region op) per position
    for kind, inv in timeline.events:
        p = profiles[inv.region]
        ops = range(p.num_fw_ops) if kind is F else range(p.num_fw_ops, len(p.resident))
        positions += [(inv, op) for op in ops]
    fw_at = {inv: next(i for i, (v, op) in enumerate(positions) if v == inv) for inv in
             timeline.invocations}
    bw_at = {inv: next(i for i, (v, op) in enumerate(positions)
                       if v == inv and op >= profiles[inv.region].num_fw_ops)
             for inv in timeline.invocations if profiles[inv.region].num_bw_ops}
    values = []
    for t, (inv, op) in enumerate(positions):
        total = profiles[inv.region].resident[op]
        for other, bw in bw_at.items():
            fw_end = fw_at[other] + profiles[other.region].num_fw_ops
            if fw_end <= t < bw:
                total += timeline.retained_bytes.get(other, 0)
            for slot in profiles[other.region].slots:
                lo = fw_at[other] + slot.start
                hi = bw + slot.end - profiles[other.region].num_fw_ops
                if slot.slot in keep(other) and lo <= t < hi:
                    total += slot.nbytes
        values.append(total)
    return values


def block_profile(region: int = 0) -> RegionProfile:
    """A block: 3 forward ops, 3 backward ops, two slots (sizes 4 and 2)."""
    return RegionProfile(
        region, 3, (5, 6, 5, 6, 5, 3),
        (SlotRange(1, 4, 1, 4), SlotRange(2, 2, 2, 3)),
    )


def test_four_invocations_of_one_block_keep_the_latest_first() -> None:
    invs = [Invocation(0, i) for i in range(4)]
    order = [(F, i) for i in invs] + [(B, i) for i in reversed(invs)]
    timeline = _timeline(order)
    profiles = {0: block_profile()}
    plan = plan_step(timeline, profiles, budget_bytes=14)
    values = naive_bytes(timeline, profiles, plan.keep_for)
    assert max(values) == plan.peak_bytes <= 14
    # The last block's forward is followed at once by its backward: its slots have the
    # shortest ranges and are kept first; the first block's are the longest and move.
    assert plan.keep_for(invs[3]) == {1, 2}
    assert plan.keep_for(invs[0]) == frozenset()
    assert plan.moved_bytes + plan.kept_bytes == 4 * 6
    assert plan.floor_peak_bytes == max(naive_bytes(timeline, profiles, lambda i: set()))
    everything = naive_bytes(timeline, profiles, lambda i: {1, 2})
    assert plan.peak_without_offload_bytes == max(everything)


def test_where_the_floor_is_over_the_budget_keeping_never_makes_it_worse() -> None:
    invs = [Invocation(0, i) for i in range(2)]
    timeline = _timeline([(F, invs[0]), (F, invs[1]), (B, invs[1]), (B, invs[0])])
    profiles = {0: block_profile()}
    plan = plan_step(timeline, profiles, budget_bytes=3)
    assert not plan.fits and plan.peak_bytes == plan.floor_peak_bytes
    # Below the floor (issue 43): what stays under the floor's peak is kept, not moved.
    tall = {0: RegionProfile(0, 3, (1, 9, 1, 1, 1, 1), (SlotRange(1, 2, 2, 4),))}
    plan = plan_step(timeline, tall, budget_bytes=5)
    values = naive_bytes(timeline, tall, plan.keep_for)
    assert plan.kept_bytes > 0 and plan.floor_peak_bytes == 9 == plan.peak_bytes
    assert all(v <= 9 for v in values)


def test_a_fraction_is_of_the_step_peak_without_offload() -> None:
    invs = [Invocation(0, i) for i in range(3)]
    timeline = _timeline([(F, i) for i in invs] + [(B, i) for i in reversed(invs)])
    plan = plan_step(timeline, {0: block_profile()}, None, budget_fraction=0.75)
    assert plan.budget_bytes == int(0.75 * plan.peak_without_offload_bytes)
    assert plan.peak_bytes <= plan.budget_bytes


def test_retained_bytes_count_between_forward_and_backward_only() -> None:
    a, b = Invocation(0, 0), Invocation(1, 0)
    timeline = _timeline([(F, a), (F, b), (B, b), (B, a)], retained={a: 100})
    profiles = {0: block_profile(0), 1: block_profile(1)}
    plan = plan_step(timeline, profiles, budget_bytes=10**6)
    # b's whole forward and backward run while a retains its 100 bytes.
    assert plan.floor_peak_bytes == 100 + 6
    assert plan.invocations[0].retained_bytes == 100


def test_unknown_invocations_get_the_floor() -> None:
    inv = Invocation(0, 0)
    plan = plan_step(_timeline([(F, inv), (B, inv)]), {0: block_profile()}, budget_bytes=10**6)
    assert plan.keep_for(inv) == {1, 2}
    assert plan.keep_for(Invocation(0, 1)) == frozenset()
    assert plan.keep_for(Invocation(7, 0)) == frozenset()


def test_region_profile_reads_the_floor_schedule() -> None:
    # 2 forward ops, 2 backward ops; storage 0 copied after op 0, reloaded before op 3.
    post = [(ResidencyAction(ActionKind.COPY_D2H, 0), ResidencyAction(ActionKind.RELEASE_DEVICE, 0)),
            (), (), (ResidencyAction(ActionKind.RELEASE_DEVICE, 0),
                     ResidencyAction(ActionKind.RELEASE_HOST, 0))]
    pre = [(), (), (), (ResidencyAction(ActionKind.COPY_H2D, 0),
                        ResidencyAction(ActionKind.WAIT_H2D, 0))]
    schedule = ResidencySchedule(tuple(pre), tuple(post))
    # storage 1 (4 B): a model output the backward never reads, "retained" to the end
    trace = ActivationTrace.from_accesses(
        [{0: "W", 1: "W"}, {0: "R"}, {}, {0: "R"}], {0: 8, 1: 4}, budget_bytes=0,
        retained={1},
    )
    profile = region_profile(3, 2, (12, 4, 4, 12), schedule, trace)
    assert profile.slots == (SlotRange(0, 8, 1, 3),)
    assert profile.region == 3 and profile.num_bw_ops == 2
    # the caller holds the output once the forward returned: not the backward's bytes
    assert profile.resident == (12, 4, 0, 8)


@st.composite
def steps(draw: st.DrawFn) -> tuple[StepTimeline, dict[int, RegionProfile], int]:
    """Random regions (floor profiles with slots), invocations and an order in which each
    invocation's backward follows its forward; a budget between 0 and the peak."""
    profiles = {}
    for region in range(draw(st.integers(1, 3))):
        fw = draw(st.integers(1, 4))
        bw = draw(st.integers(1, 4))
        resident = tuple(draw(st.lists(st.integers(0, 9), min_size=fw + bw, max_size=fw + bw)))
        slots = []
        for slot in range(draw(st.integers(0, 3))):
            start = draw(st.integers(1, fw))  # == fw: copied after the forward's last op
            end = draw(st.integers(fw, fw + bw - 1))  # == fw: reloaded before the first
            slots.append(SlotRange(slot, draw(st.integers(1, 8)), start, end))
        profiles[region] = RegionProfile(region, fw, resident, tuple(slots))
    invocations = []
    for region in profiles:
        invocations += [Invocation(region, i) for i in range(draw(st.integers(1, 3)))]
    # Interleave: each backward somewhere after its forward.
    order: list[tuple[StepEventKind, Invocation]] = []
    waiting = list(draw(st.permutations(invocations)))
    started: list[Invocation] = []
    while waiting or started:
        if waiting and (not started or draw(st.booleans())):
            inv = waiting.pop()
            order.append((F, inv))
            started.append(inv)
        else:
            inv = started.pop(draw(st.integers(0, len(started) - 1)))
            order.append((B, inv))
    retained = {inv: draw(st.integers(0, 5)) for inv in invocations}
    timeline = _timeline(order, retained)
    peak = max(naive_bytes(timeline, profiles, lambda i: {s.slot for s in profiles[i.region].slots}))
    return timeline, profiles, draw(st.integers(0, peak + 2))


@settings(max_examples=150, deadline=None)
@given(steps())
def test_the_plan_meets_the_budget_wherever_the_floor_does(case) -> None:
    timeline, profiles, budget = case
    plan = plan_step(timeline, profiles, budget_bytes=budget)
    values = naive_bytes(timeline, profiles, plan.keep_for)
    floor = max(naive_bytes(timeline, profiles, lambda i: set()))
    assert plan.floor_peak_bytes == floor
    assert plan.peak_bytes == max(values)
    caps = [max(budget, floor)] * len(values)  # below the floor: the floor's peak
    assert all(v <= cap for v, cap in zip(values, caps))
    if floor <= budget:
        assert plan.peak_bytes <= budget and plan.fits
    # Maximal: no slot left behind could be kept without breaking a cap.
    for p in plan.invocations:
        for slot in profiles[p.invocation.region].slots:
            if slot.slot in p.keep:
                continue
            more = naive_bytes(
                timeline, profiles,
                lambda i, p=p, s=slot: plan.keep_for(i) | ({s.slot} if i == p.invocation else set()),
            )
            assert any(v > cap for v, cap in zip(more, caps))


@settings(max_examples=100, deadline=None)
@given(steps())
def test_shared_decisions_keep_the_same_slots_in_every_invocation_of_a_region(case) -> None:
    timeline, profiles, budget = case
    plan = plan_step(timeline, profiles, budget_bytes=budget, shared=True)
    values = naive_bytes(timeline, profiles, plan.keep_for)
    floor = max(naive_bytes(timeline, profiles, lambda i: set()))
    assert all(v <= max(budget, floor) for v in values)
    assert plan.peak_bytes == max(values)
    for region in profiles:
        kept = {plan.keep_for(i) for i in timeline.invocations if i.region == region}
        assert len(kept) <= 1


def test_shared_decisions_move_more_when_invocations_differ() -> None:
    # The last block's slots are cheap to keep, the first block's are not: per
    # invocation keeps the last block's; shared must treat them alike.
    invs = [Invocation(0, i) for i in range(4)]
    timeline = _timeline([(F, i) for i in invs] + [(B, i) for i in reversed(invs)])
    profiles = {0: block_profile()}
    apart = plan_step(timeline, profiles, budget_bytes=12)
    shared = plan_step(timeline, profiles, budget_bytes=12, shared=True)
    assert (apart.moved_bytes, shared.moved_bytes) == (18, 24)
    assert shared.peak_bytes <= 12 and apart.peak_bytes <= 12


def test_recompute_is_asked_for_only_where_the_plan_cannot_fit_or_stalls() -> None:
    from hyper_offload.compiler.step_recompute import regions_to_relower

    a, b = Invocation(0, 0), Invocation(1, 0)
    timeline = _timeline([(F, a), (F, b), (B, b), (B, a)])
    slotless = RegionProfile(1, 3, (1, 1, 1, 1, 1, 1), ())
    profiles = {0: block_profile(0), 1: slotless}
    small = {0: [1] * 6, 1: [1] * 6}  # every op's own inputs and outputs: 1 byte
    fits = plan_step(timeline, profiles, budget_bytes=10**6)
    assert fits.over_budget == frozenset()
    assert regions_to_relower(fits, 0.0, profiles, frozenset(), small) == ()
    # A stall, or a floor over the budget: every region that saves a movable activation,
    # once (a region already searched is not searched again).
    assert regions_to_relower(fits, 1e-3, profiles, frozenset(), small) == (0,)
    tight = plan_step(timeline, profiles, budget_bytes=3)
    assert not tight.fits and (0, 1) in tight.over_budget and (1, 0) not in tight.over_budget
    assert regions_to_relower(tight, 0.0, profiles, frozenset(), small) == (0,)
    assert regions_to_relower(tight, 0.0, profiles, frozenset({0}), small) == ()
    # Over the budget only where an op's own inputs and outputs are: no partition helps.
    heavy = {0: [6] * 6, 1: [6] * 6}
    assert regions_to_relower(tight, 0.0, profiles, frozenset(), heavy) == ()
    assert regions_to_relower(tight, 1e-3, profiles, frozenset(), heavy) == (0,)


def test_a_blocks_input_is_held_by_its_caller_through_the_whole_forward() -> None:
    # 3 forward ops, 1 backward op. Storage 0 (8 B) is the block's input: first read at
    # op 1, copied and released after op 1 by the floor, reloaded for the backward.
    # Storage 1 (2 B), another input, is read at op 0 only and never saved.
    d2h, h2d = ResidencyAction(ActionKind.COPY_D2H, 0), ResidencyAction(ActionKind.COPY_H2D, 0)
    release = ResidencyAction(ActionKind.RELEASE_DEVICE, 0)
    post = [(), (d2h, release), (), (release,)]
    pre = [(), (), (), (h2d, ResidencyAction(ActionKind.WAIT_H2D, 0))]
    trace = ActivationTrace.from_accesses(
        [{1: "R"}, {0: "R"}, {}, {0: "R"}], {0: 8, 1: 2}, budget_bytes=0,
    )
    floor = (2, 8, 0, 8)  # what check_schedule counts: each storage only while accessed
    alone = region_profile(0, 3, floor, ResidencySchedule(tuple(pre), tuple(post)), trace)
    held = region_profile(
        0, 3, floor, ResidencySchedule(tuple(pre), tuple(post)), trace, frozenset({0, 1}),
    )
    assert alone.resident == floor
    # The caller returns neither before the forward's end: both count at every forward op.
    assert held.resident == (2 + 8, 8 + 2, 0 + 8 + 2, 8)
    assert held.slots == alone.slots == (SlotRange(0, 8, 2, 3),)


def test_a_moved_model_output_is_held_to_the_forwards_end() -> None:
    # Storage 0 (4 B): the model output, made at op 0, copied and released right after it
    # by the floor (the next block saves it as its input), never read by the backward.
    post = [(ResidencyAction(ActionKind.COPY_D2H, 0),
             ResidencyAction(ActionKind.RELEASE_DEVICE, 0)), (), (), ()]
    trace = ActivationTrace.from_accesses(
        [{0: "W"}, {}, {}, {}], {0: 4}, budget_bytes=0, retained={0},
    )
    schedule = ResidencySchedule(((),) * 4, tuple(post))
    profile = region_profile(0, 3, (4, 0, 0, 0), schedule, trace)
    # Returned to the caller, it lives on the device until the forward ends (then the
    # next region counts it as its held input), whatever the floor's release says.
    assert profile.resident == (4, 4, 4, 0)


def test_the_peak_without_offload_does_not_depend_on_where_the_floor_releases() -> None:
    # Issue 44: the floor's release waits for its D2H, so a slower link releases later;
    # the peak without offload (1 layer 8B at 8K: 14.32 GB at 25 GB/s, 13.95 at 50)
    # followed it. Storage 0 (8 B): made at op 0, read by the backward at op 4; storage 1
    # (1 B) read at every op. Two floors: released right after its copy, or two ops later.
    trace = ActivationTrace.from_accesses(
        [{0: "W", 1: "W"}, {1: "R"}, {1: "R"}, {1: "R"}, {0: "R", 1: "R"}], {0: 8, 1: 1},
        budget_bytes=0,
    )
    d2h, release = ResidencyAction(ActionKind.COPY_D2H, 0), ResidencyAction(ActionKind.RELEASE_DEVICE, 0)
    pre = ((),) * 4 + ((ResidencyAction(ActionKind.COPY_H2D, 0),
                        ResidencyAction(ActionKind.WAIT_H2D, 0)),)
    last = ((release, ResidencyAction(ActionKind.RELEASE_HOST, 0)),)
    fast = ResidencySchedule(pre, ((d2h, release), (), (), ()) + last)
    slow = ResidencySchedule(pre, ((d2h,), (), (release,), ()) + last)
    inv = Invocation(0, 0)
    timeline = _timeline([(F, inv), (B, inv)])
    peaks = set()
    for floor in (fast, slow):
        resident = check_schedule(trace, floor).resident_bytes
        profile = region_profile(0, 3, resident, floor, trace)
        peaks.add(plan_step(timeline, {0: profile}, budget_bytes=100).peak_without_offload_bytes)
    assert peaks == {max(resident_bytes_without_offload(trace))} == {9}


def naive_host_bytes(timeline: StepTimeline, profiles: dict[int, RegionProfile], keep) -> list[int]:
    """Host bytes (pool buckets) the moved slots hold at every position, from the
    position before their device range to the one after it (copy through reload)."""
    from hyper_offload.passes.ir.host import host_bucket_bytes

    positions: list[tuple[Invocation, int]] = []
    for kind, inv in timeline.events:
        p = profiles[inv.region]
        ops = range(p.num_fw_ops) if kind is F else range(p.num_fw_ops, len(p.resident))
        positions += [(inv, op) for op in ops]
    values = [0] * len(positions)
    for inv in timeline.invocations:
        profile = profiles[inv.region]
        fw = next(i for i, (v, _) in enumerate(positions) if v == inv)
        bw = next(i for i, (v, op) in enumerate(positions)
                  if v == inv and op >= profile.num_fw_ops)
        for slot in profile.slots:
            if slot.slot in keep(inv):
                continue
            lo, hi = fw + slot.start, bw + slot.end - profile.num_fw_ops
            for t in range(max(lo - 1, 0), min(hi + 1, len(positions))):
                values[t] += host_bucket_bytes(slot.nbytes)
    return values


KIB = 1024


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.integers(0, 40), st.integers(0, 12), st.booleans())
def test_a_host_budget_is_never_exceeded_and_the_plan_says_when_it_binds(
    blocks: int, budget_kib: int, host_kib: int, keep: bool
) -> None:
    invs = [Invocation(0, i) for i in range(blocks)]
    timeline = _timeline([(F, i) for i in invs] + [(B, i) for i in reversed(invs)])
    # Sizes of a few KiB, rounded up differently by the pool's buckets (3 -> 4, 2 -> 2).
    profile = RegionProfile(0, 3, (5 * KIB, 6 * KIB, 5 * KIB, 6 * KIB, 5 * KIB, 3 * KIB),
                            (SlotRange(1, 3 * KIB, 1, 4), SlotRange(2, 2 * KIB, 2, 3)))
    profiles = {0: profile}
    plan = plan_step(timeline, profiles, budget_kib * KIB, keep=keep,
                     host_budget_bytes=host_kib * KIB)
    host = naive_host_bytes(timeline, profiles, plan.keep_for)
    assert max(host) <= host_kib * KIB and plan.peak_host_bytes == max(host)
    device = naive_bytes(timeline, profiles, plan.keep_for)
    assert max(device) == plan.peak_bytes
    unlimited = plan_step(timeline, profiles, budget_kib * KIB, keep=keep)
    if plan.kept_for_host == 0:  # the host had room: the device's plan, unchanged
        assert plan.keep_for(invs[0]) == unlimited.keep_for(invs[0])
        assert plan.peak_bytes == unlimited.peak_bytes and plan.binding != "host"
    cap = max(plan.budget_bytes, plan.floor_peak_bytes)
    assert (plan.binding in ("host", "both")) == (plan.peak_bytes > cap)
    if plan.peak_bytes > cap:
        assert plan.kept_for_host > 0 and not plan.fits
