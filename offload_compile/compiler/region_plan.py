"""Trace, plan, lower and re-check one region's forward/backward graphs.

The wiring between the pure passes; :mod:`.recompute.search` plans each candidate
partition with :func:`plan_graphs`, and :mod:`.partitioner` lowers the chosen one
with :func:`lower_region`. Planning is the shared pipeline of every
door, :func:`hyper_offload.passes.plan_residency` (plan -> check -> place prefetches ->
check -> delay releases -> check), with ``earliest_prefetch_op`` = the first backward
op (a backward reload cannot start in the forward graph) and releases that wait for their
D2H, delayed at most to the forward's last op. So the eager session and ``hyper-offload plan`` give the same
schedule for the same trace. The lowered graphs are checked again through the schedule
re-derived from them; either failure raises ``ScheduleError`` naming the region and the
step (a bug, never silently ignored).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import NamedTuple

from torch import fx

from hyper_offload.passes import (
    ResidencySchedule,
    ScheduleError,
    ScheduleReport,
    check_schedule,
    predict_timeline,
    required_bytes,
)
from hyper_offload.passes.analysis.predicted_timeline import op_durations
from hyper_offload.passes.fx.cost_model import DeviceThroughput, exposed_transfer_time
from hyper_offload.passes.fx.fx_trace import FxTrace
from hyper_offload.passes.fx.graph_trace import build_fx_trace
from hyper_offload.passes.fx.lowering import lower_schedule
from hyper_offload.passes.fx.lowering_check import check_lowering
from hyper_offload.passes.fx.sizes import SymbolicSize, symbolic_sizes
from hyper_offload.passes.plan.report import FloorPlanner, binding
from hyper_offload.passes.plan.host_budget import host_curve
from hyper_offload.passes.plan.planning import plan_residency
from hyper_offload.runtime.device import TransferBandwidth

from .options import BackendOptions
from .region_report import InfeasibleOpReport, KeptSavedReport, RecomputeReport, RegionReport

__all__ = [
    "GraphPlan",
    "PlannedRegion",
    "build_region_report",
    "kept_saved",
    "lower_region",
    "plan_graphs",
    "plan_with_schedule",
]


class GraphPlan(NamedTuple):
    """:func:`plan_graphs`' answer for one forward/backward pair (graphs untouched).
    ``check`` is ``check_schedule`` of ``schedule``; ``predicted_stall_s`` the timeline
    model's stall of it."""

    fx_trace: FxTrace
    schedule: ResidencySchedule
    check: ScheduleReport
    predicted_stall_s: float
    requested_budget_bytes: int | None = None
    """The device budget asked for, where the host budget kept the plan above it
    (``fx_trace.trace.budget_bytes`` is then the device bytes it reaches); else None."""

    @property
    def compute_s(self) -> float:
        """Predicted compute of every op of both graphs (the timeline model's prices)."""
        return sum(op_durations(self.fx_trace.trace))

    @property
    def step_s(self) -> float:
        """Predicted step time: compute plus the plan's stall."""
        return self.compute_s + self.predicted_stall_s

    @property
    def feasible(self) -> bool:
        """Whether the plan meets the device budget asked for wherever the ops' own
        operands allow: not where the host budget kept bytes on the device."""
        return not self.check.infeasible_ops and self.requested_budget_bytes is None

    @property
    def budget_bytes(self) -> int:
        """The device budget asked for (the trace's, unless the host budget raised it)."""
        requested = self.requested_budget_bytes
        return self.fx_trace.trace.budget_bytes if requested is None else requested

    @property
    def binding(self) -> str:
        """``"host"`` where the host budget kept bytes on the device past the budget,
        ``"device"`` where the device budget made it move bytes, else ``"none"``."""
        return binding(budget_bytes=self.budget_bytes, floor_peak_bytes=0,
                       peak_bytes=self.check.peak_resident_bytes,
                       moved_bytes=self.check.bytes_moved,
                       host_forced=self.requested_budget_bytes is not None)


@dataclass(frozen=True)
class PlannedRegion:
    """Everything decided for one region (kept for reports and tests)."""

    fx_trace: FxTrace
    schedule: ResidencySchedule
    check: ScheduleReport
    lowered_check: ScheduleReport | None
    report: RegionReport


def _require_ok(report: ScheduleReport, what: str, region: int) -> None:
    if report.violations:
        try:
            report.raise_if_invalid()
        except ScheduleError as error:
            raise ScheduleError(f"hyper_offload region {region}: {what}: {error}") from None


