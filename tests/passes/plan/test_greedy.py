"""The greedy residency planner on small hand-built traces: the structure of its schedules."""

from __future__ import annotations

import pytest

from hyper_offload.config import OffloadConfig
from hyper_offload.passes import (
    ActionKind,
    ActivationTrace,
    InfeasibleOp,
    ResidencyAction,
    ResidencyPlanner,
    Rule,
    check_schedule,
)
from hyper_offload.passes.analysis.liveness import OffloadCandidate, offload_candidates
from hyper_offload.passes.plan.report import lower_offload_choice
from hyper_offload.passes.plan.greedy import GreedyResidencyPlanner, PlanReport

BOTH = [GreedyResidencyPlanner(refine=False), GreedyResidencyPlanner(refine=True)]


def slot(schedule_slot: tuple[ResidencyAction, ...]) -> list[str]:
    return [repr(a) for a in schedule_slot]


def checked(trace: ActivationTrace, planner: GreedyResidencyPlanner) -> PlanReport:
    """Plan, and fail the test unless check_schedule accepts the schedule."""
    report = planner.plan_with_report(trace)
    check_schedule(trace, report.schedule).raise_if_invalid()
    return report


@pytest.mark.parametrize("planner", BOTH, ids=repr)
def test_one_long_lived_activation_is_offloaded_and_the_budget_met(planner) -> None:
    trace = ActivationTrace.from_accesses(
        [{0: "W"}, {1: "W"}, {1: "R"}, {2: "W"}, {2: "R"}, {0: "R"}],
        {0: 100, 1: 50, 2: 10},
        budget_bytes=100,
    )
    schedule = checked(trace, planner).schedule
    assert slot(schedule.post[0]) == ["COPY_D2H 0", "RELEASE_DEVICE 0"]
    assert slot(schedule.pre[5]) == ["COPY_H2D 0", "WAIT_H2D 0"]
    assert slot(schedule.post[5]) == ["RELEASE_HOST 0", "RELEASE_DEVICE 0"]
    assert slot(schedule.post[2]) == ["RELEASE_DEVICE 1"]
    assert slot(schedule.post[4]) == ["RELEASE_DEVICE 2"]
    report = check_schedule(trace, schedule)
    assert report.resident_bytes == (100, 50, 50, 10, 10, 100)
    assert report.bytes_d2h == report.bytes_h2d == 100


@pytest.mark.parametrize("planner", BOTH, ids=repr)
def test_no_pressure_means_no_transfer_only_releases(planner) -> None:
    trace = ActivationTrace.from_accesses(
        [{0: "W"}, {1: "W"}, {0: "R", 1: "R"}], {0: 10, 1: 10}, budget_bytes=20
    )
    schedule = checked(trace, planner).schedule
    assert schedule.count(ActionKind.COPY_D2H) == schedule.count(ActionKind.COPY_H2D) == 0
    assert slot(schedule.post[2]) == ["RELEASE_DEVICE 0", "RELEASE_DEVICE 1"]


@pytest.mark.parametrize("planner", BOTH, ids=repr)
def test_copy_is_made_after_the_last_write_before_the_gap(planner) -> None:
    # Storage 0 is written at ops 0 and 2 (in place), read at 3 and 7; the pressure sits
    # at ops 4..6 only, so the gap 3 -> 7 is offloaded and its host copy must be taken
    # after op 2's write: a copy after op 0 would be stale.
    trace = ActivationTrace.from_accesses(
        [{0: "W"}, {}, {0: "W"}, {0: "R"}, {1: "W"}, {1: "R"}, {1: "R"}, {0: "R"}],
        {0: 40, 1: 40},
        budget_bytes=60,
    )
    schedule = checked(trace, planner).schedule
    assert slot(schedule.post[2]) == ["COPY_D2H 0"]
    assert slot(schedule.post[3]) == ["RELEASE_DEVICE 0"]
    assert schedule.count(ActionKind.COPY_D2H) == 1
    assert not any(a.kind is ActionKind.COPY_D2H for a in schedule.post[0])


