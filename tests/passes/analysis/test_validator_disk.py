"""``check_schedule`` and the disk tier (issue 50): a spill needs a valid host copy, a
reload a host copy loaded back, every file is released, disk bytes stay within the disk
budget, and host bytes count only while a buffer holds them. One broken schedule per
rule, each written out as the actions it runs."""

from __future__ import annotations

import pytest

from hyper_offload.passes import ActivationTrace, Rule, check_schedule
from hyper_offload.passes.ir.schedule import ResidencyAction, ResidencySchedule
from hyper_offload.passes.plan.host_budget import host_curve

# op 0 writes storage 0 (1000 B), ops 1-2 do not touch it, op 3 reads it.
TRACE = ActivationTrace.from_accesses([{0: "W"}, {}, {}, {0: "R"}], {0: 1000},
                                      budget_bytes=0).with_disk(1000)
COPY_OUT = "COPY_D2H 0, SPILL_TO_DISK 0, RELEASE_DEVICE 0"
RELOAD = "COPY_H2D 0, WAIT_H2D 0"
END = "RELEASE_HOST 0, RELEASE_DEVICE 0"


def _schedule(pre: dict[int, str], post: dict[int, str], num_ops: int = 4) -> ResidencySchedule:
    def parse(slots: dict[int, str]) -> dict[int, list[ResidencyAction]]:
        return {op: [ResidencyAction.from_str(a) for a in text.split(", ")]
                for op, text in slots.items() if text}

    return ResidencySchedule.from_slots(num_ops, parse(pre), parse(post))


GOOD = _schedule(pre={2: "LOAD_FROM_DISK 0, RELEASE_DISK 0", 3: RELOAD}, post={0: COPY_OUT, 3: END})


def test_a_spilled_schedule_is_valid_and_counted() -> None:
    report = check_schedule(TRACE, GOOD)
    assert report.ok, report.violations
    assert (report.peak_disk_bytes, report.bytes_to_disk, report.bytes_from_disk) == (1000,) * 3
    assert report.resident_bytes == (1000, 0, 0, 1000)
    # The host holds the copy from its D2H to its spill, then from its load to the end.
    assert report.peak_host_bytes == 1000
    assert host_curve(TRACE, GOOD).values == (0, 0, 1024, 1024)  # pool buckets


CASES = {
    Rule.SPILL_WITHOUT_HOST_COPY: ({3: RELOAD}, {0: "SPILL_TO_DISK 0, COPY_D2H 0, RELEASE_DEVICE 0",
                                                 3: END}),
    Rule.H2D_WITHOUT_HOST_COPY: ({3: RELOAD}, {0: COPY_OUT, 3: "RELEASE_DEVICE 0, RELEASE_DISK 0"}),
    Rule.LOAD_WITHOUT_DISK_COPY: ({2: "LOAD_FROM_DISK 0", 3: RELOAD},
                                  {0: "COPY_D2H 0, RELEASE_DEVICE 0, RELEASE_HOST 0", 3: END}),
    Rule.LOAD_HOST_HELD: ({1: "LOAD_FROM_DISK 0", 2: "LOAD_FROM_DISK 0, RELEASE_DISK 0",
                           3: RELOAD}, {0: COPY_OUT, 3: END}),
    Rule.DISK_NOT_RELEASED: ({2: "LOAD_FROM_DISK 0", 3: RELOAD}, {0: COPY_OUT, 3: END}),
    Rule.DISK_RELEASE_STILL_NEEDED: ({1: "RELEASE_DISK 0", 3: RELOAD}, {0: COPY_OUT, 3: END}),
    Rule.DISK_RELEASE_WITHOUT_FILE: ({2: "LOAD_FROM_DISK 0, RELEASE_DISK 0, RELEASE_DISK 0",
                                      3: RELOAD}, {0: COPY_OUT, 3: END}),
    Rule.SPILL_FILE_HELD: ({1: "LOAD_FROM_DISK 0", 3: RELOAD},
                           {0: COPY_OUT, 1: "SPILL_TO_DISK 0", 3: END}),
    Rule.SPILL_DURING_H2D: ({2: "LOAD_FROM_DISK 0, RELEASE_DISK 0, COPY_H2D 0",
                             3: "WAIT_H2D 0"}, {0: COPY_OUT, 2: "SPILL_TO_DISK 0", 3: END}),
}


@pytest.mark.parametrize("rule", list(CASES), ids=lambda r: r.value)
def test_each_broken_disk_rule_is_named(rule: Rule) -> None:
    pre, post = CASES[rule]
    report = check_schedule(TRACE, _schedule(pre, post))
    assert rule in {v.rule for v in report.violations}, report.violations


def test_a_reload_of_a_spilled_copy_says_to_load_it() -> None:
    pre, post = CASES[Rule.H2D_WITHOUT_HOST_COPY]
    (violation,) = [v for v in check_schedule(TRACE, _schedule(pre, post)).violations
                    if v.rule is Rule.H2D_WITHOUT_HOST_COPY]
    assert "LOAD_FROM_DISK it before the COPY_H2D" in violation.message


def test_disk_bytes_never_exceed_the_disk_budget() -> None:
    small = check_schedule(TRACE.with_disk(999), GOOD)
    assert [v.rule for v in small.violations] == [Rule.DISK_OVER_BUDGET]
    assert "999 B" in small.violations[0].message
    none = check_schedule(TRACE.with_disk(0), GOOD)
    assert "max_disk_activation_mb" in none.violations[0].message


def test_a_write_makes_the_disk_copy_stale() -> None:
    # op 1 writes storage 0 again after its spill: the file holds the old bytes.
    trace = ActivationTrace.from_accesses([{0: "W"}, {0: "W"}, {}, {0: "R"}], {0: 1000},
                                          budget_bytes=10_000).with_disk(1000)
    schedule = _schedule(pre={2: "LOAD_FROM_DISK 0, RELEASE_DISK 0", 3: RELOAD},
                         post={0: "COPY_D2H 0, SPILL_TO_DISK 0", 1: "RELEASE_DEVICE 0", 3: END})
    rules = [v.rule for v in check_schedule(trace, schedule).violations]
    assert Rule.RELEASE_WITHOUT_HOST_COPY in rules or Rule.LOAD_WITHOUT_DISK_COPY in rules
    assert Rule.LOAD_WITHOUT_DISK_COPY in rules
