"""The disk tier's planning (issue 50): host copies that wait longest go to files when
the host budget binds.

* structure: a hand-built trace where the host holds one of two saved activations, and
  the disk tier lets both leave the device;
* the pass's contract (``spill_to_disk``): the host budget is met where the disk allows,
  the disk budget always, the device actions are untouched, ``check_schedule`` accepts;
* the stage in ``plan_residency`` (hypothesis): host budget and disk budget kept,
  ``check_schedule`` ok, the device peak never above the plan without the disk tier;
  without a disk budget the schedule is the one without the disk tier.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_offload.errors import ConfigurationError
from hyper_offload.passes import ActionKind, ActivationTrace, check_schedule
from hyper_offload.passes.ir.schedule import DISK_ACTIONS, ResidencySchedule, host_bucket_bytes
from hyper_offload.passes.plan.host_budget import host_copies, host_curve, spill_to_disk
from hyper_offload.passes.plan.greedy import GreedyResidencyPlanner
from hyper_offload.passes.plan.planning import PlanningStage, plan_residency

from ..planner_strategies import pressured_traces

KIB = 1024


def _two_saved(disk: int = 0, gbps: float = 1.0) -> ActivationTrace:
    """Two 3 KiB activations saved across four ops, read back at the end (1 µs ops)."""
    ops = [{0: "W"}, {1: "W"}, {2: "W"}, {2: "R"}, {2: "R"}, {1: "R"}, {0: "R"}]
    sizes = {0: 3 * KIB, 1: 3 * KIB, 2: KIB}
    trace = ActivationTrace.from_accesses(ops, sizes, budget_bytes=KIB)
    return trace.with_disk(disk, gbps)


def _device_actions(schedule: ResidencySchedule) -> list[tuple[int, str, object]]:
    return [(op, slot, a) for op, slot, a in schedule.actions() if a.kind not in DISK_ACTIONS]


def test_the_disk_tier_takes_what_the_host_cannot_hold() -> None:
    planner = GreedyResidencyPlanner(host_budget_bytes=4 * KIB)
    held = plan_residency(_two_saved(), planner, where="test")
    assert held.binding == "host" and held.check.peak_resident_bytes == 4 * KIB
    spilled = plan_residency(_two_saved(disk=8 * KIB), planner, where="test")
    # Both activations leave the device now; the one that waits longest (storage 0,
    # from op 0 to op 6) goes to disk, so the host holds one bucket at a time.
    assert spilled.binding == "device" and spilled.check.peak_resident_bytes == 3 * KIB
    assert spilled.peak_host_bytes == 4 * KIB and spilled.check.ok
    assert spilled.check.peak_disk_bytes == spilled.check.bytes_to_disk == 3 * KIB
    assert repr(spilled.schedule.post[0]) == "(COPY_D2H 0, SPILL_TO_DISK 0, RELEASE_DEVICE 0)"
    assert [a.kind for a in spilled.schedule.pre[6][:2]] == [
        ActionKind.LOAD_FROM_DISK, ActionKind.RELEASE_DISK]


def test_a_load_that_cannot_be_early_is_priced_as_a_stall() -> None:
    # The 3 KiB read at 1 GB/s takes 3.072 µs; the host has no room for it before op 6,
    # so the reload of op 6 waits for it there (the timeline model's rule).
    planned = plan_residency(_two_saved(disk=8 * KIB), GreedyResidencyPlanner(
        host_budget_bytes=4 * KIB), where="test")
    assert planned.predicted_stall_s == pytest.approx(
        3 * KIB / 1e9 + 2 * (3 * KIB / 16e9), rel=1e-9)  # the read, then two H2Ds exposed


def test_a_disk_too_small_changes_nothing() -> None:
    planner = GreedyResidencyPlanner(host_budget_bytes=4 * KIB)
    held = plan_residency(_two_saved(), planner, where="test")
    small = plan_residency(_two_saved(disk=2 * KIB), planner, where="test")
    assert small.schedule == held.schedule and small.binding == "host"


def test_the_pass_refuses_a_schedule_that_already_spills() -> None:
    planned = plan_residency(_two_saved(disk=8 * KIB), GreedyResidencyPlanner(
        host_budget_bytes=4 * KIB), where="test")
    with pytest.raises(ConfigurationError, match="already uses the disk tier"):
        spill_to_disk(planned.trace, planned.schedule, host_budget_bytes=0)
    with pytest.raises(ConfigurationError, match="host_budget_bytes"):
        spill_to_disk(planned.trace, planned.planned, host_budget_bytes=-1)


def test_loads_never_start_before_the_earliest_op() -> None:
    trace = _two_saved(disk=8 * KIB, gbps=1e3)
    schedule = GreedyResidencyPlanner().plan(trace)
    spilled = spill_to_disk(trace, schedule, host_budget_bytes=4 * KIB, earliest_load_op=4)
    loads = [op for op, _, a in spilled.actions() if a.kind is ActionKind.LOAD_FROM_DISK]
    assert loads and min(loads) >= 4 and check_schedule(trace, spilled).ok


@st.composite
def _stacks(draw: st.DrawFn) -> tuple[ActivationTrace, int]:
    """A saved stack (the training step's shape: a forward writes one activation per
    layer, the backward reads them back in reverse, a temporary beside each op), op
    times, a device budget, a host budget with room for the largest buffer but not for
    everything, and a disk tier."""
    layers = draw(st.integers(2, 10))
    sizes = draw(st.lists(st.integers(1, 64), min_size=layers, max_size=layers))
    ops: list[dict[int, str]] = [{i: "W", layers: "W"} for i in range(layers)]
    ops += [{i: "R", layers: "W"} for i in reversed(range(layers))]
    trace = ActivationTrace.from_accesses(
        ops, {**{i: n * KIB for i, n in enumerate(sizes)}, layers: KIB}, budget_bytes=0)
    durations = draw(st.lists(st.floats(1e-7, 1e-5), min_size=trace.num_ops,
                              max_size=trace.num_ops))
    trace = dataclasses.replace(trace, ops=tuple(
        dataclasses.replace(op, duration_s=d) for op, d in zip(trace.ops, durations)))
    buckets = [host_bucket_bytes(n * KIB) for n in sizes]
    host = draw(st.integers(max(buckets), sum(buckets)))
    device = draw(st.integers(KIB + max(sizes) * KIB, KIB + sum(sizes) * KIB))
    disk = draw(st.integers(max(sizes) * KIB if draw(st.booleans()) else 0, sum(sizes) * KIB))
    gbps = draw(st.sampled_from([1e-3, 1e-1, 10.0]))
    return trace.with_budget(device).with_disk(disk, gbps), host


@st.composite
def _disk_cases(draw: st.DrawFn) -> tuple[ActivationTrace, int]:
    """A saved stack (:func:`_stacks`), or a pressured trace in KiB-scale sizes with op
    times, a disk tier and a host budget below what the plan without one holds."""
    if draw(st.booleans()):
        return draw(_stacks())
    trace = draw(pressured_traces())
    factor = draw(st.integers(300, 3000))
    durations = draw(st.lists(st.floats(1e-7, 1e-5), min_size=trace.num_ops,
                              max_size=trace.num_ops))
    trace = dataclasses.replace(
        trace, budget_bytes=trace.budget_bytes * factor,
        storage_sizes={s: n * factor for s, n in trace.storage_sizes.items()},
        ops=tuple(dataclasses.replace(op, duration_s=d) for op, d in zip(trace.ops, durations)),
    )
    free = plan_residency(trace, GreedyResidencyPlanner(), where="test").peak_host_bytes
    host = int(draw(st.floats(0, 1)) * free)
    disk = draw(st.integers(0, sum(trace.storage_sizes.values())))
    gbps = draw(st.sampled_from([1e-3, 1e-1, 10.0]))
    return trace.with_disk(disk, gbps), host


@settings(max_examples=100, deadline=None)
@given(_disk_cases(), st.booleans(), st.integers(0, 40))
def test_the_pass_keeps_its_contract(case: tuple[ActivationTrace, int], waits: bool,
                                     earliest: int) -> None:
    trace, host = case
    schedule = GreedyResidencyPlanner().plan(trace)
    spilled = spill_to_disk(trace, schedule, host_budget_bytes=host, earliest_load_op=earliest,
                            release_waits_for_d2h=waits)
    report = check_schedule(trace, spilled)
    assert report.ok, report.violations[:3]
    assert report.peak_disk_bytes <= trace.disk_budget_bytes
    assert _device_actions(spilled) == _device_actions(schedule)  # same device curve
    assert report.resident_bytes == check_schedule(trace, schedule).resident_bytes
    before, after = host_curve(trace, schedule), host_curve(trace, spilled)
    assert all(a <= b for a, b in zip(after.values, before.values))
    assert after.peak <= before.peak
    if trace.disk_budget_bytes == 0 or before.peak <= host:
        assert spilled == schedule
    assert all(op >= earliest for op, _, a in spilled.actions()
               if a.kind is ActionKind.LOAD_FROM_DISK)
    copies = {c.storage for c in host_copies(trace, schedule)}
    assert {a.storage for _, _, a in spilled.actions() if a.kind in DISK_ACTIONS} <= copies


@settings(max_examples=80, deadline=None)
@given(_disk_cases(), st.booleans())
def test_the_stage_keeps_both_budgets_and_never_raises_the_device_peak(
    case: tuple[ActivationTrace, int], waits: bool
) -> None:
    trace, host = case
    planner = GreedyResidencyPlanner(host_budget_bytes=host)
    kwargs = dict(where="test", release_waits_for_d2h=waits,
                  latest_release_op=trace.num_ops - 1 if waits else None)
    without = plan_residency(trace.with_disk(0), planner, **kwargs)
    planned = plan_residency(trace, planner, **kwargs)
    assert planned.check.ok and planned.check == check_schedule(planned.trace, planned.schedule)
    assert host_curve(planned.trace, planned.schedule).peak == planned.peak_host_bytes <= host
    assert planned.check.peak_disk_bytes <= trace.disk_budget_bytes
    assert planned.check.peak_resident_bytes <= without.check.peak_resident_bytes
    if trace.disk_budget_bytes == 0 or without.binding != "host":
        assert planned.schedule == without.schedule
    assert PlanningStage.SPILL_TO_DISK.value == "spill_to_disk"
