"""Properties of the greedy planner on random traces and budgets (hypothesis).

* every schedule passes ``check_schedule`` (both refine settings);
* the budget is met at every feasible op, and infeasible ops get down to their operands;
* no offloaded gap lies where the no-offload curve was within budget;
* ``refine=False`` equals the straightforward O(M·S) oracle, schedule for schedule;
* refinement never moves more bytes than the design's greedy.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_offload.passes import (
    ActionKind,
    ActivationTrace,
    check_schedule,
    required_bytes,
    resident_bytes_without_offload,
)
from hyper_offload.passes.analysis.liveness import (
    access_gaps, budget_excess, infeasible_ops, offload_candidates, op_byte_profile,
)
from hyper_offload.passes.plan.report import lower_offload_choice
from hyper_offload.passes.plan.greedy import GreedyResidencyPlanner, select_greedy
from hyper_offload.passes.plan.refine import refine_choice
from hyper_offload.passes.plan.segment_tree import RangeAddMaxTree

from .. import reference_planner
from ..planner_strategies import pressured_traces, traces


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
        # Lowered slots only add (pre) or only free (post): no peak hides inside a slot.
        assert checked.peak_resident_bytes == max(checked.resident_bytes, default=0)
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
@given(pressured_traces(max_ops=60, max_storages=30))
def test_larger_traces_stay_valid_and_match_the_oracle(trace: ActivationTrace) -> None:
    # Budgets between the largest op's needs and the peak: about half of these examples
    # make the refinement change the design's choice (plain ``traces()``: 1 in 60).
    design = GreedyResidencyPlanner(refine=False).plan(trace)
    assert design == reference_planner.plan(trace)
    refined = GreedyResidencyPlanner().plan_with_report(trace)
    checked = check_schedule(trace, refined.schedule)
    assert checked.violations == ()
    assert checked.bytes_moved <= check_schedule(trace, design).bytes_moved
    no_offload = resident_bytes_without_offload(trace)
    for cand in refined.chosen:
        assert any(no_offload[op] > trace.budget_bytes for op in range(cand.start + 1, cand.end))


@settings(max_examples=60, deadline=None)
@given(pressured_traces(max_ops=40, max_storages=20))
def test_refinement_cut_short_by_its_work_budget_stays_valid_and_no_worse(
    trace: ActivationTrace,
) -> None:
    # On huge traces the swap/insert budget runs out mid-search: whatever was done by
    # then must still be a valid schedule that moves no more than the design's greedy.
    candidates = offload_candidates(trace)
    excess, _ = budget_excess(trace)
    design = select_greedy(candidates, excess)
    design_moved = check_schedule(trace, lower_offload_choice(trace, design)).bytes_moved
    for swap_work in (0, 7, 60, 400):
        refined = refine_choice(candidates, excess, design, swap_work=swap_work, max_scan=5)
        checked = check_schedule(trace, lower_offload_choice(trace, refined))
        assert checked.violations == (), swap_work
        assert checked.bytes_moved <= design_moved, swap_work


@settings(max_examples=80, deadline=None)
@given(pressured_traces(max_ops=40, max_storages=20), st.sampled_from([0, 7, 60, 40_000]))
def test_the_redundancy_shortcut_changes_no_choice(trace: ActivationTrace, swap_work: int) -> None:
    # Refinement answers "is this gap redundant?" from the tree's maximum where the gap
    # covers it (no tree walk) and counts the answer as the walk's work: the choice must
    # be exactly the one the walks alone give, with any work budget.
    candidates = offload_candidates(trace)
    excess, _ = budget_excess(trace)
    design = select_greedy(candidates, excess)
    fast = refine_choice(candidates, excess, design, swap_work=swap_work, max_scan=5)
    with pytest.MonkeyPatch.context() as patch:  # no op is ever the maximum: always walk
        patch.setattr(RangeAddMaxTree, "argmax_all", lambda tree: -1)
        walked = refine_choice(candidates, excess, design, swap_work=swap_work, max_scan=5)
    assert fast == walked


@settings(max_examples=30, deadline=None)
@given(pressured_traces(max_ops=24, max_storages=10))
def test_validator_catches_every_single_missing_action(trace: ActivationTrace) -> None:
    """Every action of a planner's schedule is needed: deleting any one of them must
    make ``check_schedule`` report a violation (mutation test of the validator)."""
    schedule = GreedyResidencyPlanner().plan(trace)
    assert check_schedule(trace, schedule).violations == ()
    last_d2h = {a.storage: op for op, _, a in schedule.actions() if a.kind is ActionKind.COPY_D2H}
    for slots_name in ("pre", "post"):
        slots = getattr(schedule, slots_name)
        for op, actions in enumerate(slots):
            for position, action in enumerate(actions):
                if action.kind is ActionKind.RELEASE_HOST and last_d2h.get(action.storage, -1) >= op:
                    # A later write epoch copies the storage again: without this release
                    # that copy reuses the old buffer (as the runtime does), also valid.
                    continue
                mutated = list(slots)
                mutated[op] = actions[:position] + actions[position + 1 :]
                broken = schedule.__class__(
                    pre=mutated if slots_name == "pre" else schedule.pre,
                    post=mutated if slots_name == "post" else schedule.post,
                )
                assert check_schedule(trace, broken).violations, (slots_name, op, action)