def lower_region(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    planned: GraphPlan,
    *,
    num_fwd_outputs: int,
    options: BackendOptions,
    region: int,
    recompute: RecomputeReport | None = None,
    search_seconds: float = 0.0,
) -> PlannedRegion:
    """Rewrite ``fw``/``bw`` in place with ``planned`` (their plan, made by the recompute
    search in ``search_seconds``), re-check the lowered graphs and report."""
    started = time.perf_counter() - search_seconds
    fx_trace, schedule, check = planned.fx_trace, planned.schedule, planned.check
    sizes = symbolic_sizes(fw, bw)  # before the lowering adds its nodes
    lowered_check = None
    if check.num_transfers:
        lower_schedule(fw, bw, fx_trace, schedule)
        lowered_check = check_lowering(fw, bw, fx_trace, num_fwd_outputs=num_fwd_outputs)
        _require_ok(lowered_check, "the schedule re-derived from the lowered graphs", region)
    seconds = time.perf_counter() - started
    report = build_region_report(fx_trace, schedule, check, options, region, seconds, recompute,
                                 sizes=sizes, planned=planned)
    return PlannedRegion(fx_trace, schedule, check, lowered_check, report)


def plan_graphs(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    options: BackendOptions,
    bandwidth: TransferBandwidth,
    region: int,
    throughput: DeviceThroughput | None = None,
    budget_bytes: int | None = None,
    floor: bool = False,
    activation_inputs: frozenset[str] = frozenset(),
) -> GraphPlan:
    """The analysis half of a region (graphs untouched; :func:`lower_region` rewrites
    them): trace, then the
    shared pipeline :func:`~hyper_offload.passes.plan_residency` under the budget (no
    reload before the backward graph). ``hyper_offload.estimate`` calls this on graphs
    captured on fake tensors, so its figures are the backend's. ``throughput`` prices
    ops (default: the graphs' device's). ``budget_bytes`` replaces the options' budget
    (the recompute search plans every partition under the one budget the fraction gave
    for torch's default partition). ``floor``: plan at the region's floor instead of with
    the options' planner (the step scope:
    :class:`~hyper_offload.passes.plan.report.FloorPlanner`, the gaps across the
    forward/backward boundary included, reloads hoisted only under the floor's own peak,
    whatever the budget: the step plan keeps slots in the room above it).
    ``activation_inputs``: forward placeholders that may move (``build_fx_trace``). The
    returned report is ``check_schedule`` of the returned schedule, without violations."""
    fx_trace = build_fx_trace(
        fw, bw, num_fwd_outputs=num_fwd_outputs, throughput=throughput,
        d2h_bandwidth_gbps=bandwidth.d2h_gbps, h2d_bandwidth_gbps=bandwidth.h2d_gbps,
        activation_inputs=activation_inputs, outputs_move=floor,
        may_move=options.may_move(region),
    )
    if floor:
        # Reloads are hoisted only into the floor's own valleys (under the most any op of
        # the region needs), never above them: the step plan then has the room between
        # the step's budget and the floor to *keep* slots, which beats prefetching them
        # (no bytes moved). Hoisting under the budget filled that room with early reloads
        # wherever copies are slow next to compute (a GPU), and the step moved 2.3x what
        # the whole model as one region moves (benchmarks/step_budget.py --recompute).
        budget_bytes = max(required_bytes(fx_trace.trace), default=0)
    elif budget_bytes is None:
        budget_bytes = options.budget_bytes(fx_trace.peak_without_offload)
    trace = fx_trace.trace.with_budget(budget_bytes)
    if not floor and options.disk_bandwidth_gbps is not None and not fx_trace.storage_exprs:
        # The disk tier (region scope; a load names its copy's sizes, so concrete ones).
        trace = trace.with_disk(options.config.disk_budget_bytes, options.disk_bandwidth_gbps)
    fx_trace = dataclasses.replace(fx_trace, trace=trace)
    host = None if floor else options.host_budget_bytes
    planned = plan_residency(
        trace,
        FloorPlanner(fx_trace.num_fw_ops, frozenset(fx_trace.movable())) if floor
        else options.config.resolved_planner(host),
        earliest_prefetch_op=fx_trace.num_fw_ops,
        # the lowering's wait_transfer frees a saved activation's device bytes only once
        # its D2H is done, and inside the forward graph
        release_waits_for_d2h=True, latest_release_op=fx_trace.num_fw_ops - 1,
        where=f"hyper_offload region {region}",
        # The floor moves everything: the step plan keeps the host budget (.step_plan).
        host_budget_bytes=host,
    )
    requested = None
    if planned.binding == "host":  # checked (and lowered) under the bytes it reaches
        fx_trace = dataclasses.replace(fx_trace, trace=planned.trace)
        requested = budget_bytes
    return GraphPlan(fx_trace, planned.schedule, planned.check, planned.predicted_stall_s,
                     requested)