@pytest.mark.parametrize("planner", BOTH, ids=repr)
def test_retained_storage_is_reloaded_and_never_released(planner) -> None:
    # Storage 0 is retained (a step output) and idle across the pressure at ops 1..3.
    trace = ActivationTrace.from_accesses(
        [{0: "W", 2: "W"}, {1: "W"}, {1: "R"}, {1: "R"}, {0: "R"}, {}],
        {0: 100, 1: 60, 2: 5},
        budget_bytes=100,
        retained=[0, 2],
    )
    schedule = checked(trace, planner).schedule
    releases = [
        (i, a.storage) for i, _, a in schedule.actions() if a.kind is ActionKind.RELEASE_DEVICE
    ]
    assert (0, 0) in releases  # the gap 0 -> 4 is offloaded ...
    assert all(storage != 0 or op < 4 for op, storage in releases)  # ... never after op 4
    assert all(storage != 2 for _, storage in releases)
    report = check_schedule(trace, schedule)
    assert report.resident_bytes[-1] == 105


@pytest.mark.parametrize("planner", BOTH, ids=repr)
def test_clean_host_copy_is_reused_for_two_offloaded_gaps(planner) -> None:
    # Storage 0 is written once and read at 3 and 6; pressure at ops 1-2 and 4-5 needs
    # both gaps offloaded, from one host copy.
    trace = ActivationTrace.from_accesses(
        [{0: "W"}, {1: "W"}, {1: "R"}, {0: "R"}, {2: "W"}, {2: "R"}, {0: "R"}],
        {0: 50, 1: 60, 2: 60},
        budget_bytes=80,
    )
    report = checked(trace, planner)
    schedule = report.schedule
    assert sorted((c.start, c.end) for c in report.chosen) == [(0, 3), (3, 6)]
    assert schedule.count(ActionKind.COPY_D2H) == 1
    assert schedule.count(ActionKind.COPY_H2D) == 2
    assert slot(schedule.post[6]) == ["RELEASE_HOST 0", "RELEASE_DEVICE 0"]
    totals = check_schedule(trace, schedule)
    assert (totals.bytes_d2h, totals.bytes_h2d) == (50, 100)


def test_a_write_opens_a_new_epoch_with_its_own_copy() -> None:
    # Gap 0 -> 3 reloads the first epoch; op 3 writes in place, so gap 3 -> 6 needs a
    # fresh copy, and the first buffer is freed before the new copy is taken.
    trace = ActivationTrace.from_accesses(
        [{0: "W"}, {1: "W"}, {1: "R"}, {0: "W"}, {2: "W"}, {2: "R"}, {0: "R"}],
        {0: 50, 1: 60, 2: 60},
        budget_bytes=80,
    )
    schedule = checked(trace, GreedyResidencyPlanner(refine=False)).schedule
    assert slot(schedule.post[3]) == ["RELEASE_HOST 0", "COPY_D2H 0", "RELEASE_DEVICE 0"]
    assert check_schedule(trace, schedule).bytes_d2h == 100


@pytest.mark.parametrize("planner", BOTH, ids=repr)
def test_infeasible_ops_are_reported_and_the_rest_still_planned(planner) -> None:
    # Ops 2 and 3 touch 300 bytes under a 200-byte budget: infeasible by 100 bytes.
    # Everything idle across them is offloaded, and op 5 (feasible) meets the budget.
    trace = ActivationTrace.from_accesses(
        [{0: "W"}, {2: "W"}, {1: "W"}, {1: "R"}, {3: "W"}, {0: "R", 3: "R"}, {2: "R"}],
        {0: 100, 1: 300, 2: 150, 3: 90},
        budget_bytes=200,
    )
    report = checked(trace, planner)
    assert report.infeasible_ops == (InfeasibleOp(2, 300, 100), InfeasibleOp(3, 300, 100))
    assert not report.feasible
    checked_report = check_schedule(trace, report.schedule)
    assert checked_report.resident_bytes[2] == checked_report.resident_bytes[3] == 300
    assert all(
        b <= 200 for i, b in enumerate(checked_report.resident_bytes) if i not in (2, 3)
    )
    assert not [v for v in checked_report.violations if v.rule is Rule.OVER_BUDGET]


