"""Prefetch hoisting: reloads start early enough to hide the copy, within budget."""

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
    required_bytes,
)
from hyper_offload.passes.greedy_planner import GreedyResidencyPlanner
from hyper_offload.passes.refine_prefetch import PrefetchError, hoist_prefetches, prefetch_slots
from .planner_strategies import traces


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


def test_copy_moves_back_until_its_time_is_hidden() -> None:
    # Each op takes 0.4 µs, the copy 1 µs: three ops (7, 8 and 6) hide it.
    trace = long_gap_trace(budget=1100, durations=[4e-7] * 10)
    schedule = GreedyResidencyPlanner().plan(trace.with_budget(1000))
    hoisted = hoist_prefetches(trace.with_budget(1100), schedule)
    assert slot(schedule.pre[9]) == ["COPY_H2D 0", "WAIT_H2D 0"]
    assert slot(hoisted.pre[6]) == ["COPY_H2D 0"]
    assert slot(hoisted.pre[9]) == ["WAIT_H2D 0"]
    report = check_schedule(trace.with_budget(1100), hoisted)
    assert report.violations == ()
    assert report.resident_bytes[5:10] == (100, 1100, 1100, 1100, 1000)


def test_budget_stops_the_hoist() -> None:
    # Op 8 holds storage 1 (100 B): 100 + 1000 > 1000, so the copy cannot move at all.
    trace = long_gap_trace(budget=1000, durations=[4e-7] * 10)
    schedule = GreedyResidencyPlanner().plan(trace)
    assert hoist_prefetches(trace, schedule) == schedule


def test_without_durations_the_lead_is_one_op() -> None:
    trace = long_gap_trace(budget=1100, durations=[None] * 10)
    schedule = GreedyResidencyPlanner().plan(trace.with_budget(1000))
    assert prefetch_slots(trace, schedule) == {(0, 9): 8}
    assert prefetch_slots(trace, schedule, default_op_duration_s=5e-7) == {(0, 9): 7}
    assert prefetch_slots(trace, schedule, default_op_duration_s=1.0) == {(0, 9): 8}
    assert prefetch_slots(trace, schedule, default_op_duration_s=1e-9, max_lead_ops=3) == {(0, 9): 6}


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
@given(timed_traces(), st.sampled_from([None, 1e-9, 1e-8]))
def test_hoisted_schedules_stay_valid_and_within_budget(
    trace: ActivationTrace, default_s: float | None
) -> None:
    schedule = GreedyResidencyPlanner().plan(trace)
    hoisted = hoist_prefetches(trace, schedule, default_op_duration_s=default_s)
    before, after = check_schedule(trace, schedule), check_schedule(trace, hoisted)
    assert after.violations == ()
    assert (after.bytes_d2h, after.bytes_h2d) == (before.bytes_d2h, before.bytes_h2d)
    need = required_bytes(trace)
    assert all(r <= max(trace.budget_bytes, n) for r, n in zip(after.resident_bytes, need))
    assert hoisted.count(ActionKind.COPY_H2D) == schedule.count(ActionKind.COPY_H2D)
    assert hoisted.post == schedule.post


def test_no_reload_starts_before_earliest_op() -> None:
    # The compile path cannot start a backward reload inside the forward graph: with
    # earliest_op at 8 the copy that would start at 6 starts at 8 and is still valid.
    trace = long_gap_trace(budget=1100, durations=[4e-7] * 10)
    schedule = GreedyResidencyPlanner().plan(trace.with_budget(1000))
    free = prefetch_slots(trace.with_budget(1100), schedule)
    clamped = prefetch_slots(trace.with_budget(1100), schedule, earliest_op=8)
    assert min(free.values()) < 8 and set(clamped.values()) == {8}
    hoisted = hoist_prefetches(trace.with_budget(1100), schedule, earliest_op=8)
    assert check_schedule(trace.with_budget(1100), hoisted).ok
    assert slot(hoisted.pre[8]) == ["COPY_H2D 0"]
