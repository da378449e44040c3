"""``check_schedule`` and liveness on small hand-built traces: one test per rule."""

from __future__ import annotations

import pytest

from hyper_offload.passes import (
    ActionKind,
    ActivationTrace,
    InfeasibleOp,
    ResidencyAction,
    ResidencySchedule,
    Rule,
    ScheduleError,
    check_schedule,
    required_bytes,
    resident_bytes_without_offload,
)
from hyper_offload.passes.analysis.liveness import access_gaps, infeasible_ops, storage_liveness

D2H, REL, H2D, WAIT, HREL = (
    ActionKind.COPY_D2H,
    ActionKind.RELEASE_DEVICE,
    ActionKind.COPY_H2D,
    ActionKind.WAIT_H2D,
    ActionKind.RELEASE_HOST,
)


def acts(*pairs) -> list[ResidencyAction]:
    return [ResidencyAction(kind, sid) for kind, sid in pairs]


# s0 (100 B) is written at op 0 and read at op 3; s1 (50 B) lives over ops 1..2.
TRACE = ActivationTrace.from_accesses(
    [{0: "W"}, {1: "W"}, {1: "R"}, {0: "R"}], {0: 100, 1: 50}, budget_bytes=120
)
GOOD_PRE = {3: acts((H2D, 0), (WAIT, 0))}
GOOD_POST = {
    0: acts((D2H, 0), (REL, 0)),
    2: acts((REL, 1)),
    3: acts((REL, 0), (HREL, 0)),
}


def schedule(pre=None, post=None, trace=TRACE) -> ResidencySchedule:
    return ResidencySchedule.from_slots(trace.num_ops, pre or {}, post or {})


def rules(report) -> list[Rule]:
    return [v.rule for v in report.violations]


def test_liveness_intervals_curve_and_gaps() -> None:
    live = storage_liveness(TRACE)
    assert (live[0].first, live[0].last, live[0].end) == (0, 3, 4)
    assert resident_bytes_without_offload(TRACE) == [100, 150, 150, 100]
    assert [tuple(g) for g in access_gaps(TRACE)] == [(0, 0, 3)]
    assert list(access_gaps(TRACE)[0].covered) == [1, 2]


def test_required_bytes_count_operands_and_retained_tail() -> None:
    trace = ActivationTrace.from_accesses(
        [{0: "W"}, {1: "W"}, {1: "R"}], {0: 70, 1: 60}, budget_bytes=100, retained=[0]
    )
    assert required_bytes(trace) == [70, 130, 130]
    assert infeasible_ops(trace) == [InfeasibleOp(1, 130, 30), InfeasibleOp(2, 130, 30)]


def test_a_correct_offload_schedule_passes_and_reports_the_curve() -> None:
    report = check_schedule(TRACE, schedule(GOOD_PRE, GOOD_POST))
    assert report.ok and report.feasible
    assert report.resident_bytes == (100, 50, 50, 100)
    assert report.peak_resident_bytes == 100
    assert (report.bytes_d2h, report.bytes_h2d, report.num_transfers) == (100, 100, 2)
    assert report.peak_host_bytes == 100
    report.raise_if_invalid()


def test_no_offload_is_over_budget_by_mistake() -> None:
    report = check_schedule(TRACE, schedule(post={2: acts((REL, 1)), 3: acts((REL, 0))}))
    assert report.resident_bytes == (100, 150, 150, 100)
    assert rules(report) == [Rule.OVER_BUDGET, Rule.OVER_BUDGET]
    assert [v.op_index for v in report.violations] == [1, 2]
    with pytest.raises(ScheduleError, match=r"op 1: \[OVER_BUDGET\] 150 resident bytes exceed the budget 120"):
        report.raise_if_invalid()


