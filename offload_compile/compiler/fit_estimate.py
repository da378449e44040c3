"""``hyper_offload.estimate``: will a training step fit, before any memory is spent?

    report = hyper_offload.estimate(model, (tokens,), budget=8192)        # MiB
    report = hyper_offload.estimate(model, (tokens,), max_resident_activation_fraction=0.5)
    print(report.summary())

The step (forward + backward of ``model(*example_inputs)``) is traced on fake tensors
(:mod:`.fake_capture`: AOTAutograd on the whole module, no Dynamo, the stock min-cut
partition the compile backend uses), then planned, checked and hoisted by the compile
backend's own analysis (:func:`.region_plan.plan_graphs`). So the figures are exactly
what ``torch.compile(model, backend="hyper_offload")`` would predict for the model as one
region, and nothing is allocated: the model may live on the meta device and be far
larger than the machine's memory.

Figures are for saved activations and the temporaries of the step as the compile
backend counts them (parameters, inputs, gradients and optimizer state excluded; see
docs/architecture.md "Compile path", "What counts").
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from hyper_offload.passes import required_bytes
from hyper_offload.passes.analysis.stall_bound import stall_lower_bound
from hyper_offload.passes.fx.cost_model import DeviceThroughput, throughput_for
from hyper_offload.runtime.bandwidth import DEFAULT_TRANSFER_BANDWIDTH, TransferBandwidth

from .fake_capture import StockPartition, capture_graphs, resolve_trace_device
from .options import BackendOptions, parse_backend_options
from .recompute_search import PartitionChoice, search_region
from .region_plan import build_region_report
from .region_report import RegionReport

__all__ = ["EstimateReport", "estimate"]

MIB = 1 << 20


@dataclass(frozen=True)
class EstimateReport:
    """What a step needs and what the plan does to it (bytes, seconds).

    Invariants: ``peak_with_plan <= peak_without_offload``; ``fits`` (the plan meets
    ``budget_bytes`` at every op) iff ``budget_bytes >= min_feasible_budget_bytes``;
    ``region`` is the compile backend's
    :class:`RegionReport` for the same graphs, so the two never disagree.
    """

    model: str
    device: str
    inner_compiler: str
    region: RegionReport
    min_feasible_budget_bytes: int
    d2h_bandwidth_gbps: float
    h2d_bandwidth_gbps: float
    flops_per_s: float
    memory_bytes_per_s: float
    trace_seconds: float
    stall_lower_bound_s: float = 0.0
    """No schedule under this budget is predicted to stall compute less
    (:func:`~hyper_offload.passes.analysis.stall_bound.stall_lower_bound`, the compile
    door's rules): how far ``exposed_transfer_s`` is from the best any plan could do."""

    @property
    def budget_bytes(self) -> int:
        return self.region.budget_bytes

    @property
    def peak_without_offload(self) -> int:
        return self.region.predicted_peak_before

    @property
    def peak_with_plan(self) -> int:
        return self.region.predicted_peak_after

    @property
    def bytes_d2h(self) -> int:
        return self.region.bytes_d2h

    @property
    def bytes_h2d(self) -> int:
        return self.region.bytes_h2d

    @property
    def exposed_transfer_s(self) -> float:
        return self.region.exposed_transfer_s

    @property
    def fits(self) -> bool:
        """True when the plan keeps every op at or under the budget."""
        return self.region.feasible

    def to_dict(self) -> dict[str, Any]:
        r = self.region
        data = {k: v for k, v in asdict(self).items() if k != "region"}
        data.update(
            budget_bytes=self.budget_bytes,
            peak_without_offload_bytes=self.peak_without_offload,
            peak_with_plan_bytes=self.peak_with_plan,
            fits=self.fits,
            fw_ops=self.region.fw_nodes,
            bw_ops=self.region.bw_nodes,
            saved_activation_bytes=self.region.saved_activation_bytes,
            bytes_d2h=self.bytes_d2h,
            bytes_h2d=self.bytes_h2d,
            transfers=self.region.transfers,
            d2h_s=self.region.d2h_s,
            h2d_s=self.region.h2d_s,
            exposed_transfer_s=self.exposed_transfer_s,
            infeasible_ops=len(self.region.infeasible_ops),
            kept_saved_bytes=self.region.kept_bytes,
            plan_seconds=self.region.plan_seconds,
            stall_lower_bound_s=self.stall_lower_bound_s,
            recompute=None if r.recompute is None else r.recompute.summary(),
        )
        return data

    def to_json(self) -> str:
        """One JSON object (bytes and seconds as numbers)."""
        return json.dumps(self.to_dict())

    def summary(self) -> str:
        """A few readable lines, the verdict first."""
        r = self.region
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines = [
            f"{self.model} on {self.device} ({self.inner_compiler} graphs, {r.fw_nodes}+"
            f"{r.bw_nodes} ops): {verdict} in a budget of {_mib(self.budget_bytes)}",
            f"peak activations: {_mib(self.peak_without_offload)} without offload -> "
            f"{_mib(self.peak_with_plan)} with the plan "
            f"(saved for backward: {_mib(r.saved_activation_bytes)})",
            f"smallest feasible budget: {_mib(self.min_feasible_budget_bytes)}",
            f"moved per step: D2H {_mib(r.bytes_d2h)}, H2D {_mib(r.bytes_h2d)} "
            f"({r.transfers} transfers)",
            f"transfer time at {self.d2h_bandwidth_gbps:g}/{self.h2d_bandwidth_gbps:g} GB/s "
            f"(D2H/H2D): {r.d2h_s * 1e3:.1f} + {r.h2d_s * 1e3:.1f} ms, predicted exposed "
            f"{r.exposed_transfer_s * 1e3:.1f} ms, no plan under {self.stall_lower_bound_s * 1e3:.1f} "
            f"ms (ops priced at {self.flops_per_s / 1e12:g} TFLOP/s, "
            f"{self.memory_bytes_per_s / 1e9:g} GB/s)",
            f"traced in {self.trace_seconds:.1f} s, planned in {r.plan_seconds:.1f} s",
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
        if not self.fits:
            lines.append(
                f"raise the budget to at least {_mib(self.min_feasible_budget_bytes)}: "
                f"{len(r.infeasible_ops)} op(s) need more than the budget on their own"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:,.1f} MiB"


def _bandwidth(value: TransferBandwidth | float | None) -> TransferBandwidth:
    if value is None:
        return DEFAULT_TRANSFER_BANDWIDTH
    if isinstance(value, TransferBandwidth):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(
            f"hyper_offload.estimate: bandwidth must be a TransferBandwidth or a finite "
            f"number of GB/s > 0, got {value!r}"
        )
    return TransferBandwidth(float(value), float(value), measured=False)


def estimate(
    model: nn.Module,
    example_inputs: Sequence[Any],
    budget: float | None = None,
    *,
    device: torch.device | str | None = None,
    bandwidth: TransferBandwidth | float | None = None,
    throughput: DeviceThroughput | None = None,
    **options: Any,
) -> EstimateReport:
    """Trace, plan and report one training step of ``model(*example_inputs)``.

    ``budget`` is the device budget in MiB (``max_resident_activation_mb``); the other
    keys of the compile backend's ``options=`` are accepted and validated the same way
    (``max_resident_activation_fraction`` for a fraction of the peak, ``planner``,
    ``inner_compiler`` = which graphs to model, default ``"inductor"``).
    ``device``: the device the step is traced on (its kernels decide what is saved);
    default the parameters' device, for a meta model the current accelerator or CPU.
    ``bandwidth`` (GB/s each way, or a :class:`TransferBandwidth`) prices the copies,
    default ``DEFAULT_TRANSFER_BANDWIDTH``; ``throughput`` prices the ops (default the
    roofline of ``device``). Inputs may be real, meta or fake tensors; only their
    shapes, dtypes and strides are used. Nothing is allocated and the model is not
    modified.
    """
    if budget is not None:
        if "max_resident_activation_mb" in options:
            raise ValueError(
                "hyper_offload.estimate: budget and max_resident_activation_mb are the same "
                "option; pass only one of them"
            )
        options["max_resident_activation_mb"] = budget
    parsed = parse_backend_options(options)
    link = _bandwidth(bandwidth)
    target = resolve_trace_device(model, device)
    prices = throughput or throughput_for(target)
    choice, plan_seconds, trace_seconds = _capture_and_search(
        model, example_inputs, target, parsed, link, prices
    )
    fx_trace, schedule, check, _ = choice.plan
    report = build_region_report(
        fx_trace, schedule, check, parsed, 0, plan_seconds, choice.report
    )
    return EstimateReport(
        model=type(model).__name__,
        device=str(target),
        inner_compiler=parsed.inner_compiler,
        region=report,
        min_feasible_budget_bytes=max(required_bytes(fx_trace.trace), default=0),
        d2h_bandwidth_gbps=link.d2h_gbps,
        h2d_bandwidth_gbps=link.h2d_gbps,
        flops_per_s=prices.flops_per_s,
        memory_bytes_per_s=prices.bytes_per_s,
        trace_seconds=trace_seconds,
        stall_lower_bound_s=stall_lower_bound(
            fx_trace.trace, earliest_prefetch_op=fx_trace.num_fw_ops,
            latest_release_op=fx_trace.num_fw_ops - 1,
        ).stall_s,
    )


def _capture_and_search(
    model: nn.Module,
    example_inputs: Sequence[Any],
    device: torch.device,
    options: BackendOptions,
    link: TransferBandwidth,
    prices: DeviceThroughput,
) -> tuple[PartitionChoice, float, float]:
    """Capture the step and run the backend's recompute search inside the capture's
    partitioner: the choice, the seconds it took, and the seconds of tracing."""
    searched: list[tuple[PartitionChoice, float]] = []

    def search(
        joint: torch.fx.GraphModule, stock: StockPartition, num_fwd_outputs: int
    ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        begun = time.perf_counter()
        choice = search_region(
            joint, stock, num_fwd_outputs=num_fwd_outputs, options=options,
            bandwidth=lambda _fw: link, region=0, throughput=prices,
        )
        searched.append((choice, time.perf_counter() - begun))
        return choice.fw, choice.bw

    from torch._inductor import config as inductor_config

    started = time.perf_counter()
    with inductor_config.patch(options.inductor_patches()):  # the backend's Inductor mode
        capture_graphs(
            model, example_inputs, device=device, inner_compiler=options.inner_compiler,
            partition=search,
        )
    ((choice, plan_seconds),) = searched
    return choice, plan_seconds, time.perf_counter() - started - plan_seconds
