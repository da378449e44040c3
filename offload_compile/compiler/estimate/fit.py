"""``hyper_offload.estimate``: will a training step fit, before any memory is spent?

    report = hyper_offload.estimate(model, (tokens,), budget=8192)        # MiB
    report = hyper_offload.estimate(model, (tokens,), max_resident_activation_fraction=0.5)
    print(report.summary())

Nothing is allocated: the model may live on the meta device and be far larger than the
machine's memory. Two scopes, as the backend's ``budget_scope``:

* ``"step"`` (the default, as the backend's): one step runs on fake tensors through the
  compile backend itself (:mod:`.step_scope`): Dynamo splits it into the regions a
  real compile makes (graph breaks; blocks the model compiled on their own stay so, one
  compiled block invoked per layer), each region is planned at its floor, and the step
  plan is :func:`hyper_offload.passes.plan.step.plan_step`'s. ``report.step`` is exactly the backend's
  ``step_report`` after a real first step, ``report.regions`` its region reports.
* ``"region"``: the model as one region (:mod:`..fake_capture`: AOTAutograd on the whole
  module, no Dynamo, the stock min-cut partition the backend uses), planned, checked and
  hoisted by the backend's own analysis (:func:`..region_plan.plan_graphs`) under the
  whole budget, with the recompute search: ``report.region`` is what the backend reports
  for the model compiled whole under ``budget_scope="region"``.

Figures are for saved activations and the temporaries of the step as the compile
backend counts them (parameters, inputs, gradients and optimizer state excluded; see
docs/architecture.md "Compile path", "What counts"), and under the step scope the eager
code between compiled regions too (an LM head and loss outside per-block compiled
blocks, :mod:`..step.meter`), which a real step measures the same way. ``floor_op`` names
the op that sets the floor and ``floor_explained`` what lowers it. The report and how it
reads: :mod:`.report`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hyper_offload import progress
from hyper_offload.errors import ConfigurationError
from hyper_offload.passes import required_bytes
from hyper_offload.passes.analysis.liveness import stall_lower_bound
from hyper_offload.passes.fx.cost_model import DeviceThroughput, throughput_for
from hyper_offload.passes.fx.sizes import symbolic_sizes
from hyper_offload.passes.plan.step import FloorOp
from hyper_offload.runtime.device import DEFAULT_TRANSFER_BANDWIDTH, TransferBandwidth

from .report import EstimateReport
from ..fake_capture import StockPartition, capture_graphs, resolve_trace_device
from ..options import BackendOptions, parse_backend_options
from ..recompute.search import PartitionChoice, search_region
from ..region_plan import build_region_report

__all__ = ["estimate"]


def _bandwidth(value: TransferBandwidth | float | None) -> TransferBandwidth:
    if value is None:
        return DEFAULT_TRANSFER_BANDWIDTH
    if isinstance(value, TransferBandwidth):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigurationError(
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
    layout: str = "auto",
    **options: Any,
) -> EstimateReport:
    """Trace, plan and report one training step of ``model(*example_inputs)``.

    ``budget`` is the device budget in MiB (``max_resident_activation_mb``); the other
    keys of the compile backend's ``options=`` are accepted and validated the same way
    (``max_resident_activation_fraction`` for a fraction of the peak, ``planner``,
    ``inner_compiler`` = which graphs to model, default ``"inductor"``,
    ``budget_scope`` = ``"step"`` (default) or ``"region"``, module docstring). Under the
    step scope, blocks the model compiled on its own (``torch.compile(block)`` or
    ``block.compile()``) are estimated as such and the rest runs eagerly; a model with no
    compiled part is compiled whole.
    ``device``: the device the step is traced on (its kernels decide what is saved);
    default the parameters' device, for a meta model the current accelerator or CPU.
    ``bandwidth`` (GB/s each way, or a :class:`TransferBandwidth`) prices the copies,
    default ``DEFAULT_TRANSFER_BANDWIDTH``; ``throughput`` prices the ops (default the
    roofline of ``device``). ``layout`` (step scope): ``"auto"`` (default) estimates a
    model compiled whole that repeats one block at least 8 times with each block compiled
    on its own (one block captured and planned, priced on the step for every layer:
    :mod:`.step_scope` says what differs from the whole graph's plan);
    ``"as_given"`` as its owner compiled it; ``"per_block"`` per block from 2 blocks.
    Inputs may be real, meta or fake tensors; only their shapes, dtypes and strides are
    used. Nothing is allocated and the model is not modified.
    """
    _check_layout(layout)
    if budget is not None:
        if "max_resident_activation_mb" in options:
            raise ConfigurationError(
                "hyper_offload.estimate: budget and max_resident_activation_mb are the same "
                "option; pass only one of them"
            )
        options["max_resident_activation_mb"] = budget
    parsed = parse_backend_options(options)
    if parsed.tile_sequence != "off" and not parsed.step_scoped:
        raise ConfigurationError(
            "hyper_offload.estimate: tile_sequence tiles the graphs Dynamo hands the backend, "
            "and budget_scope='region' estimates the model without Dynamo. Fix: use "
            "budget_scope='step' (the default)"
        )
    link = _bandwidth(bandwidth)
    target = resolve_trace_device(model, device)
    prices = throughput or throughput_for(target)
    common = dict(
        model=type(model).__name__, device=str(target), inner_compiler=parsed.inner_compiler,
        d2h_bandwidth_gbps=link.d2h_gbps, h2d_bandwidth_gbps=link.h2d_gbps,
        flops_per_s=prices.flops_per_s, memory_bytes_per_s=prices.bytes_per_s,
    )
    if parsed.step_scoped:
        from .step_scope import estimate_step

        found = estimate_step(
            model, example_inputs, device=target, options=parsed, link=link,
            throughput=throughput, layout=layout,
        )
        return EstimateReport(
            **common, region_report=None, min_feasible_budget_bytes=found.step.floor_peak_bytes,
            trace_seconds=found.seconds, step=found.step, regions=found.regions,
            layout=found.layout, step_compute_s=found.compute_s,
            floor_detail=found.floor_detail,
        )
    return _estimate_region(model, example_inputs, target, parsed, link, prices, common)


def _estimate_region(
    model: nn.Module, example_inputs: Sequence[Any], target: torch.device,
    parsed: BackendOptions, link: TransferBandwidth, prices: DeviceThroughput,
    common: dict[str, Any],
) -> EstimateReport:
    """``estimate`` under ``budget_scope="region"``: the whole step as one graph, its
    region plan, and the op at its floor."""
    choice, plan_seconds, trace_seconds = _capture_and_search(
        model, example_inputs, target, parsed, link, prices
    )
    fx_trace, schedule, check = choice.plan.fx_trace, choice.plan.schedule, choice.plan.check
    need = required_bytes(fx_trace.trace)
    at = max(range(len(need)), key=need.__getitem__, default=None)
    floor_op = None if at is None else FloorOp(
        0, fx_trace.trace.ops[at].name, fx_trace.trace.operand_bytes(at), need[at],
        fx_trace.operands(at))
    report = build_region_report(
        fx_trace, schedule, check, parsed, 0, plan_seconds, choice.report,
        sizes=symbolic_sizes(choice.fw, choice.bw),  # each symbol and the size planned at
        planned=choice.plan,
    )
    return EstimateReport(
        **common,
        region_report=report,
        min_feasible_budget_bytes=max(need, default=0),
        region_floor_op=floor_op,
        trace_seconds=trace_seconds,
        stall_lower_bound_s=stall_lower_bound(
            fx_trace.trace, earliest_prefetch_op=fx_trace.num_fw_ops,
            latest_release_op=fx_trace.num_fw_ops - 1,
        ).stall_s,
    )


def _check_layout(layout: str) -> None:
    from .step_scope import LAYOUTS

    if layout not in LAYOUTS:
        raise ConfigurationError(
            f"hyper_offload.estimate: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}"
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
    progress.note("capturing the model as one region on fake tensors")
    with inductor_config.patch(options.inductor_patches()):  # the backend's Inductor mode
        capture_graphs(
            model, example_inputs, device=device, inner_compiler=options.inner_compiler,
            partition=search,
        )
    ((choice, plan_seconds),) = searched
    return choice, plan_seconds, time.perf_counter() - started - plan_seconds