def plan_with_schedule(
    floor: GraphPlan, schedule: ResidencySchedule, budget_bytes: int, *, region: int
) -> GraphPlan:
    """``floor``'s region (number ``region``) planned with ``schedule`` (a cut of the
    step's schedule, :mod:`hyper_offload.passes.plan.step`) under ``budget_bytes``: checked on the region's own trace (a
    ``ScheduleError`` when ``check_schedule`` rejects it) and priced on its timeline."""
    trace = floor.fx_trace.trace.with_budget(budget_bytes)
    check = check_schedule(trace, schedule)
    _require_ok(check, "the schedule the step plan made for it", region)
    stall = predict_timeline(trace, schedule, release_waits_for_d2h=True).exposed_transfer_s
    return GraphPlan(dataclasses.replace(floor.fx_trace, trace=trace), schedule, check, stall)


def build_region_report(
    fx_trace: FxTrace,
    schedule: ResidencySchedule,
    check: ScheduleReport,
    options: BackendOptions,
    region: int,
    seconds: float,
    recompute: RecomputeReport | None = None,
    *,
    sizes: tuple[SymbolicSize, ...] = (),
    planned: GraphPlan | None = None,
) -> RegionReport:
    """The region's report; ``planned``: its plan, for the budget it was asked for and
    which budget binds (without: the trace's budget, nothing said of the host)."""
    timing = exposed_transfer_time(fx_trace.trace, schedule)
    host = None if planned is None or options.step_scoped else options.host_budget_bytes
    movable = fx_trace.movable()
    offloaded = tuple(
        saved.name for _, _, a in schedule.actions()
        if a.kind.value == "COPY_D2H" and a.storage in movable for saved in movable[a.storage]
    )
    return RegionReport(
        region=region,
        inner_compiler=options.inner_compiler,
        fw_nodes=fx_trace.num_fw_ops,
        bw_nodes=fx_trace.trace.num_ops - fx_trace.num_fw_ops,
        saved_activation_bytes=fx_trace.saved_bytes,
        budget_bytes=fx_trace.trace.budget_bytes if planned is None else planned.budget_bytes,
        # plain compile's peak: torch's default partition, without offload
        predicted_peak_before=(
            recompute.partitions[0].peak_without_offload
            if recompute is not None and recompute.partitions else fx_trace.peak_without_offload
        ),
        predicted_peak_after=check.peak_resident_bytes,
        bytes_d2h=check.bytes_d2h,
        bytes_h2d=check.bytes_h2d,
        transfers=check.num_transfers,
        offloaded=offloaded,
        d2h_s=timing.d2h_s,
        h2d_s=timing.h2d_s,
        exposed_transfer_s=timing.exposed_s,
        infeasible_ops=tuple(
            InfeasibleOpReport(fx_trace.op_nodes[op.op_index], op.required_bytes, op.excess_bytes)
            for op in check.infeasible_ops
        ),
        plan_seconds=seconds,
        kept=kept_saved(fx_trace),
        recompute=recompute,
        resident=tuple(
            s.name for s in fx_trace.saved if s.storage is not None and s.name not in offloaded
        ),
        sizes=sizes,
        host_budget_bytes=host,
        peak_host_bytes=host_curve(fx_trace.trace, schedule).peak,
        binding="device" if planned is None and check.bytes_moved else (
            "none" if planned is None else planned.binding),
    )


def kept_saved(fx_trace: FxTrace) -> tuple[KeptSavedReport, ...]:
    """Saved activations (not parameters or inputs) that stay on the device, one entry
    per storage, largest first, each with :mod:`hyper_offload.passes.fx.saved`'s reason."""
    sizes = fx_trace.trace.storage_sizes
    kept = [
        KeptSavedReport(tuple(s.name for s in group), sizes[sid], group[0].reason)
        for sid, group in fx_trace.kept().items()
    ]
    return tuple(sorted(kept, key=lambda k: -k.nbytes))
