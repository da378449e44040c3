"""The step plan made as one trace (issue 43): a step of one region plans as the region
scope does, below the floor it moves only what it must, and a step of several regions
is cut into schedules each region's own trace accepts.

Graphs: a small Llama (2 layers, dim 128, seq 256, bf16) captured once on fake tensors
(nothing allocated), ops priced on the GPU roofline so copies stall (predicted).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hyper_offload.compiler.fake_capture import capture_graphs
from hyper_offload.compiler.options import parse_backend_options
from hyper_offload.compiler.region_plan import plan_graphs
from hyper_offload.passes import check_schedule, predict_timeline
from hyper_offload.passes.fx.cost_model import DeviceThroughput
from hyper_offload.passes.ir.schedule import ActionKind
from hyper_offload.passes.plan.step import (
    BetweenRegions, Invocation, RegionFloor, StepEvent, StepEventKind, StepTimeline,
    lay_out_step, plan_step,
)
from hyper_offload.runtime.device import TransferBandwidth

GPU = DeviceThroughput(flops_per_s=400e12, bytes_per_s=3e12)
F, B = StepEventKind.FORWARD, StepEventKind.BACKWARD


@pytest.fixture(scope="module")
def graphs():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from llama_model import LLAMA_7B, Llama

    config = replace(LLAMA_7B, layers=2, dim=128, heads=4, kv_heads=2, hidden=344, vocab=512)
    with torch.device("meta"):
        model = Llama(config).to(torch.bfloat16)
    tokens = torch.empty(1, 256, dtype=torch.int64, device="meta")
    return capture_graphs(model, (tokens, tokens), device="cpu", inner_compiler="inductor")


def _plans(graphs, gbps: float, budget: int | None = None):
    link = TransferBandwidth(gbps, gbps, measured=False)
    floor = plan_graphs(graphs.fw, graphs.bw, num_fwd_outputs=graphs.num_fwd_outputs,
                        options=parse_backend_options({}), bandwidth=link, region=0,
                        throughput=GPU, floor=True)
    region = None
    if budget is not None:
        options = parse_backend_options({"max_resident_activation_mb": budget / (1 << 20)})
        region = plan_graphs(graphs.fw, graphs.bw, num_fwd_outputs=graphs.num_fwd_outputs,
                             options=options, bandwidth=link, region=0, throughput=GPU)
    return floor, region


def _floor(plan, lowerable: bool = True) -> RegionFloor:
    """The step model's view of a region planned at its floor."""
    return plan.fx_trace.region_floor(plan.schedule, lowerable=lowerable)


def _timeline(*events: tuple[StepEventKind, int, int]) -> StepTimeline:
    steps = tuple(StepEvent(kind, Invocation(region, ordinal)) for kind, region, ordinal in events)
    return StepTimeline(steps, {e.invocation: 0 for e in steps})


ONE = _timeline((F, 0, 0), (B, 0, 0))


def test_a_step_of_one_region_is_that_regions_trace(graphs):
    floor, _ = _plans(graphs, 50.0)
    region = _floor(floor)
    step = lay_out_step(ONE, {0: region}, tailored=frozenset(ONE.invocations), budget_bytes=12345)
    trace = floor.fx_trace.trace
    assert step.trace.ops == trace.ops
    assert step.trace.storage_sizes == trace.storage_sizes
    assert step.trace.retained == trace.retained
    assert step.movable == region.movable
    assert set(step.earliest_reload.values()) == {floor.fx_trace.num_fw_ops}
    assert set(step.latest_release.values()) == {floor.fx_trace.num_fw_ops - 1}
    # The floor laid out is the region's own schedule: the same bytes at every op.
    assert check_schedule(step.trace, step.floor).resident_bytes == floor.check.resident_bytes


@pytest.mark.parametrize("gbps", (50.0, 25.0))
@pytest.mark.parametrize("fraction", (0.7, 0.5, 0.3))
def test_a_step_of_one_region_moves_and_stalls_no_more_than_the_region_scope(
        graphs, fraction, gbps):
    floor, _ = _plans(graphs, gbps)
    budget = int(fraction * floor.fx_trace.saved_bytes)
    _, region = _plans(graphs, gbps, budget)
    plan = plan_step(ONE, {0: _floor(floor)}, budget)
    timeline = predict_timeline(region.fx_trace.trace, region.schedule, release_waits_for_d2h=True)
    assert plan.moved_bytes <= region.check.bytes_d2h
    assert plan.predicted_stall_s <= timeline.exposed_transfer_s + 1e-12
    assert plan.peak_bytes <= max(budget, plan.floor_peak_bytes)
    assert 0 in plan.schedules  # the region is lowered again with the step's schedule


