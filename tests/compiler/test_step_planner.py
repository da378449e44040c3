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
from hyper_offload.compiler.step_model import Invocation, StepEvent, StepEventKind, StepTimeline
from hyper_offload.compiler.step_plan import plan_step
from hyper_offload.compiler.step_planner import plan_step_schedules, region_floor_profile
from hyper_offload.compiler.step_timeline import RegionFloor, predicted_step_stall
from hyper_offload.compiler.step_trace import build_step_trace, region_trace
from hyper_offload.passes import check_schedule, predict_timeline
from hyper_offload.passes.fx.cost_model import DeviceThroughput
from hyper_offload.passes.ir.schedule import ActionKind
from hyper_offload.runtime.bandwidth import TransferBandwidth

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


def _timeline(*events: tuple[StepEventKind, int, int]) -> StepTimeline:
    steps = tuple(StepEvent(kind, Invocation(region, ordinal)) for kind, region, ordinal in events)
    return StepTimeline(steps, {e.invocation: 0 for e in steps})


ONE = _timeline((F, 0, 0), (B, 0, 0))


def test_a_step_of_one_region_is_that_regions_trace(graphs):
    floor, _ = _plans(graphs, 50.0)
    region = region_trace(floor.fx_trace, floor.schedule)
    step = build_step_trace(ONE, {0: region}, frozenset(ONE.invocations), 12345)
    trace = floor.fx_trace.trace
    assert step.trace.ops == trace.ops
    assert step.trace.storage_sizes == trace.storage_sizes
    assert step.trace.retained == trace.retained
    assert step.movable == region.movable
    assert set(step.earliest_reload.values()) == {floor.fx_trace.num_fw_ops}
    assert set(step.latest_release.values()) == {floor.fx_trace.num_fw_ops - 1}


@pytest.mark.parametrize("gbps", (50.0, 25.0))
@pytest.mark.parametrize("fraction", (0.7, 0.5, 0.3))
def test_a_step_of_one_region_moves_and_stalls_no_more_than_the_region_scope(
        graphs, fraction, gbps):
    floor, _ = _plans(graphs, gbps)
    budget = int(fraction * floor.fx_trace.saved_bytes)
    _, region = _plans(graphs, gbps, budget)
    plan = plan_step_schedules(ONE, {0: region_trace(floor.fx_trace, floor.schedule)},
                               {0: floor.check.resident_bytes}, budget, tailor=frozenset({0}))
    timeline = predict_timeline(region.fx_trace.trace, region.schedule, release_waits_for_d2h=True)
    assert plan.moved_bytes <= region.check.bytes_d2h
    assert plan.predicted_stall_s <= timeline.exposed_transfer_s + 1e-12
    assert plan.peak_bytes <= max(budget, plan.floor_peak_bytes)
    assert 0 in plan.schedules  # the region is lowered again with the step's schedule


def test_below_the_floor_the_step_reaches_the_floor_peak_moving_less_than_everything(graphs):
    floor, _ = _plans(graphs, 25.0)
    budget = int(0.3 * floor.fx_trace.saved_bytes)
    region = region_trace(floor.fx_trace, floor.schedule)
    plan = plan_step_schedules(ONE, {0: region}, {0: floor.check.resident_bytes}, budget,
                               tailor=frozenset({0}))
    at_floor = plan_step(ONE, {0: region_floor_profile(0, region, floor.check.resident_bytes)},
                         budget)
    assert budget < at_floor.floor_peak_bytes  # below the floor: no plan meets the budget
    assert plan.peak_bytes == at_floor.floor_peak_bytes  # ... and this one reaches the floor
    assert plan.moved_bytes < at_floor.moved_bytes  # moving less than everything movable


def test_without_a_region_to_lower_again_the_plan_keeps_on_the_floor(graphs):
    floor, _ = _plans(graphs, 50.0)
    budget = int(0.7 * floor.fx_trace.saved_bytes)
    region = region_trace(floor.fx_trace, floor.schedule)
    resident = floor.check.resident_bytes
    plan = plan_step_schedules(ONE, {0: region}, {0: resident}, budget)
    assert not plan.schedules
    assert plan.keep_for(Invocation(0, 0)) == plan_step(
        ONE, {0: region_floor_profile(0, region, resident)}, budget).keep_for(Invocation(0, 0))


