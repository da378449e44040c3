"""The stall lower bound holds for every schedule, and is tight where the copy is the
whole story; the pipeline's stall is measured against it and against the best choice
of gaps found by brute force on small traces."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyper_offload.passes import (
    ActionKind,
    ActivationTrace,
    GreedyResidencyPlanner,
    ResidencySchedule,
    check_schedule,
    plan_residency,
    predict_timeline,
)
from hyper_offload.passes.analysis.liveness import offload_candidates, stall_lower_bound
from hyper_offload.passes.plan.report import lower_offload_choice

from ..planner_strategies import timed_pressured, with_times


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(timed_pressured(), st.booleans())
def test_no_schedule_stalls_less_than_the_bound(case: tuple, waits: bool) -> None:
    trace, earliest, latest = case
    bound = stall_lower_bound(
        trace, earliest_prefetch_op=earliest, latest_release_op=latest, release_waits_for_d2h=waits
    )
    schedules = [
        plan_residency(
            trace, GreedyResidencyPlanner(refine=refine), earliest_prefetch_op=earliest,
            release_waits_for_d2h=waits, latest_release_op=latest,
        ).schedule
        for refine in (True, False)
    ]
    # and the unplaced planner schedule: every reload at its read
    schedules.append(GreedyResidencyPlanner().plan(trace))
    for schedule in schedules:
        if latest is not None and not _releases_by(schedule, latest):
            continue  # a schedule this door could not run: the bound does not speak of it
        stall = predict_timeline(trace, schedule, release_waits_for_d2h=waits).exposed_transfer_s
        assert stall >= bound.stall_s * (1 - 1e-9) - 1e-15, (stall, bound)


def _releases_by(schedule, latest: int) -> bool:  # noqa: ANN001
    """Whether every offloaded storage's device bytes are gone by ``post[latest]``."""
    copied = set()
    for op, _where, action in schedule.actions():
        if action.kind is ActionKind.COPY_D2H:
            copied.add(action.storage)
        elif action.kind is ActionKind.RELEASE_DEVICE and action.storage in copied:
            copied.discard(action.storage)
            if op > latest:
                return False
    return True


def _one_offload(copy_bytes: int) -> ActivationTrace:
    """Storage 0 (``copy_bytes``) written by op 0, read by op 5; storage 1 (1 byte) the
    work of ops 1..4; a budget with room for storage 1 only: storage 0 must be off over
    ops 1..4. Ops take 1 s, links move 1 byte a second."""
    ops = [{0: "W"}] + [{1: "W" if i == 1 else "R"} for i in range(1, 5)] + [{0: "R"}]
    trace = ActivationTrace.from_accesses(ops, {0: copy_bytes, 1: 1}, budget_bytes=1)
    return with_times(trace, [1.0] * len(ops), 1e-9)


@pytest.mark.parametrize("copy_bytes", [1, 2, 3])
def test_the_bound_is_the_stall_when_one_copy_is_the_story(copy_bytes: int) -> None:
    # The D2H (copy_bytes seconds) can start when op 0 ends, at 1 s, and must end before
    # op 1 starts, at 1 s: the stall is copy_bytes; the reload then hides in ops 1..4.
    trace = _one_offload(copy_bytes)
    bound = stall_lower_bound(trace)
    planned = plan_residency(trace, GreedyResidencyPlanner(), release_waits_for_d2h=True)
    stall = predict_timeline(trace, planned.schedule, release_waits_for_d2h=True).exposed_transfer_s
    assert bound.d2h_side_s == pytest.approx(float(copy_bytes))
    assert stall == pytest.approx(bound.stall_s)


def test_the_h2d_side_counts_reloads_that_cannot_start_before_the_backward() -> None:
    # Storage 0 (3 bytes) must be off over ops 1..2, where storage 1 (3 bytes) fills the
    # 3-byte budget; its reload may only start at op 4 (the "backward"): it ends at 4 + 3
    # = 7 s and op 5 would start at 5 s: 2 s of stall, which the pipeline's schedule has.
    ops = [{0: "W"}, {1: "W"}, {1: "R"}, {}, {}, {0: "R"}]
    plain = ActivationTrace.from_accesses(ops, {0: 3, 1: 3}, budget_bytes=3)
    trace = with_times(plain, [1.0] * 6, 1e-9)
    bound = stall_lower_bound(trace, earliest_prefetch_op=4, release_waits_for_d2h=False)
    assert bound.d2h_side_s == 0.0 and bound.h2d_side_s == pytest.approx(2.0)
    planned = plan_residency(trace, GreedyResidencyPlanner(), earliest_prefetch_op=4)
    assert predict_timeline(trace, planned.schedule).exposed_transfer_s == pytest.approx(2.0)
    # From op 3 on the bound lets the reload start one op earlier (1 s); the placement
    # does not, since storage 1 may still be alive when a copy issued before op 3 allocates.
    assert stall_lower_bound(trace, release_waits_for_d2h=False).stall_s == pytest.approx(1.0)
    planned = plan_residency(trace, GreedyResidencyPlanner())
    assert predict_timeline(trace, planned.schedule).exposed_transfer_s == pytest.approx(2.0)


class _Chosen:
    """A planner that proposes one given schedule: the pipeline places it."""

    def __init__(self, schedule: ResidencySchedule) -> None:
        self.schedule = schedule

    def plan(self, trace: ActivationTrace) -> ResidencySchedule:
        return self.schedule


def _best_choice_stall(trace: ActivationTrace, waits: bool) -> float:
    """The least predicted stall over every feasible set of gaps, each placed by the
    pipeline itself (``plan_residency``: both of its placements, releases held for their
    D2H or not, the better one kept): what a perfect chooser would get from it."""
    candidates = offload_candidates(trace)
    best = float("inf")
    for count in range(len(candidates) + 1):
        for chosen in combinations(candidates, count):
            schedule = lower_offload_choice(trace, chosen)
            if not check_schedule(trace, schedule).ok:
                continue
            placed = plan_residency(trace, _Chosen(schedule), release_waits_for_d2h=waits)
            best = min(best, predict_timeline(
                trace, placed.schedule, release_waits_for_d2h=waits).exposed_transfer_s)
    return best


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(timed_pressured())
def test_bound_best_choice_and_pipeline_are_ordered(case: tuple) -> None:
    trace, _, _ = case
    if len(offload_candidates(trace)) > 10:
        return  # 2^10 subsets at most
    bound = stall_lower_bound(trace).stall_s
    best = _best_choice_stall(trace, waits=True)
    planned = plan_residency(trace, GreedyResidencyPlanner(), release_waits_for_d2h=True)
    ours = predict_timeline(trace, planned.schedule, release_waits_for_d2h=True).exposed_transfer_s
    assert bound * (1 - 1e-9) - 1e-15 <= best <= ours * (1 + 1e-9) + 1e-15
