"""Properties of the greedy planner on random traces and budgets (hypothesis).

* every schedule passes ``check_schedule`` (both refine settings);
* the budget is met at every feasible op, and infeasible ops get down to their operands;
* no offloaded gap lies where the no-offload curve was within budget;
* ``refine=False`` equals the straightforward O(M·S) oracle, schedule for schedule;
* refinement never moves more bytes than the design's greedy.
"""

from __future__ import annotations

from hypothesis import given, settings

import reference_planner
from planner_strategies import traces
from hyper_offload.passes import (
    ActivationTrace,
    access_gaps,
    check_schedule,
    infeasible_ops,
    required_bytes,
    resident_bytes_without_offload,
)
from hyper_offload.passes.greedy_planner import GreedyResidencyPlanner
from hyper_offload.passes.planner_candidates import (
    budget_excess,
    offload_candidates,
    op_byte_profile,
)


@settings(max_examples=200, deadline=None)
@given(traces())
def test_greedy_schedules_are_valid_and_meet_the_budget(trace: ActivationTrace) -> None:
    no_offload = resident_bytes_without_offload(trace)
    need = required_bytes(trace)
    budget = trace.budget_bytes
    moved = {}
    for refine in (False, True):
        report = GreedyResidencyPlanner(refine=refine).plan_with_report(trace)
        checked = check_schedule(trace, report.schedule)
        assert checked.violations == (), (refine, checked.violations)
        for op, resident in enumerate(checked.resident_bytes):
            assert resident <= max(budget, need[op]), (refine, op)
        # Never offload a gap where nothing was over budget to begin with.
        for cand in report.chosen:
            assert any(no_offload[op] > budget for op in range(cand.start + 1, cand.end))
        assert list(report.infeasible_ops) == infeasible_ops(trace)
        moved[refine] = checked.bytes_moved
    assert moved[True] <= moved[False]


@settings(max_examples=200, deadline=None)
@given(traces())
def test_design_greedy_equals_the_reference_oracle(trace: ActivationTrace) -> None:
    report = GreedyResidencyPlanner(refine=False).plan_with_report(trace)
    assert report.schedule == reference_planner.plan(trace)
    assert [tuple(c) for c in report.chosen] == reference_planner.reference_choice(trace)


@settings(max_examples=100, deadline=None)
@given(traces())
def test_planner_analyses_agree_with_liveness(trace: ActivationTrace) -> None:
    resident, required = op_byte_profile(trace)
    assert resident == resident_bytes_without_offload(trace)
    assert required == required_bytes(trace)
    excess, infeasible = budget_excess(trace)
    assert infeasible == infeasible_ops(trace)
    assert [e > 0 for e in excess] == [
        r > max(trace.budget_bytes, n) for r, n in zip(resident, required)
    ]
    expected_gaps = [g for g in access_gaps(trace) if trace.storage_sizes[g.storage] > 0]
    assert [c.gap for c in offload_candidates(trace)] == expected_gaps


@settings(max_examples=40, deadline=None)
@given(traces(max_ops=60, max_storages=30))
def test_larger_traces_stay_valid_and_match_the_oracle(trace: ActivationTrace) -> None:
    design = GreedyResidencyPlanner(refine=False).plan(trace)
    assert design == reference_planner.plan(trace)
    refined = GreedyResidencyPlanner().plan(trace)
    checked = check_schedule(trace, refined)
    assert checked.violations == ()
    assert checked.bytes_moved <= check_schedule(trace, design).bytes_moved