def test_refinement_swaps_a_large_pick_for_cheaper_covering_ones() -> None:
    # The design ranks the 100-byte storage 0 first (longest gap) although two 10-byte
    # gaps cover both pressure spikes (ops 4-6 and 14-16, 5 bytes over).
    ops: list[dict[int, str]] = [{} for _ in range(21)]
    ops[0] = {0: "W"}
    ops[20] = {0: "R"}
    ops[1], ops[9] = {1: "W"}, {1: "R"}
    ops[11], ops[19] = {2: "W"}, {2: "R"}
    ops[4], ops[6] = {3: "W"}, {3: "R"}
    ops[14], ops[16] = {4: "W"}, {4: "R"}
    trace = ActivationTrace.from_accesses(
        ops, {0: 100, 1: 10, 2: 10, 3: 5, 4: 5}, budget_bytes=110
    )
    design = checked(trace, GreedyResidencyPlanner(refine=False))
    refined = checked(trace, GreedyResidencyPlanner(refine=True))
    assert [(c.storage, c.start, c.end) for c in design.chosen] == [(0, 0, 20)]
    assert sorted((c.storage, c.start, c.end) for c in refined.chosen) == [(1, 1, 9), (2, 11, 19)]
    assert check_schedule(trace, design.schedule).bytes_moved == 200
    assert check_schedule(trace, refined.schedule).bytes_moved == 40


def test_zero_byte_storages_and_touching_accesses_are_not_candidates() -> None:
    trace = ActivationTrace.from_accesses(
        [{0: "W", 1: "W"}, {2: "W"}, {0: "R", 2: "R"}, {1: "R"}, {2: "R"}],
        {0: 0, 1: 8, 2: 8},
        budget_bytes=0,
    )
    assert offload_candidates(trace) == [OffloadCandidate(1, 0, 3, 8, 0), OffloadCandidate(2, 2, 4, 8, 1)]


def test_lowering_orders_post_slots_so_the_validator_accepts_them() -> None:
    trace = ActivationTrace.from_accesses(
        [{0: "W", 1: "W"}, {2: "W"}, {0: "R", 1: "R"}, {2: "R"}, {0: "R", 1: "R"}],
        {0: 10, 1: 10, 2: 10},
        budget_bytes=0,
    )
    chosen = [OffloadCandidate(1, 0, 2, 10, 0), OffloadCandidate(0, 0, 2, 10, 0)]
    schedule = lower_offload_choice(trace, chosen)
    assert slot(schedule.post[0]) == ["COPY_D2H 0", "COPY_D2H 1", "RELEASE_DEVICE 0", "RELEASE_DEVICE 1"]
    assert slot(schedule.pre[2]) == ["COPY_H2D 0", "COPY_H2D 1", "WAIT_H2D 0", "WAIT_H2D 1"]
    assert slot(schedule.post[2]) == ["RELEASE_HOST 0", "RELEASE_HOST 1"]
    assert lower_offload_choice(trace, list(reversed(chosen))) == schedule
    rules = {v.rule for v in check_schedule(trace, schedule).violations}
    assert rules <= {Rule.OVER_BUDGET}


def test_report_and_protocol() -> None:
    trace = ActivationTrace.from_accesses(
        [{0: "W"}, {1: "W"}, {1: "R"}, {0: "R"}], {0: 10, 1: 10}, budget_bytes=10
    )
    planner = GreedyResidencyPlanner()
    report = planner.plan_with_report(trace)
    assert isinstance(planner, ResidencyPlanner)
    assert planner.plan(trace) == report.schedule
    assert report.num_candidates == 1 and len(report.chosen) == 1 and report.feasible
    assert repr(report).startswith("PlanReport(GreedyResidencyPlanner(refine=True, objective='time'): 1/1 gaps")
    assert GreedyResidencyPlanner() == GreedyResidencyPlanner(refine=True)
    assert GreedyResidencyPlanner(refine=False) != GreedyResidencyPlanner()


def test_empty_trace_plans_to_an_empty_schedule() -> None:
    trace = ActivationTrace.from_accesses([], {}, budget_bytes=0)
    assert GreedyResidencyPlanner().plan(trace).num_ops == 0


