"""Prefetch placement: reloads start as early as the budget allows, in wait order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_offload.passes import (
    ActionKind,
    ActivationTrace,
    ResidencySchedule,
    TraceOp,
    check_schedule,
    predict_timeline,
    required_bytes,
)
from hyper_offload.passes.plan.greedy import GreedyResidencyPlanner
from hyper_offload.passes.plan.placement import (
    PrefetchError,
    earliest_slots,
    hoist_prefetches,
    prefetch_slots,
    with_reload_starts,
)

from ..planner_strategies import traces


def with_durations(trace: ActivationTrace, durations: list[float | None]) -> ActivationTrace:
    ops = tuple(
        TraceOp(op.name, op.accesses, op.outputs, duration) for op, duration in zip(trace.ops, durations)
    )
    return ActivationTrace(
        ops=ops,
        storage_sizes=trace.storage_sizes,
        budget_bytes=trace.budget_bytes,
        retained=trace.retained,
        h2d_bandwidth_gbps=1.0,  # 1 byte per ns: a 1000-byte copy takes 1 µs
    )


def long_gap_trace(budget: int, durations: list[float | None]) -> ActivationTrace:
    """Storage 0 (1000 B) idle over ops 1..8 while a 100-byte storage 1 lives there."""
    ops = [{0: "W"}] + [{1: "W" if i == 1 else "R"} for i in range(1, 9)] + [{0: "R"}]
    base = ActivationTrace.from_accesses(ops, {0: 1000, 1: 100}, budget_bytes=budget)
    return with_durations(base, durations)


def slot(actions) -> list[str]:
    return [repr(a) for a in actions]


@pytest.mark.parametrize(
    ("durations", "start"),
    [([4e-7] * 10, 6), ([None] * 10, 8), ([1.0] * 10, 8)],
    ids=["0.4us-ops", "no-durations", "1s-ops"],
)
def test_copy_starts_as_late_as_still_hides_it_and_never_before_the_budget_allows(
    durations: list[float | None], start: int
) -> None:
    # Storage 1 (100 B) lives over ops 1..8 beside the reloaded 1000 B: a 1100 B budget
    # lets the reload start right after the release (op 1). The 1 µs copy then moves as
    # late as it still ends before op 9: three 0.4 µs ops ahead; one op ahead when ops
    # take the 1 µs default or a whole second.
    trace = long_gap_trace(budget=1100, durations=durations)
    schedule = GreedyResidencyPlanner().plan(trace.with_budget(1000))
    assert earliest_slots(trace, schedule) == {(0, 9): 1}
    hoisted = hoist_prefetches(trace, schedule)
    assert slot(schedule.pre[9]) == ["COPY_H2D 0", "WAIT_H2D 0"]
    assert slot(hoisted.pre[start]) == ["COPY_H2D 0"]
    assert slot(hoisted.pre[9]) == ["WAIT_H2D 0"]
    report = check_schedule(trace, hoisted)
    assert report.violations == ()
    assert report.resident_bytes[start - 1:10] == (100,) + (1100,) * (9 - start) + (1000,)
    assert predict_timeline(trace, hoisted).exposed_transfer_s == 0.0


def test_budget_stops_the_hoist() -> None:
    # Op 8 holds storage 1 (100 B): 100 + 1000 > 1000, so the copy cannot move at all.
    trace = long_gap_trace(budget=1000, durations=[4e-7] * 10)
    schedule = GreedyResidencyPlanner().plan(trace)
    assert hoist_prefetches(trace, schedule) == schedule


def test_a_tight_op_bounds_the_lead() -> None:
    # Storage 2 (50 B) is live at ops 3..4 only: with a 1100 B budget the reload of
    # storage 0 cannot be resident there beside storages 1 and 2; op 5 has room, but
    # storage 2 may still be alive when a copy issued before op 5 allocates: op 6.
    ops = [{0: "W"}] + [{1: "W" if i == 1 else "R"} for i in range(1, 9)] + [{0: "R"}]
    for op in (3, 4):
        ops[op] = {**ops[op], 2: "W" if op == 3 else "R"}
    trace = ActivationTrace.from_accesses(ops, {0: 1000, 1: 100, 2: 50}, budget_bytes=1100)
    schedule = GreedyResidencyPlanner().plan(trace)
    assert earliest_slots(trace, schedule) == {(0, 9): 6}


def test_reloads_are_issued_in_the_order_they_are_waited_for() -> None:
    # Storage 0 (100 B) is waited for at op 7, storage 1 (20 B) at op 9. Storage 3 (ops
    # 3..4) leaves room for storage 1 from op 4 on, but for storage 0 only from op 6 on.
    # Issued at op 4, storage 1 would queue storage 0 behind its copy on the one copy
    # stream, so it starts no earlier than storage 0 does.
    ops = [{0: "W", 1: "W"}, {2: "W"}, {2: "R"}, {3: "W"}, {3: "R"}, {}, {}, {0: "R"}, {}, {1: "R"}]
    trace = ActivationTrace.from_accesses(ops, {0: 100, 1: 20, 2: 110, 3: 100}, budget_bytes=120)
    schedule = GreedyResidencyPlanner().plan(trace)
    assert earliest_slots(trace, schedule) == {(0, 7): 6, (1, 9): 6}
    # without op times each op takes the 1 µs default: storage 1's 20 ns copy needs one op
    assert prefetch_slots(trace, schedule) == {(0, 7): 6, (1, 9): 8}
    assert check_schedule(trace, hoist_prefetches(trace, schedule)).ok


def test_the_copy_never_moves_before_the_release() -> None:
    trace = long_gap_trace(budget=5000, durations=[1e-9] * 10)
    schedule = GreedyResidencyPlanner().plan(trace.with_budget(1000))
    assert prefetch_slots(trace, schedule) == {(0, 9): 1}


def test_invalid_input_is_rejected_with_the_rule() -> None:
    trace = long_gap_trace(budget=1000, durations=[None] * 10)
    with pytest.raises(PrefetchError, match=r"breaks 11 rule\(s\), first: op 1: \[OVER_BUDGET\]"):
        hoist_prefetches(trace, ResidencySchedule.empty(trace.num_ops))


@st.composite
def timed_traces(draw: st.DrawFn) -> ActivationTrace:
    trace = draw(traces())
    durations = draw(
        st.lists(st.one_of(st.none(), st.floats(0, 1e-7)), min_size=trace.num_ops, max_size=trace.num_ops)
    )
    return with_durations(trace, durations)


@settings(max_examples=150, deadline=None)
@given(timed_traces())
def test_hoisted_schedules_stay_valid_within_budget_and_never_stall_more(
    trace: ActivationTrace,
) -> None:
    schedule = GreedyResidencyPlanner().plan(trace)
    hoisted = hoist_prefetches(trace, schedule)
    before, after = check_schedule(trace, schedule), check_schedule(trace, hoisted)
    assert after.violations == ()
    assert (after.bytes_d2h, after.bytes_h2d) == (before.bytes_d2h, before.bytes_h2d)
    need = required_bytes(trace)
    assert all(r <= max(trace.budget_bytes, n) for r, n in zip(after.resident_bytes, need))
    assert hoisted.count(ActionKind.COPY_H2D) == schedule.count(ActionKind.COPY_H2D)
    assert hoisted.post == schedule.post
    starts = list(prefetch_slots(trace, schedule).values())
    assert starts == sorted(starts)  # issued in wait order
    stall = predict_timeline(trace, schedule).exposed_transfer_s
    assert predict_timeline(trace, hoisted).exposed_transfer_s <= stall + 1e-12


def test_no_reload_starts_before_earliest_op() -> None:
    # The compile path cannot start a backward reload inside the forward graph: with
    # earliest_op at 8 the copy that would start at 1 starts at 8 and is still valid.
    trace = long_gap_trace(budget=1100, durations=[4e-7] * 10)
    schedule = GreedyResidencyPlanner().plan(trace.with_budget(1000))
    free = prefetch_slots(trace.with_budget(1100), schedule)
    clamped = prefetch_slots(trace.with_budget(1100), schedule, earliest_op=8)
    assert min(free.values()) < 8 and set(clamped.values()) == {8}
    hoisted = hoist_prefetches(trace.with_budget(1100), schedule, earliest_op=8)
    assert check_schedule(trace.with_budget(1100), hoisted).ok
    assert slot(hoisted.pre[8]) == ["COPY_H2D 0"]


@settings(max_examples=150, deadline=None)
@given(timed_traces(), st.booleans())
def test_moving_reloads_later_never_adds_stall_to_the_earliest_placement(
    trace: ActivationTrace, waits: bool
) -> None:
    # The second step keeps the compute timeline of the first: every copy still ends
    # before its wait and before the next copy starts, on the door's own timeline.
    schedule = GreedyResidencyPlanner().plan(trace)
    earliest = earliest_slots(trace, schedule)
    at_earliest = with_reload_starts(schedule, earliest)
    final = hoist_prefetches(trace, schedule, release_waits_for_d2h=waits)
    stall = predict_timeline(trace, at_earliest, release_waits_for_d2h=waits).exposed_transfer_s
    assert predict_timeline(trace, final, release_waits_for_d2h=waits).exposed_transfer_s <= stall * (1 + 1e-9) + 1e-15
    for (storage, wait_op), start in prefetch_slots(trace, schedule, release_waits_for_d2h=waits).items():
        assert earliest[(storage, wait_op)] <= start <= wait_op
