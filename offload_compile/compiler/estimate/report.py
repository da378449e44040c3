"""What :func:`~.fit.estimate` returns: :class:`EstimateReport`, its figures in
either scope, and how it reads (``summary()``, ``to_dict()``, ``to_json()``).

The report wraps the backend's own report of the same model (a :class:`StepReport`
under ``budget_scope="step"``, a :class:`RegionReport` under ``"region"``), so estimate
and backend never disagree; the properties read the same figures in both scopes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from hyper_offload.errors import ReportScopeError
from hyper_offload.passes.fx.fx_trace import FloorDetail
from hyper_offload.passes.plan.step import FloorOp

from ..region_report import RegionReport
from ..step_report import StepReport, explain_floor

__all__ = ["EstimateReport"]

MIB = 1 << 20


@dataclass(frozen=True)
class EstimateReport:
    """What a step needs and what the plan does to it (bytes, seconds).

    Exactly one of ``step`` (``budget_scope="step"``) and ``region_report``
    (``"region"``) is set, and the figures below are its: the backend's
    :class:`StepReport` or :class:`RegionReport` for the same model, so estimate and
    backend never disagree. The properties (``fits``, ``peak_with_plan``, ``bytes_d2h``,
    ...) mean the same in both scopes: code that reads them works in either.
    Invariants: ``peak_with_plan <= peak_without_offload`` under the region scope (under
    the step scope a slot kept at run time is a device copy that coexists with its source
    from the copy to the floor's release, so a plan keeping everything peaks above the
    step without offload; the latter depends on no link); ``fits`` (the plan meets
    ``budget_bytes`` at every op) iff ``budget_bytes >= min_feasible_budget_bytes``
    (under the step scope that is the floor's peak: everything movable moved).
    """

    model: str
    device: str
    inner_compiler: str
    region_report: RegionReport | None
    """Region scope: the plan of the model as one region (None under the step scope)."""
    min_feasible_budget_bytes: int
    d2h_bandwidth_gbps: float
    h2d_bandwidth_gbps: float
    flops_per_s: float
    memory_bytes_per_s: float
    trace_seconds: float
    stall_lower_bound_s: float | None = None
    """Region scope: no schedule under this budget is predicted to stall compute less
    (:func:`~hyper_offload.passes.analysis.liveness.stall_lower_bound`, the compile
    door's rules): how far ``exposed_transfer_s`` is from the best any plan could do.
    None under the step scope (the bound is per region)."""
    step: StepReport | None = None
    """Step scope: the step plan the backend makes after the first step."""
    region_floor_op: FloorOp | None = None
    """Region scope: the op whose own need is ``min_feasible_budget_bytes``."""
    regions: tuple[RegionReport, ...] = ()
    """Step scope: the region reports of every region the step compiled (at the floor)."""
    step_compute_s: float | None = None
    """Step scope: the step's predicted compute (every op of every invocation,
    recomputation included, at ``flops_per_s`` / ``memory_bytes_per_s``): what
    ``exposed_transfer_s`` is a share of. None under the region scope."""
    layout: str = "as given"
    """How the step scope compiled the model: ``"as given"`` (as its owner did), or its
    run of identical blocks compiled per block (:mod:`.step_scope`, ``layout=``)."""
    floor_detail: FloorDetail | None = None
    """Step scope, where a region's op sets the floor: that op's own operands and the
    largest other values on the device there, each named and said how it got there
    (:func:`~hyper_offload.passes.fx.fx_trace.floor_detail`). None for eager code or no floor."""

    @property
    def region(self) -> RegionReport:
        """The region scope's :class:`RegionReport`, as before the step scope became the
        default. A step-scoped estimate has no single-region plan (its regions' reports
        are their floors, not the plan under the budget), so this raises
        :class:`~hyper_offload.ReportScopeError` (an ``AttributeError``) naming what to
        read instead, rather than handing out other figures under the old name."""
        if self.region_report is None:
            raise ReportScopeError(
                "EstimateReport.region: this estimate is step-scoped (budget_scope='step', "
                "the default), which plans the whole step, not one region under the whole "
                "budget. Read the figures every scope has (report.fits, peak_with_plan, "
                "peak_without_offload, bytes_d2h, bytes_h2d, exposed_transfer_s, "
                "min_feasible_budget_bytes), the step plan (report.step) and each "
                "region's floor report (report.regions); or pass budget_scope='region' for "
                "the single-region report"
            )
        return self.region_report

    @property
    def budget_scope(self) -> str:
        return "step" if self.step is not None else "region"

    @property
    def budget_bytes(self) -> int:
        return self.step.budget_bytes if self.step is not None else self._region.budget_bytes

    @property
    def peak_without_offload(self) -> int:
        if self.step is not None:
            return self.step.peak_without_offload_bytes
        return self._region.predicted_peak_before

    @property
    def peak_with_plan(self) -> int:
        return self.step.peak_bytes if self.step is not None else self._region.predicted_peak_after

    @property
    def bytes_d2h(self) -> int:
        return self.step.moved_bytes if self.step is not None else self._region.bytes_d2h

    @property
    def bytes_h2d(self) -> int:
        return self.step.moved_bytes if self.step is not None else self._region.bytes_h2d

    @property
    def exposed_transfer_s(self) -> float:
        if self.step is not None:
            return self.step.predicted_stall_s
        return self._region.exposed_transfer_s

    @property
    def floor_op(self) -> FloorOp | None:
        """The op that sets ``min_feasible_budget_bytes`` (its name, where it runs, its own
        operands' bytes): under the step scope the step plan's, eager code between
        regions included."""
        return self.step.floor_op if self.step is not None else self.region_floor_op

    @property
    def floor_explained(self) -> str:
        """What sets the floor, its bytes, and what lowers it (one line)."""
        return explain_floor(self.floor_op, self.min_feasible_budget_bytes)

    @property
    def fits(self) -> bool:
        """True when the plan keeps every op at or under the budget."""
        return self.step.fits if self.step is not None else self._region.feasible

    @property
    def _region(self) -> RegionReport:
        assert self.region_report is not None, "an EstimateReport holds a step or a region"
        return self.region_report

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items()
                if k not in ("region_report", "step", "regions", "floor_detail")}
        data.update(
            budget_scope=self.budget_scope,
            budget_bytes=self.budget_bytes,
            peak_without_offload_bytes=self.peak_without_offload,
            peak_with_plan_bytes=self.peak_with_plan,
            fits=self.fits,
            bytes_d2h=self.bytes_d2h,
            bytes_h2d=self.bytes_h2d,
            exposed_transfer_s=self.exposed_transfer_s,
            floor_op=None if self.floor_op is None else self.floor_op.op,
            floor_op_bytes=None if self.floor_op is None else self.floor_op.op_bytes,
            floor_explained=self.floor_explained,
            floor_detail=None if self.floor_detail is None else self.floor_detail.describe(),
            floor_operand_bytes=None if self.floor_detail is None
            else self.floor_detail.operand_bytes,
        )
        data.pop("region_floor_op", None)
        if self.step is not None:
            data.update(_step_dict(self.step, self.regions))
            data["tiling"] = [dict(r.tiling.summary(), region=r.region)
                              for r in self.regions if r.tiling is not None]
        else:
            data.update(_region_dict(self._region))
        return data

    def to_json(self) -> str:
        """One JSON object (bytes and seconds as numbers)."""
        return json.dumps(self.to_dict())

    def summary(self) -> str:
        """A few readable lines, the verdict first."""
        verdict = "fits" if self.fits else "DOES NOT FIT"
        prices = (
            f"ops priced at {self.flops_per_s / 1e12:g} TFLOP/s, "
            f"{self.memory_bytes_per_s / 1e9:g} GB/s"
        )
        if self.step is not None:
            return _step_summary(self, verdict, prices)
        return _region_summary(self, verdict, prices)

    def __str__(self) -> str:
        return self.summary()


def _region_dict(r: RegionReport) -> dict[str, Any]:
    return dict(
        fw_ops=r.fw_nodes,
        bw_ops=r.bw_nodes,
        saved_activation_bytes=r.saved_activation_bytes,
        transfers=r.transfers,
        d2h_s=r.d2h_s,
        h2d_s=r.h2d_s,
        infeasible_ops=len(r.infeasible_ops),
        kept_saved_bytes=r.kept_bytes,
        plan_seconds=r.plan_seconds,
        recompute=None if r.recompute is None else r.recompute.summary(),
    )


def _step_dict(step: StepReport, regions: tuple[RegionReport, ...]) -> dict[str, Any]:
    return dict(
        step=step.summary(),
        regions=len(regions),
        fw_ops=sum(r.fw_nodes for r in regions),
        bw_ops=sum(r.bw_nodes for r in regions),
        saved_activation_bytes=sum(
            r.saved_activation_bytes * _count(step, r.region) for r in regions
        ),
        kept_saved_bytes=step.kept_bytes,
        plan_seconds=sum(r.plan_seconds for r in regions),
        invocations=[
            {"region": p.invocation.region, "ordinal": p.invocation.ordinal,
             "kept_bytes": p.kept_bytes, "moved_bytes": p.moved_bytes,
             "retained_bytes": p.retained_bytes}
            for p in step.invocations
        ],
    )


def _count(step: StepReport, region: int) -> int:
    """How many times the step invoked ``region``."""
    return sum(p.invocation.region == region for p in step.invocations)


def _region_summary(report: EstimateReport, verdict: str, prices: str) -> str:
    r = report._region
    lines = [
        f"{report.model} on {report.device} ({report.inner_compiler} graphs, {r.fw_nodes}+"
        f"{r.bw_nodes} ops, one region): {verdict} in a budget of {_mib(report.budget_bytes)}",
        f"peak activations: {_mib(report.peak_without_offload)} without offload -> "
        f"{_mib(report.peak_with_plan)} with the plan "
        f"(saved for backward: {_mib(r.saved_activation_bytes)})",
        f"smallest feasible budget: {_mib(report.min_feasible_budget_bytes)}, set by "
        f"{report.floor_explained}",
        f"moved per step: D2H {_mib(r.bytes_d2h)}, H2D {_mib(r.bytes_h2d)} "
        f"({r.transfers} transfers)",
        f"transfer time at {report.d2h_bandwidth_gbps:g}/{report.h2d_bandwidth_gbps:g} GB/s "
        f"(D2H/H2D): {r.d2h_s * 1e3:.1f} + {r.h2d_s * 1e3:.1f} ms, predicted exposed "
        f"{r.exposed_transfer_s * 1e3:.1f} ms, no plan under "
        f"{(report.stall_lower_bound_s or 0.0) * 1e3:.1f} ms ({prices})",
        f"traced in {report.trace_seconds:.1f} s, planned in {r.plan_seconds:.1f} s",
    ]
    if r.kept:
        worst = r.kept[0]
        lines.insert(3, (
            f"saved activations that cannot move: {_mib(r.kept_bytes)} in {len(r.kept)} "
            f"storage(s), largest {_mib(worst.nbytes)} ({worst.names[0]}: {worst.reason})"
        ))
    if r.recompute is not None:
        placed = f"{len(r.resident)} saved tensor(s) kept, {len(r.offloaded)} moved"
        lines.insert(-1, r.recompute.describe(placed))
    if not report.fits:
        lines.append(
            f"raise the budget to at least {_mib(report.min_feasible_budget_bytes)}: "
            f"{len(r.infeasible_ops)} op(s) need more than the budget on their own"
        )
    lines += _host_lines(r.binding, r.peak_host_bytes, r.host_budget_bytes)
    return "\n".join(lines)


def _step_summary(report: EstimateReport, verdict: str, prices: str) -> str:
    step, regions = report.step, report.regions
    assert step is not None
    lines = [
        f"{report.model} on {report.device} ({report.inner_compiler} graphs, "
        f"{len(regions)} region(s), {len(step.invocations)} invocation(s) per step): "
        f"{verdict} in a budget of {_mib(report.budget_bytes)}",
        f"compiled {report.layout}" + ("" if report.layout == "as given" else
                                       " (layout='as_given' plans the model as one graph)"),
        f"peak activations: {_mib(report.peak_without_offload)} without offload -> "
        f"{_mib(report.peak_with_plan)} with the step plan",
        f"smallest feasible budget: {_mib(report.min_feasible_budget_bytes)} (the floor: "
        "everything movable moved" + (
            f"; the compiled regions alone: {_mib(step.regions_floor_bytes)}"
            if step.regions_floor_bytes is not None else "") + ")",
        f"moved per step: {_mib(step.moved_bytes)} each way, kept on the device "
        f"{_mib(step.kept_bytes)}",
        f"predicted stall at {report.d2h_bandwidth_gbps:g}/{report.h2d_bandwidth_gbps:g} "
        f"GB/s (D2H/H2D): {step.predicted_stall_s * 1e3:.1f} ms ({prices})",
        f"traced and planned in {report.trace_seconds:.1f} s",
        *str(step).splitlines()[1:],
        *(f"region {r.region}: {r.tiling}" for r in regions if r.tiling is not None),
    ]
    if report.floor_detail is not None:
        lines.append(f"at the floor: {report.floor_detail.describe()}")
    if not report.fits:
        lines.append(
            f"raise the budget to at least {_mib(report.min_feasible_budget_bytes)}: with "
            "everything movable moved (and, under recompute='auto', the step's regions "
            "re-lowered with recompute), a region's working memory and what the rest of "
            "the step holds there are over the budget"
        )
    lines += _host_lines(step.binding, step.peak_host_bytes, step.host_budget_bytes)
    return "\n".join(lines)


def _host_lines(binding: str, peak_host: int, host_budget: int | None) -> list[str]:
    """The host budget's line, and its fix where it binds."""
    if host_budget is None:
        return []
    lines = [f"host: {_mib(peak_host)} held at once of a host budget of {_mib(host_budget)} "
             f"per rank; binding: {binding}"]
    if binding in ("host", "both"):
        lines.append(
            "the host budget keeps bytes on the device past the device budget: raise "
            "--host-budget-mb (max_host_activation_mb; fewer ranks per node: "
            "--local-world-size) or let recompute='auto' (the default) recompute them"
        )
    return lines


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:,.1f} MiB"