def test_over_budget_at_an_infeasible_op_is_not_a_violation_up_to_its_needs() -> None:
    trace = ActivationTrace.from_accesses([{0: "W", 1: "W"}, {0: "R"}], {0: 100, 1: 50}, budget_bytes=120)
    report = check_schedule(trace, schedule(post={0: acts((REL, 1)), 1: acts((REL, 0))}, trace=trace))
    assert report.ok and not report.feasible
    assert report.infeasible_ops == (InfeasibleOp(0, 150, 30),)


def test_read_of_a_released_storage() -> None:
    report = check_schedule(TRACE, schedule(post={0: acts((D2H, 0), (REL, 0)), 2: acts((REL, 1)), 3: acts((HREL, 0))}))
    assert Rule.ACCESS_NOT_RESIDENT in rules(report)


def test_read_before_wait() -> None:
    report = check_schedule(TRACE, schedule({3: acts((H2D, 0))}, {**GOOD_POST, 3: acts((WAIT, 0), (REL, 0), (HREL, 0))}))
    assert rules(report) == [Rule.ACCESS_BEFORE_WAIT]


def test_release_without_copy_loses_data() -> None:
    report = check_schedule(TRACE, schedule(GOOD_PRE, {**GOOD_POST, 0: acts((REL, 0))}))
    assert rules(report)[:2] == [Rule.RELEASE_WITHOUT_HOST_COPY, Rule.H2D_WITHOUT_HOST_COPY]


def test_d2h_before_the_last_write_is_stale() -> None:
    trace = ActivationTrace.from_accesses([{0: "W"}, {0: "W"}, {1: "W"}, {0: "R"}], {0: 100, 1: 50}, budget_bytes=120)
    stale = schedule(
        {3: acts((H2D, 0), (WAIT, 0))},
        {0: acts((D2H, 0)), 1: acts((REL, 0)), 2: acts((REL, 1)), 3: acts((REL, 0), (HREL, 0))},
        trace=trace,
    )
    assert rules(check_schedule(trace, stale))[:2] == [Rule.RELEASE_STALE_HOST_COPY, Rule.H2D_WITHOUT_HOST_COPY]
    fresh = schedule(
        {3: acts((H2D, 0), (WAIT, 0))},
        {1: acts((D2H, 0), (REL, 0)), 2: acts((REL, 1)), 3: acts((REL, 0), (HREL, 0))},
        trace=trace,
    )
    assert check_schedule(trace, fresh).ok


def test_host_released_while_still_needed() -> None:
    report = check_schedule(TRACE, schedule(GOOD_PRE, {**GOOD_POST, 1: acts((HREL, 0))}))
    assert rules(report)[:2] == [Rule.HOST_RELEASE_STILL_NEEDED, Rule.H2D_WITHOUT_HOST_COPY]


def test_host_released_during_h2d() -> None:
    report = check_schedule(TRACE, schedule({3: acts((H2D, 0), (HREL, 0), (WAIT, 0))}, {**GOOD_POST, 3: acts((REL, 0))}))
    assert rules(report) == [Rule.HOST_RELEASE_DURING_H2D]


def test_pre_release_at_the_last_access_counts_as_needed() -> None:
    # Releasing in the *pre* slot of op 3 loses data op 3 reads.
    report = check_schedule(TRACE, schedule({3: acts((REL, 0))}, {2: acts((REL, 1))}))
    assert [v for v in report.violations if v.rule is Rule.RELEASE_WITHOUT_HOST_COPY][0].op_index == 3


def test_bookkeeping_rules() -> None:
    bad = schedule(
        {0: acts((D2H, 0)), 1: acts((H2D, 0))},
        {0: acts((REL, 9)), 2: acts((REL, 1), (REL, 1), (HREL, 1), (WAIT, 1))},
    )
    found = rules(check_schedule(TRACE, bad))
    for rule in (
        Rule.NOT_YET_CREATED,
        Rule.UNKNOWN_STORAGE,
        Rule.H2D_ALREADY_RESIDENT,
        Rule.RELEASE_NOT_RESIDENT,
        Rule.HOST_RELEASE_WITHOUT_COPY,
        Rule.WAIT_WITHOUT_H2D,
        Rule.DEVICE_NOT_RELEASED,
    ):
        assert rule in found, rule


