"""The host budget (issue 44): planners never plan more bucketed host bytes alive at once
than ``host_budget_bytes``; where that leaves bytes on the device, the plan says so.

* structure: bucketed counting, a hand-built trace where the host budget binds;
* properties (hypothesis): any choice filtered by ``fit_host_budget`` and every schedule
  ``plan_residency`` returns under a host budget stay within it, and pass
  ``check_schedule`` under the device bytes they reach.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_offload.errors import PlanningError
from hyper_offload.passes import ActivationTrace, check_schedule, required_bytes
from hyper_offload.passes.analysis.liveness import offload_candidates
from hyper_offload.passes.ir.schedule import host_bucket_bytes
from hyper_offload.passes.plan.report import FloorPlanner, lower_offload_choice
from hyper_offload.passes.plan.greedy import GreedyResidencyPlanner
from hyper_offload.passes.plan.host_budget import HostLedger, fit_host_budget, host_curve
from hyper_offload.passes.plan.planning import plan_residency

from ..planner_strategies import pressured_traces

KIB = 1024


def _scaled(trace: ActivationTrace, factor: int) -> ActivationTrace:
    """``trace`` with every size (and the budget) times ``factor``: sizes of a few KiB,
    where pool buckets round up by different amounts."""
    return dataclasses.replace(
        trace,
        storage_sizes={s: n * factor for s, n in trace.storage_sizes.items()},
        budget_bytes=trace.budget_bytes * factor,
    )


def _two_saved() -> ActivationTrace:
    """Two 3 KiB activations saved across four ops, read back at the end; a budget of
    one of them on top of the op's own 1 KiB."""
    ops = [{0: "W"}, {1: "W"}, {2: "W"}, {2: "R"}, {2: "R"}, {1: "R"}, {0: "R"}]
    sizes = {0: 3 * KIB, 1: 3 * KIB, 2: KIB}
    return ActivationTrace.from_accesses(ops, sizes, budget_bytes=4 * KIB)


def test_host_bytes_are_counted_in_pool_buckets() -> None:
    trace = _two_saved()
    schedule = GreedyResidencyPlanner(refine=False).plan(trace.with_budget(KIB))
    curve = host_curve(trace, schedule)
    # Both 3 KiB storages leave the device: each holds a 4 KiB bucket on the host.
    assert curve.peak == 2 * host_bucket_bytes(3 * KIB) == 8 * KIB
    assert check_schedule(trace.with_budget(KIB), schedule).peak_host_bytes == 6 * KIB


def test_host_budget_binds_and_the_plan_says_so() -> None:
    trace = _two_saved().with_budget(KIB)
    free = plan_residency(trace, GreedyResidencyPlanner(), where="test")
    assert free.binding == "device" and free.peak_host_bytes == 8 * KIB
    # Room for one bucket: the other activation stays on the device, over its budget.
    held = plan_residency(trace, GreedyResidencyPlanner(host_budget_bytes=4 * KIB),
                          host_budget_bytes=4 * KIB, where="test")
    assert held.peak_host_bytes == 4 * KIB
    assert held.binding == "host" and held.requested_budget_bytes == KIB
    assert held.trace.budget_bytes == held.check.peak_resident_bytes == 4 * KIB
    assert held.check.ok
    # No room at all: nothing moves, the device holds the step as without offload.
    none = plan_residency(trace, GreedyResidencyPlanner(host_budget_bytes=0),
                          host_budget_bytes=0, where="test")
    assert none.peak_host_bytes == 0 and none.check.bytes_moved == 0
    assert none.binding == "host"


def test_a_planner_that_ignores_the_host_budget_is_named() -> None:
    trace = _two_saved().with_budget(KIB)
    with pytest.raises(PlanningError, match="max_host_activation_mb") as info:
        plan_residency(trace, FloorPlanner(), host_budget_bytes=4 * KIB, where="test")
    assert "FloorPlanner" in str(info.value)


def test_a_host_budget_that_does_not_bind_changes_nothing() -> None:
    trace = _two_saved().with_budget(KIB)
    free = plan_residency(trace, GreedyResidencyPlanner(), where="test")
    roomy = plan_residency(trace, GreedyResidencyPlanner(host_budget_bytes=8 * KIB),
                           host_budget_bytes=8 * KIB, where="test")
    assert roomy.schedule == free.schedule and roomy.binding == "device"


@settings(max_examples=150, deadline=None)
@given(pressured_traces(), st.integers(300, 3000), st.data())
def test_any_fitted_choice_stays_within_the_host_budget(
    trace: ActivationTrace, factor: int, data: st.DataObject
) -> None:
    trace = _scaled(trace, factor)
    candidates = offload_candidates(trace)
    chosen = data.draw(st.permutations(candidates)) if candidates else []
    chosen = chosen[: data.draw(st.integers(0, len(chosen)))]
    budget = data.draw(st.integers(0, sum(host_bucket_bytes(c.size) for c in chosen) + 1))
    kept, dropped = fit_host_budget(trace.num_ops, chosen, budget)
    assert len(kept) + dropped == len(chosen)
    assert kept == [c for c in chosen if c in kept]  # a subsequence, in the given order
    schedule = lower_offload_choice(trace, kept)
    assert host_curve(trace, schedule).peak <= budget
    # Dropping candidates never breaks the schedule rules (only the device budget).
    rules = {v.rule.value for v in check_schedule(trace, schedule).violations}
    assert rules <= {"OVER_BUDGET", "TRANSIENT_OVER_BUDGET"}


@settings(max_examples=120, deadline=None)
@given(pressured_traces(), st.integers(300, 3000), st.floats(0, 1), st.booleans(),
       st.sampled_from(["time", "bytes"]))
def test_planned_host_bytes_never_exceed_the_host_budget(
    trace: ActivationTrace, factor: int, share: float, refine: bool, objective: str
) -> None:
    trace = _scaled(trace, factor)
    unlimited = plan_residency(trace, GreedyResidencyPlanner(refine, objective), where="test")
    budget = int(share * unlimited.peak_host_bytes)
    planner = GreedyResidencyPlanner(refine, objective, host_budget_bytes=budget)
    planned = plan_residency(trace, planner, host_budget_bytes=budget, where="test")
    assert host_curve(planned.trace, planned.schedule).peak == planned.peak_host_bytes <= budget
    assert planned.check.ok and planned.requested_budget_bytes == trace.budget_bytes
    if planned.binding == "host":
        assert planned.trace.budget_bytes > trace.budget_bytes
    else:  # the device budget held wherever the step's own operands allow
        assert planned.trace.budget_bytes == trace.budget_bytes
    allowed = [max(planned.trace.budget_bytes, need) for need in required_bytes(trace)]
    assert all(b <= a for b, a in zip(planned.check.resident_bytes, allowed))


def test_the_ledger_rejects_invalid_budgets() -> None:
    from hyper_offload.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="host budget"):
        HostLedger(3, -1)
    with pytest.raises(ConfigurationError, match="host budget"):
        GreedyResidencyPlanner(host_budget_bytes=1.5)  # type: ignore[arg-type]