def test_offload_config_accepts_and_defaults_to_the_greedy_planner() -> None:
    planner = GreedyResidencyPlanner(refine=False)
    assert OffloadConfig(planner=planner).resolved_planner() is planner
    default = OffloadConfig().resolved_planner()
    assert isinstance(default, GreedyResidencyPlanner) and default.refine


@pytest.mark.parametrize(
    "field", ["max_resident_activation_mb", "max_host_activation_mb", "max_offload_activation_mb"])
@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), True, "8"])
def test_offload_config_rejects_budgets_that_are_not_finite_mib(field: str, value) -> None:
    with pytest.raises(ValueError, match=rf"OffloadConfig\.{field}: expected a finite number"):
        OffloadConfig(**{field: value})


def test_offload_config_rejects_a_planner_without_plan() -> None:
    with pytest.raises(TypeError, match="has no plan\\(trace\\) method"):
        OffloadConfig(planner=object())


def test_refinement_replaces_two_picks_by_one_gap_covering_both() -> None:
    # Pressure at ops 12-14 and 17-19 (10 bytes over each). The design picks the two
    # long 10-byte gaps of storages 0 and 1 (one per spike, 40 bytes moved); the 15-byte
    # gap 11 -> 20 of storage 2 covers both spikes for 30. No single-pick swap finds it:
    # either pick alone saves 20 bytes, less than the 30 that replace it.
    ops: list[dict[int, str]] = [{} for _ in range(32)]
    ops[0], ops[15] = {0: "W"}, {0: "R"}
    ops[16], ops[31] = {1: "W"}, {1: "R"}
    ops[11], ops[20] = {2: "W"}, {2: "R"}
    ops[12], ops[13], ops[14] = {3: "W"}, {3: "R"}, {3: "R"}
    ops[17], ops[18], ops[19] = {4: "W"}, {4: "R"}, {4: "R"}
    trace = ActivationTrace.from_accesses(
        ops, {0: 10, 1: 10, 2: 15, 3: 10, 4: 10}, budget_bytes=25
    )
    design = checked(trace, GreedyResidencyPlanner(refine=False))
    refined = checked(trace, GreedyResidencyPlanner(refine=True))
    assert sorted((c.storage, c.start, c.end) for c in design.chosen) == [(0, 0, 15), (1, 16, 31)]
    assert [(c.storage, c.start, c.end) for c in refined.chosen] == [(2, 11, 20)]
    assert check_schedule(trace, design.schedule).bytes_moved == 40
    assert check_schedule(trace, refined.schedule).bytes_moved == 30


def test_refinement_swaps_out_all_picks_of_one_storage_together() -> None:
    # Storage 0 (10 B, written once) idles over ops 1-9 and 11-19; the pressure is at
    # ops 7-8 and 12-13 (4 bytes over each). The design offloads both gaps of storage 0
    # (one D2H, two H2Ds: 30 bytes); the 6-byte gaps of storages 1 and 2 cover one spike
    # each for 24. Swapping out one gap of storage 0 saves only its 10-byte H2D (the D2H
    # stays for the other), less than the 12 bytes of either replacement, and inserting
    # one replacement frees just one gap: only both gaps out at once pay off.
    ops: list[dict[int, str]] = [{} for _ in range(21)]
    ops[0], ops[10], ops[20] = {0: "W"}, {0: "R"}, {0: "R"}
    ops[5], ops[9] = {1: "W"}, {1: "R"}
    ops[11], ops[15] = {2: "W"}, {2: "R"}
    ops[7], ops[8] = {3: "W"}, {3: "R"}
    ops[12], ops[13] = {4: "W"}, {4: "R"}
    trace = ActivationTrace.from_accesses(ops, {0: 10, 1: 6, 2: 6, 3: 4, 4: 4}, budget_bytes=16)
    design = checked(trace, GreedyResidencyPlanner(refine=False))
    refined = checked(trace, GreedyResidencyPlanner(refine=True))
    assert sorted((c.storage, c.start, c.end) for c in design.chosen) == [(0, 0, 10), (0, 10, 20)]
    assert [(c.storage, c.start, c.end) for c in refined.chosen] == [(1, 5, 9), (2, 11, 15)]
    assert check_schedule(trace, design.schedule).bytes_moved == 30
    assert check_schedule(trace, refined.schedule).bytes_moved == 24


