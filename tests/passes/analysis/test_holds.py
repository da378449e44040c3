"""Held storages (``ActivationTrace.held_until``): a reference keeps a storage past its
last access (the eager warmup records where each storage died, issue 49 case 2).

The bytes must survive to the end of the hold, on the device or as a host copy, and no
op reads them: the last stretch is a *hold gap* whose offload needs no reload. Checked
here on random traces (hypothesis) and on hand-built ones: liveness and the planners'
profile agree, holds add no unavoidable bytes, every planner's schedule is valid, the
validator rejects a schedule that drops the bytes before the hold ends, and the field
survives JSON.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_offload.errors import TraceFormatError
from hyper_offload.passes import (
    ActionKind,
    ActivationTrace,
    ResidencySchedule,
    check_schedule,
    required_bytes,
    resident_bytes_without_offload,
)
from hyper_offload.passes.analysis.liveness import is_hold_gap, offload_candidates, op_byte_profile
from hyper_offload.passes.analysis.validator import Rule
from hyper_offload.passes.plan.report import FloorPlanner
from hyper_offload.passes.plan.greedy import GreedyResidencyPlanner
from hyper_offload.passes.plan.planning import plan_residency

from ..planner_strategies import traces


@st.composite
def held_traces(draw: st.DrawFn) -> ActivationTrace:
    """Random traces where some non-retained storages are held past their last access."""
    trace = draw(traces())
    held = {}
    for storage in trace.accessed_storages():
        last = trace.accesses_of(storage)[-1][0]
        if storage not in trace.retained and last + 1 < trace.num_ops and draw(st.booleans()):
            held[storage] = draw(st.integers(last + 1, trace.num_ops - 1))
    return dataclasses.replace(trace, held_until=held)


@settings(max_examples=150, deadline=None)
@given(held_traces())
def test_holds_add_no_unavoidable_bytes_and_profiles_agree(trace: ActivationTrace) -> None:
    plain = dataclasses.replace(trace, held_until={})
    assert required_bytes(trace) == required_bytes(plain)
    assert all(h >= p for h, p in zip(resident_bytes_without_offload(trace),
                                       resident_bytes_without_offload(plain)))
    assert op_byte_profile(trace) == (resident_bytes_without_offload(trace), required_bytes(trace))
    holds = [c for c in offload_candidates(trace) if is_hold_gap(trace, c)]
    assert sorted(c.storage for c in holds) == sorted(
        s for s in trace.held_until if trace.storage_sizes[s] > 0)


@settings(max_examples=150, deadline=None)
@given(held_traces())
def test_every_planner_keeps_held_bytes_and_meets_the_budget(trace: ActivationTrace) -> None:
    need = required_bytes(trace)
    for planner in (GreedyResidencyPlanner(refine=False), GreedyResidencyPlanner(),
                    FloorPlanner()):
        schedule = planner.plan(trace)
        report = check_schedule(trace, schedule)
        assert report.violations == (), (planner, report.violations)
        for op, resident in enumerate(report.resident_bytes):
            assert resident <= max(trace.budget_bytes, need[op]), (planner, op)
        for storage, held in trace.held_until.items():  # never reloaded after its last access
            last = trace.accesses_of(storage)[-1][0]
            reloads = [op for op, slot, a in schedule.actions()
                       if a.storage == storage and a.kind is ActionKind.COPY_H2D]
            assert all(op <= last for op in reloads), (planner, storage, reloads)
    placed = plan_residency(trace, GreedyResidencyPlanner(), earliest_prefetch_op=0)
    assert placed.check.ok  # placement and the timeline model take hold gaps too


def _held_trace(budget: int) -> ActivationTrace:
    """Storage 0 (8 B) is read at op 1 and held until op 4; storage 1 (8 B) lives 2..5."""
    ops = [{0: "W"}, {0: "R"}, {1: "W"}, {1: "R"}, {1: "R"}, {1: "R"}]
    trace = ActivationTrace.from_accesses(ops, {0: 8, 1: 8}, budget_bytes=budget)
    return dataclasses.replace(trace, held_until={0: 4})


def test_a_hold_counts_until_it_ends_and_its_gap_needs_no_reload() -> None:
    trace = _held_trace(budget=8)
    assert resident_bytes_without_offload(trace) == [8, 8, 16, 16, 16, 8]
    assert required_bytes(trace) == [8, 8, 8, 8, 8, 8]
    schedule = GreedyResidencyPlanner().plan(trace)
    assert schedule.post[0] == (_a("COPY_D2H 0"),)
    assert schedule.post[1] == (_a("RELEASE_DEVICE 0"),)
    assert schedule.post[4] == (_a("RELEASE_HOST 0"),)
    assert not any(a.kind is ActionKind.COPY_H2D for _, _, a in schedule.actions())
    report = check_schedule(trace, schedule)
    assert report.ok and report.resident_bytes == (8, 8, 8, 8, 8, 8)


def test_unpressured_a_held_storage_is_freed_when_its_hold_ends() -> None:
    trace = _held_trace(budget=100)
    schedule = GreedyResidencyPlanner().plan(trace)
    assert _a("RELEASE_DEVICE 0") in schedule.post[4]
    assert check_schedule(trace, schedule).resident_bytes == (8, 8, 16, 16, 16, 8)


@pytest.mark.parametrize("post, rule", [
    ({1: ["RELEASE_DEVICE 0"]}, Rule.RELEASE_WITHOUT_HOST_COPY),
    ({0: ["COPY_D2H 0"], 1: ["RELEASE_DEVICE 0"], 2: ["RELEASE_HOST 0"]},
     Rule.HOST_RELEASE_STILL_NEEDED),
])
def test_the_validator_rejects_dropping_held_bytes_before_the_hold_ends(post, rule) -> None:
    """The bug a hold guards against: freeing the only copy of bytes a reference still
    reaches (the replay of issue 49 case 2 did that, and a later read found nothing)."""
    trace = _held_trace(budget=100)
    post = {**post, 5: ["RELEASE_DEVICE 1"]}
    schedule = ResidencySchedule.from_dict({
        "format": "hyper-offload.schedule", "version": 1, "num_ops": 6,
        "pre": {}, "post": {str(k): v for k, v in post.items()}})
    assert [v.rule for v in check_schedule(trace, schedule).violations] == [rule]


def test_holds_survive_json_and_are_validated() -> None:
    trace = _held_trace(budget=8)
    assert ActivationTrace.from_json(trace.to_json()) == trace
    assert "held_until" not in dataclasses.replace(trace, held_until={}).to_dict()
    for held, match in (({0: 1}, "after the storage's last access"),
                        ({0: 6}, "before num_ops"), ({2: 3}, "no op accesses it")):
        with pytest.raises(TraceFormatError, match=match):
            dataclasses.replace(trace, held_until=held)
    with pytest.raises(TraceFormatError, match="retained"):
        dataclasses.replace(trace, retained=frozenset({0}))


def _a(text: str):
    from hyper_offload.passes import ResidencyAction

    return ResidencyAction.from_str(text)