def test_end_of_step_rules() -> None:
    trace = ActivationTrace.from_accesses([{0: "W"}, {1: "W"}, {0: "R"}], {0: 10, 1: 10}, budget_bytes=100, retained=[1])
    report = check_schedule(
        trace,
        schedule({2: acts((H2D, 0))}, {0: acts((D2H, 0), (REL, 0)), 1: acts((REL, 1))}, trace=trace),
    )
    found = rules(report)
    assert Rule.RELEASE_RETAINED in found
    assert Rule.ACCESS_BEFORE_WAIT in found
    assert {Rule.H2D_NEVER_WAITED, Rule.RETAINED_NOT_RESIDENT, Rule.DEVICE_NOT_RELEASED, Rule.HOST_NOT_RELEASED} <= set(found)


def test_length_mismatch() -> None:
    report = check_schedule(TRACE, ResidencySchedule.empty(2))
    assert rules(report) == [Rule.LENGTH_MISMATCH]


def test_copy_before_release_in_one_slot_peaks_over_budget() -> None:
    # pre[3] reloads s0 (100 B) while s1 (50 B, last read at op 2) is still resident and
    # frees s1 only afterwards: 150 bytes for a moment, above the 120-byte budget, though
    # op 3 itself sees 100. Releasing first is the same schedule within budget.
    late_release = schedule(
        {3: acts((H2D, 0), (WAIT, 0), (REL, 1))},
        {0: acts((D2H, 0), (REL, 0)), 3: acts((REL, 0), (HREL, 0))},
    )
    report = check_schedule(TRACE, late_release)
    assert report.resident_bytes == (100, 50, 50, 100)
    assert report.peak_resident_bytes == 150
    assert [(v.op_index, v.storage, v.rule) for v in report.violations] == [
        (3, 0, Rule.TRANSIENT_OVER_BUDGET)
    ]
    assert "raises resident bytes to 150, above the allowance 120" in report.violations[0].message
    early_release = schedule(
        {3: acts((REL, 1), (H2D, 0), (WAIT, 0))},
        {0: acts((D2H, 0), (REL, 0)), 3: acts((REL, 0), (HREL, 0))},
    )
    fixed = check_schedule(TRACE, early_release)
    assert fixed.ok and fixed.peak_resident_bytes == 100


def test_copy_in_a_post_slot_is_checked_between_ops_too() -> None:
    # The same reload issued in post[2], before s1 is released there.
    report = check_schedule(
        TRACE,
        schedule({3: acts((WAIT, 0))}, {0: acts((D2H, 0), (REL, 0)), 2: acts((H2D, 0), (REL, 1)),
                                        3: acts((REL, 0), (HREL, 0))}),
    )
    assert [(v.op_index, v.rule) for v in report.violations] == [(2, Rule.TRANSIENT_OVER_BUDGET)]
    # An op that is itself over budget is reported once, as OVER_BUDGET, not twice.
    no_release = check_schedule(TRACE, schedule({3: acts((H2D, 0), (WAIT, 0))}, {
        0: acts((D2H, 0), (REL, 0)), 3: acts((REL, 0), (REL, 1), (HREL, 0))}))
    assert rules(no_release) == [Rule.OVER_BUDGET]


def test_a_report_with_violations_is_not_ok_and_raises_listing_them() -> None:
    lost = schedule(post={0: acts((D2H, 0), (REL, 0)), 2: acts((REL, 1)), 3: acts((HREL, 0))})
    report = check_schedule(TRACE, lost)
    assert report.violations and not report.ok
    assert report.summary()["violations"]  # what the CLI prints
    with pytest.raises(ScheduleError, match=r"schedule breaks \d+ rule"):
        report.raise_if_invalid()
    good = check_schedule(TRACE, schedule(GOOD_PRE, GOOD_POST))
    assert good.ok and not good.violations
    good.raise_if_invalid()