def test_a_region_invoked_per_layer_keeps_its_floor_and_the_others_are_cut_around_it(graphs):
    """Region 1 runs twice (one compiled block per layer), region 0 once around them: only
    region 0 gets a schedule of its own, its reloads in its backward and its releases in
    its forward, and the step holds the budget on the profiles the backend lays out."""
    floor, _ = _plans(graphs, 25.0)
    region = region_trace(floor.fx_trace, floor.schedule)
    resident = floor.check.resident_bytes
    timeline = _timeline((F, 0, 0), (F, 1, 0), (F, 1, 1), (B, 1, 1), (B, 1, 0), (B, 0, 0))
    budget = int(1.5 * floor.fx_trace.saved_bytes)
    plan = plan_step_schedules(timeline, {0: region, 1: region}, {0: resident, 1: resident},
                               budget, tailor=frozenset({0, 1}))
    assert set(plan.schedules) == {0}
    baseline = plan_step(timeline, {r: region_floor_profile(r, region, resident) for r in (0, 1)},
                         budget)
    assert plan.peak_bytes <= max(budget, baseline.floor_peak_bytes)
    floors = {r: RegionFloor(region.trace, region.floor, region.num_fw_ops) for r in (0, 1)}
    # chosen because it stalls less than keeping on the floor (predicted)
    assert plan.predicted_stall_s < predicted_step_stall(timeline, floors, baseline.keep_for)
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
    region = region_trace(floor.fx_trace, floor.schedule)
    budget = int(0.5 * floor.fx_trace.saved_bytes)
    plans = [plan_step_schedules(ONE, {0: region}, {0: floor.check.resident_bytes}, budget,
                                 tailor=frozenset({0})) for _ in range(2)]
    assert plans[0] == plans[1]


def test_eager_code_between_regions_is_laid_out_as_the_step_plan_counts_it(graphs):
    """Issue 44: a gap's eager peak is an op of the step trace, eager bytes held through
    an event a storage over its ops; ``plan_step`` and the step trace count them alike,
    and the step's schedule meets the budget there too."""
    from hyper_offload.compiler.step_model import BetweenRegions
    from hyper_offload.passes import resident_bytes_without_offload

    floor, _ = _plans(graphs, 50.0)
    region = region_trace(floor.fx_trace, floor.schedule)
    gap, held = 3 << 20, 1 << 20  # the loss's peak before the backward; bytes held through it
    timeline = replace(ONE, between=BetweenRegions((0, gap, 0), ("", "nll_loss_backward", ""),
                                                   (gap, 0, 0), (0, held)))
    step = build_step_trace(timeline, {0: region}, frozenset(ONE.invocations), 12345)
    trace = floor.fx_trace.trace
    assert step.trace.num_ops == trace.num_ops + 1
    eager = step.trace.ops[floor.fx_trace.num_fw_ops]
    assert eager.name == "eager" and step.trace.operand_bytes(floor.fx_trace.num_fw_ops) == gap
    plain = resident_bytes_without_offload(step.trace)
    before = resident_bytes_without_offload(trace)
    assert plain[floor.fx_trace.num_fw_ops + 1:] == [b + held for b in before[floor.fx_trace.num_fw_ops:]]
    profiles = {0: region_floor_profile(0, region, floor.check.resident_bytes)}
    plan = plan_step(timeline, profiles, None)
    alone = plan_step(ONE, profiles, None)
    assert plan.floor_op.region is None and plan.floor_op.op == "nll_loss_backward"
    assert plan.regions_floor_bytes == alone.floor_peak_bytes < plan.floor_peak_bytes
    budget = plan.floor_peak_bytes + (1 << 20)
    made = plan_step_schedules(timeline, {0: region}, {0: floor.check.resident_bytes}, budget,
                               tailor=frozenset({0}))
    assert made.fits and made.peak_bytes <= budget
