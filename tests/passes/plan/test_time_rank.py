"""The time objective: a gap whose copy cannot fit its window ranks last, the pipeline
keeps the proposal that stalls least, and never stalls more than the bytes objective."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings

from hyper_offload.passes import (
    ActionKind,
    ActivationTrace,
    GreedyResidencyPlanner,
    ResidencySchedule,
    plan_residency,
)
from hyper_offload.passes.analysis.liveness import budget_excess, offload_candidates
from hyper_offload.passes.plan.greedy import copy_fits

from ..planner_strategies import timed_pressured


def late_big_or_early_small() -> ActivationTrace:
    """Storage 0 (4 B) is written by op 3, just before the peak at ops 4..9, and read
    last (op 17): the longest gap, the design's first pick. Storages 1 and 2 (2 B each)
    are written by op 0 and read at ops 13 and 15. Storage 3 (4 B) is the work of ops
    4..9. Ops take 1 s, links move 1 B/s: storage 0's D2H (4 s) has 0 s before op 4,
    storages 1 and 2 have 3 s of ops 1..3 for their 2-second copies; every reload has
    room from op 11 on (op 10 and the op before it)."""
    ops = ([{1: "W", 2: "W"}, {}, {}, {0: "W"}] + [{3: "W" if i == 4 else "R"} for i in range(4, 10)]
           + [{}, {}, {}, {1: "R"}, {}, {2: "R"}, {}, {0: "R"}])
    trace = ActivationTrace.from_accesses(ops, {0: 4, 1: 2, 2: 2, 3: 4}, budget_bytes=8)
    return dataclasses.replace(
        trace, ops=tuple(dataclasses.replace(op, duration_s=1.0) for op in trace.ops),
        d2h_bandwidth_gbps=1e-9, h2d_bandwidth_gbps=1e-9,
    )


def test_a_copy_that_cannot_finish_in_time_does_not_fit() -> None:
    trace = late_big_or_early_small()
    candidates = offload_candidates(trace)
    excess, _ = budget_excess(trace)
    fits = dict(zip((c.storage for c in candidates), copy_fits(trace, candidates, excess)))
    assert fits == {0: False, 1: True, 2: True}


def _offloaded(schedule: ResidencySchedule) -> set[int]:
    return {a.storage for _, _, a in schedule.actions() if a.kind is ActionKind.COPY_D2H}


def test_the_pipeline_keeps_the_proposal_that_stalls_least() -> None:
    trace = late_big_or_early_small()
    by_bytes = plan_residency(trace, GreedyResidencyPlanner(objective="bytes"), release_waits_for_d2h=True)
    by_time = plan_residency(trace, GreedyResidencyPlanner(), release_waits_for_d2h=True)
    assert (by_bytes.proposals, by_time.proposals) == (1, 2)
    assert _offloaded(by_bytes.schedule) == {0} and _offloaded(by_time.schedule) == {1, 2}
    assert by_bytes.predicted_stall_s == pytest.approx(4.0)  # op 4 waits for the whole copy
    assert by_time.predicted_stall_s == pytest.approx(1.0)  # 4 s of copies in 3 s of ops
    assert by_time.check.ok and by_time.check.peak_resident_bytes <= trace.budget_bytes
    assert by_time.check.bytes_moved == by_bytes.check.bytes_moved  # 8 B either way


def test_an_unknown_objective_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"objective='speed'.*'time', 'bytes'"):
        GreedyResidencyPlanner(objective="speed")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(timed_pressured())
def test_the_time_objective_never_stalls_more_than_the_bytes_objective(case: tuple) -> None:
    trace, earliest, latest = case
    kwargs = dict(earliest_prefetch_op=earliest, release_waits_for_d2h=True, latest_release_op=latest)
    by_time = plan_residency(trace, GreedyResidencyPlanner(), **kwargs)
    by_bytes = plan_residency(trace, GreedyResidencyPlanner(objective="bytes"), **kwargs)
    assert by_time.check.ok
    assert by_time.predicted_stall_s <= by_bytes.predicted_stall_s
    if by_time.predicted_stall_s == by_bytes.predicted_stall_s:
        assert by_time.check.bytes_moved <= by_bytes.check.bytes_moved
