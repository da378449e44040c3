"""``with_step_end``: the end of the step as an op that reads every retained storage, so
that a plan may offload a retained storage (a gradient) between its last access and the
end of the step and reload it there (issue 49, case 4). Judged by ``check_schedule``
like any gap; a trace without the op is planned exactly as before."""

from __future__ import annotations

from hypothesis import given, settings

from hyper_offload.passes import (
    ActionKind,
    ActivationTrace,
    ResidencyAction,
    check_schedule,
    required_bytes,
)
from hyper_offload.passes.ir.trace import STEP_END, has_step_end, with_step_end
from hyper_offload.passes.plan.greedy import GreedyResidencyPlanner
from hyper_offload.passes.plan.planning import plan_residency

from ..planner_strategies import traces


def _gradient_trace(budget: int) -> ActivationTrace:
    """Storage 0 (a 'gradient', 16 B, retained) is made at op 1; storages 1..4 (8 B each)
    are short-lived activations of ops 2..9 after it."""
    ops: list[dict[int, str]] = [{}, {0: "W"}]
    for op in range(2, 10):
        s = 1 + (op - 2) // 2
        ops.append({s: "W" if op % 2 == 0 else "R"})
    return ActivationTrace.from_accesses(
        ops, {0: 16, 1: 8, 2: 8, 3: 8, 4: 8}, budget_bytes=budget, retained={0})


def test_without_the_end_op_a_retained_storage_is_pinned_to_the_end() -> None:
    trace = _gradient_trace(budget=16)
    assert required_bytes(trace)[2:] == [24] * 8  # its 16 B + the op's own 8 B: over 16
    assert not check_schedule(trace, GreedyResidencyPlanner().plan(trace)).feasible


def test_with_it_the_plan_moves_it_out_and_back_and_meets_the_budget() -> None:
    trace = with_step_end(_gradient_trace(budget=16))
    assert has_step_end(trace) and trace.ops[-1].name == STEP_END and trace.num_ops == 11
    assert required_bytes(trace)[2:10] == [8] * 8 and required_bytes(trace)[10] == 16
    schedule = GreedyResidencyPlanner().plan(trace)
    report = check_schedule(trace, schedule)
    assert report.ok and report.feasible and report.peak_resident_bytes <= 16
    assert schedule.post[1] == (ResidencyAction(ActionKind.COPY_D2H, 0),
                                ResidencyAction(ActionKind.RELEASE_DEVICE, 0))
    assert ResidencyAction(ActionKind.WAIT_H2D, 0) in schedule.pre[10]
    assert report.resident_bytes[10] == 16  # every retained byte is back at the end


@settings(max_examples=150, deadline=None)
@given(traces())
def test_the_end_op_only_lowers_what_no_schedule_can_move(trace: ActivationTrace) -> None:
    """Per op, the unavoidable bytes with the end op are at most those without it (a
    retained storage is no longer pinned past its last access), and its own are the
    retained bytes; the greedy plan is valid and meets ``max(budget, required)``."""
    ended = with_step_end(trace)
    before, after = required_bytes(trace), required_bytes(ended)
    assert all(a <= b for a, b in zip(after, before))
    assert after[-1] == trace.retained_bytes
    planned = plan_residency(ended, GreedyResidencyPlanner(), earliest_prefetch_op=0)
    report = planned.check
    assert report.ok
    assert all(r <= max(ended.budget_bytes, n) for r, n in zip(report.resident_bytes, after))
    assert ended.ops[:-1] == trace.ops and ended.storage_sizes == trace.storage_sizes