def test_refinement_inserts_a_shared_gap_then_swaps_each_pick_for_a_small_one() -> None:
    # Pressure at ops 3, 5 (under storage 0's gap) and 9, 11 (under storage 1's gap).
    # The design offloads storages 0 and 1 (10 B each: 40 bytes moved). Storage 2's gap
    # covers ops 5 and 9 for 12 bytes; storages 3 and 4 cover ops 3 and 11 for 10 each:
    # 32 in all. Swapping out either pick alone needs storage 2 plus one small gap, 22
    # bytes for a 20-byte saving; storage 2 alone frees no pick. Only inserting storage 2
    # and then swapping each pick for its small gap pays off.
    ops: list[dict[int, str]] = [{} for _ in range(15)]
    ops[0], ops[7], ops[14] = {0: "W"}, {0: "R", 1: "W"}, {1: "R"}
    ops[4], ops[10] = {2: "W", 3: "R"}, {2: "R", 4: "W"}
    ops[2], ops[12] = {3: "W"}, {4: "R"}
    for op, filler in ((3, 5), (5, 6), (9, 7), (11, 8)):
        ops[op] = {filler: "W"}
    sizes = {0: 10, 1: 10, 2: 6, 3: 5, 4: 5, 5: 16, 6: 16, 7: 16, 8: 16}
    trace = ActivationTrace.from_accesses(ops, sizes, budget_bytes=26)
    design = checked(trace, GreedyResidencyPlanner(refine=False))
    refined = checked(trace, GreedyResidencyPlanner(refine=True))
    assert sorted((c.storage, c.start, c.end) for c in design.chosen) == [(0, 0, 7), (1, 7, 14)]
    assert [(c.storage, c.start, c.end) for c in refined.chosen] == [(2, 4, 10), (3, 2, 4), (4, 10, 12)]
    assert check_schedule(trace, design.schedule).bytes_moved == 40
    assert check_schedule(trace, refined.schedule).bytes_moved == 32


@pytest.mark.parametrize("planner", BOTH, ids=repr)
def test_ops_exactly_at_the_budget_attract_no_offload_one_byte_less_does(planner) -> None:
    # s0 (100 B) idles over ops 1..2 beside s1 (50 B): those ops hold exactly 150 B.
    accesses = [{0: "W"}, {1: "W"}, {1: "R"}, {0: "R"}]
    at_budget = ActivationTrace.from_accesses(accesses, {0: 100, 1: 50}, budget_bytes=150)
    schedule = checked(at_budget, planner).schedule
    assert schedule.count(ActionKind.COPY_D2H) == 0  # at the budget is not over it
    assert max(check_schedule(at_budget, schedule).resident_bytes) == 150
    below = ActivationTrace.from_accesses(accesses, {0: 100, 1: 50}, budget_bytes=149)
    schedule = checked(below, planner).schedule
    assert slot(schedule.post[0]) == ["COPY_D2H 0", "RELEASE_DEVICE 0"]
    assert check_schedule(below, schedule).resident_bytes == (100, 50, 50, 100)


@pytest.mark.parametrize("planner", BOTH, ids=repr)
def test_a_top_ranked_gap_over_ops_exactly_at_budget_is_skipped(planner) -> None:
    # Ops 1..4 hold exactly 150 B (s0 idles there beside s1); ops 7..8 hold 160 B. s0's
    # gap ranks first (the farthest), but its ops are not over budget: only s2's gap may
    # be taken. (The walk runs because ops 7..8 are over; this is the boundary test.)
    trace = ActivationTrace.from_accesses(
        [{0: "W"}, {1: "W"}, {}, {}, {1: "R"}, {0: "R"},
         {2: "W"}, {3: "W"}, {3: "R"}, {2: "R"}],
        {0: 100, 1: 50, 2: 100, 3: 60},
        budget_bytes=150,
    )
    schedule = checked(trace, planner).schedule
    d2h = [repr(a) for slot_ in schedule.post for a in slot_ if a.kind is ActionKind.COPY_D2H]
    assert d2h == ["COPY_D2H 2"]
    report = check_schedule(trace, schedule)
    assert report.resident_bytes[1:5] == (150, 150, 150, 150) and report.peak_resident_bytes == 150