def test_below_the_floor_the_step_reaches_the_floor_peak_moving_less_than_everything(graphs):
    floor, _ = _plans(graphs, 25.0)
    budget = int(0.3 * floor.fx_trace.saved_bytes)
    plan = plan_step(ONE, {0: _floor(floor)}, budget)
    at_floor = plan_step(ONE, {0: _floor(floor, lowerable=False)}, budget)
    assert budget < at_floor.floor_peak_bytes  # below the floor: no plan meets the budget
    assert plan.peak_bytes == at_floor.floor_peak_bytes  # ... and this one reaches the floor
    everything = sum(s.nbytes for s in _floor(floor).slots)
    assert plan.moved_bytes < everything  # moving less than everything movable


def test_without_a_region_to_lower_again_the_plan_keeps_on_the_floor(graphs):
    floor, _ = _plans(graphs, 50.0)
    budget = int(0.7 * floor.fx_trace.saved_bytes)
    plan = plan_step(ONE, {0: _floor(floor, lowerable=False)}, budget)
    assert not plan.schedules and plan.proposal == "keep"
    assert plan.kept_bytes > 0 and plan.peak_bytes <= budget


def test_a_region_invoked_per_layer_keeps_its_floor_and_the_others_are_cut_around_it(graphs):
    """Region 1 runs twice (one compiled block per layer), region 0 once around them: only
    region 0 gets a schedule of its own, its reloads in its backward and its releases in
    its forward, and the step holds the budget."""
    floor, _ = _plans(graphs, 25.0)
    timeline = _timeline((F, 0, 0), (F, 1, 0), (F, 1, 1), (B, 1, 1), (B, 1, 0), (B, 0, 0))
    budget = int(1.5 * floor.fx_trace.saved_bytes)
    plan = plan_step(timeline, {0: _floor(floor), 1: _floor(floor)}, budget)
    assert set(plan.schedules) == {0}
    baseline = plan_step(timeline, {r: _floor(floor, lowerable=False) for r in (0, 1)}, budget)
    assert plan.peak_bytes <= max(budget, baseline.floor_peak_bytes)
    # chosen because it stalls less than keeping on the floor (predicted)
    assert plan.predicted_stall_s < baseline.predicted_stall_s
    for schedule in plan.schedules.values():
        assert check_schedule(floor.fx_trace.trace.with_budget(budget), schedule).ok
        num_fw = floor.fx_trace.num_fw_ops
        for op, _, action in schedule.actions():
            if action.kind is ActionKind.COPY_H2D:
                assert op >= num_fw
            elif action.kind in (ActionKind.COPY_D2H,):
                assert op < num_fw


def test_the_plan_is_the_same_on_every_call(graphs):
    floor, _ = _plans(graphs, 25.0)
    budget = int(0.5 * floor.fx_trace.saved_bytes)
    plans = [plan_step(ONE, {0: _floor(floor)}, budget) for _ in range(2)]
    assert plans[0] == plans[1]


def test_eager_code_between_regions_is_laid_out_as_one_op_and_one_storage(graphs):
    """Issue 44: a gap's eager peak is an op of the step trace, eager bytes held through
    an event a storage over its ops; the floor and the plan count them, and the step's
    schedule meets the budget there too."""
    from hyper_offload.passes import resident_bytes_without_offload

    floor, _ = _plans(graphs, 50.0)
    gap, held = 3 << 20, 1 << 20  # the loss's peak before the backward; bytes held through it
    timeline = replace(ONE, between=BetweenRegions((0, gap, 0), ("", "nll_loss_backward", ""),
                                                   (gap, 0, 0), (0, held)))
    step = lay_out_step(timeline, {0: _floor(floor)}, budget_bytes=12345)
    trace = floor.fx_trace.trace
    num_fw = floor.fx_trace.num_fw_ops
    assert step.trace.num_ops == trace.num_ops + 1
    eager = step.trace.ops[num_fw]
    assert eager.name == "eager" and step.trace.operand_bytes(num_fw) == gap
    plain = resident_bytes_without_offload(step.trace)
    before = resident_bytes_without_offload(trace)
    assert plain[num_fw + 1:] == [b + held for b in before[num_fw:]]
    plan = plan_step(timeline, {0: _floor(floor, lowerable=False)}, None)
    alone = plan_step(ONE, {0: _floor(floor, lowerable=False)}, None)
    assert plan.floor_op.region is None and plan.floor_op.op == "nll_loss_backward"
    assert plan.regions_floor_bytes == alone.floor_peak_bytes < plan.floor_peak_bytes
    budget = plan.floor_peak_bytes + (1 << 20)
    made = plan_step(timeline, {0: _floor(floor)}, budget)
    assert made.fits and made.peak_bytes <= budget
