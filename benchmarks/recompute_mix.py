"""Offload, recompute, or both (issue 17): the predicted step time of each strategy
alone and of the outer search that combines them, on the stall benchmark's GPU-priced
compile traces.

For each model the training step is captured on fake tensors (``estimate``'s capture;
Inductor's graphs, or aot_eager's with ``--inner-compiler aot_eager``) once per value of
torch's ``activation_memory_budget`` in ``GRID``: the stock min-cut partitioner then
recomputes more in the backward the lower the value (``torch._functorch.config.patch``,
scoped to the capture). Each capture is traced and
priced by the roofline at 400 TFLOP/s and 3 TB/s; its ops include the recomputation, so
its compute time is the step's compute with that much recompute. Then, per link speed
and budget (a fraction of the plain step's activation peak):

* ``offload only``    the plain partition (``activation_memory_budget=1.0``) planned by
                      the compile backend's pipeline: compute + predicted stall;
* ``recompute only``  the least compute among the partitions whose own activation peak
                      already fits the budget (none: the partitioner cannot get there);
* ``joint (any)``     for every partition, the pipeline's plan under the budget; the
                      least compute + predicted stall among the feasible plans: the best
                      mix when exactness may be waived;
* ``backend``         what the compile backend itself chooses with ``recompute="auto"``
                      (:func:`hyper_offload.compiler.recompute.search.choose_partition`,
                      run on the same joint graph inside the capture) under its
                      exactness rules. These traces are bf16 under Inductor, so the
                      low-precision rule applies: torch's partitions only recompute
                      what rounds the same, and the spliced backward
                      (``compiler/recompute/splice.py``) recomputes saved activations exactly
                      (``backend_spliced``: how many);
* ``backend_unrestricted`` the same search with that rule off: what the backend
                      searches where the rule does not apply (aot_eager, fp32), priced
                      on these traces. Its choice must match ``joint (any)``.

``joint (any)`` includes both single strategies (``1.0`` is offload only; a partition
that fits needs no copy), so it is never slower than either; ``joint (backend)``
includes offload only, and recompute only where that is exact. All figures *predicted*.

    .venv/bin/python benchmarks/recompute_mix.py                  # three models (~4 min)
    .venv/bin/python benchmarks/recompute_mix.py --only gpt2_small_b4_seq2048
    .venv/bin/python benchmarks/recompute_mix.py --dtype float32  # same shapes in fp32
    .venv/bin/python benchmarks/recompute_mix.py --inner-compiler aot_eager  # bf16, no fusion
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stall import GPU, MIB, MODELS  # noqa: E402

from hyper_offload.compiler.fake_capture import StockPartition, capture_graphs  # noqa: E402
from hyper_offload.compiler.options import parse_backend_options  # noqa: E402
from hyper_offload.compiler.recompute.candidates import copy_joint  # noqa: E402
from hyper_offload.compiler.recompute.search import choose_partition, graph_planner  # noqa: E402
from hyper_offload.compiler.region_report import RecomputeReport  # noqa: E402
from hyper_offload.passes import GreedyResidencyPlanner, plan_residency  # noqa: E402
from hyper_offload.passes.analysis.predicted_timeline import op_durations  # noqa: E402
from hyper_offload.passes.fx.fx_trace import FxTrace  # noqa: E402
from hyper_offload.passes.fx.graph_trace import build_fx_trace  # noqa: E402
from hyper_offload.runtime.device import TransferBandwidth  # noqa: E402

GRID = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)
"""``activation_memory_budget`` values tried (1.0: torch's default partition)."""


@dataclass(frozen=True)
class Choice:
    """One partition planned under one budget and link."""

    memory_budget: float
    compute_s: float
    stall_s: float
    feasible: bool
    moved_d2h: int
    fits_alone: bool  # its activation peak is within the budget with no offload

    @property
    def step_s(self) -> float:
        return self.compute_s + self.stall_s


def _model(name: str, dtype: torch.dtype | None) -> tuple[torch.nn.Module, Any]:
    """The stall benchmark's model (bf16), or the same shapes in ``dtype``."""
    model, inputs = MODELS[name]()
    return (model if dtype is None else model.to(dtype)), inputs


def capture(name: str, dtype: torch.dtype | None = None, inner: str = "inductor") -> dict[float, FxTrace]:
    """The model's compile trace at every ``GRID`` value."""
    traces = {}
    for memory_budget in GRID:
        model, inputs = _model(name, dtype)
        with torch._functorch.config.patch(activation_memory_budget=memory_budget):
            graphs = capture_graphs(model, inputs, device="cpu", inner_compiler=inner)
        traces[memory_budget] = build_fx_trace(
            graphs.fw, graphs.bw, num_fwd_outputs=graphs.num_fwd_outputs, throughput=GPU,
        )
    return traces


def backend_choices(
    name: str, fractions: list[float], links: list[float], dtype: torch.dtype | None = None,
    inner: str = "inductor",
) -> dict[tuple[float, float, bool], RecomputeReport]:
    """The backend's own recompute search per (budget fraction, link, low-precision rule
    on), on the joint graph of one capture (each search partitions its own copy). Rule
    off is what the backend searches where it does not apply (aot_eager, fp32)."""
    reports: dict[tuple[float, float, bool], RecomputeReport] = {}

    def search(joint: torch.fx.GraphModule, stock: StockPartition, num_fwd_outputs: int) -> Any:
        for gbps in links:
            link = TransferBandwidth(gbps, gbps, measured=False)
            for fraction in fractions:
                options = parse_backend_options({"max_resident_activation_fraction": fraction})
                plan = graph_planner(num_fwd_outputs=num_fwd_outputs, options=options,
                                     bandwidth=lambda _fw: link, region=0, throughput=GPU)
                for exact in (True, False):
                    reports[fraction, gbps, exact] = choose_partition(
                        copy_joint(joint), stock, plan, mode="auto",
                        restrict_low_precision=exact and inner == "inductor",
                    ).report
        return stock(joint)

    model, inputs = _model(name, dtype)
    capture_graphs(model, inputs, device="cpu", inner_compiler=inner, partition=search)
    return reports


def plan(fx_trace: FxTrace, memory_budget: float, budget: int, gbps: float) -> Choice:
    trace = replace(fx_trace.trace, d2h_bandwidth_gbps=gbps, h2d_bandwidth_gbps=gbps)
    trace = trace.with_budget(budget)
    planned = plan_residency(
        trace, GreedyResidencyPlanner(), earliest_prefetch_op=fx_trace.num_fw_ops,
        release_waits_for_d2h=True, latest_release_op=fx_trace.num_fw_ops - 1,
    )
    return Choice(
        memory_budget=memory_budget,
        compute_s=sum(op_durations(trace)),
        stall_s=planned.predicted_stall_s,
        feasible=not planned.check.infeasible_ops,
        moved_d2h=planned.check.bytes_d2h,
        fits_alone=fx_trace.peak_without_offload <= budget,
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def row(name: str, traces: dict[float, FxTrace], fraction: float, gbps: float,
        exact: RecomputeReport, unrestricted: RecomputeReport) -> dict[str, Any]:
    peak = traces[1.0].peak_without_offload
    budget = int(fraction * peak)
    choices = [plan(fx, mb, budget, gbps) for mb, fx in traces.items()]
    offload = choices[0]
    alone = [c for c in choices if c.fits_alone]
    recompute = min(alone, key=lambda c: c.compute_s) if alone else None
    feasible = [c for c in choices if c.feasible]
    joint = min(feasible, key=lambda c: (c.step_s, c.moved_d2h)) if feasible else None
    singles = [c.step_s for c in (offload,) if c.feasible] + (
        [recompute.compute_s] if recompute else [])
    best_single = min(singles) if singles else None
    return {
        "bench": "recompute_mix", "model": name, "budget_fraction": fraction,
        "link_gbps": gbps, "peak_mib": round(peak / MIB, 1),
        "plain_compute_ms": _ms(offload.compute_s),
        "offload_only_ms": _ms(offload.step_s) if offload.feasible else None,
        "recompute_only_ms": _ms(recompute.compute_s) if recompute else None,
        "recompute_only_memory_budget": recompute.memory_budget if recompute else None,
        "joint_ms": _ms(joint.step_s) if joint else None,
        "joint_memory_budget": joint.memory_budget if joint else None,
        "joint_moved_d2h_mib": round(joint.moved_d2h / MIB, 1) if joint else None,
        "joint_recompute_ms": _ms(joint.compute_s - offload.compute_s) if joint else None,
        "joint_stall_ms": _ms(joint.stall_s) if joint else None,
        "joint_le_best_single": (joint.step_s <= best_single * (1 + 1e-9)) if joint and best_single else None,
        "joint_strictly_lower": (joint.step_s < best_single * (1 - 1e-6)) if joint and best_single else None,
        **_backend_columns("backend", exact, offload, recompute),
        **_backend_columns("backend_unrestricted", unrestricted, offload, recompute),
        "predicted": True,
    }


def _backend_columns(
    prefix: str, chosen: RecomputeReport, offload: Choice, recompute: Choice | None
) -> dict[str, Any]:
    """The backend's choice, against offload only and torch's recompute only."""
    feasible = next(p.feasible for p in chosen.partitions
                    if p.memory_budget == chosen.memory_budget and p.spliced == chosen.spliced)
    step = chosen.joint_s if feasible else None
    singles = [c for c in (offload.step_s if offload.feasible else None,
                           recompute.compute_s if recompute else None) if c is not None]
    best = min(singles) if singles else None
    return {
        f"{prefix}_ms": _ms(step),
        f"{prefix}_memory_budget": chosen.memory_budget if feasible else None,
        f"{prefix}_recomputed_ops": len(chosen.recomputed),
        f"{prefix}_spliced": chosen.spliced,
        f"{prefix}_restriction": chosen.restriction,
        f"{prefix}_le_best_single": (step <= best * (1 + 1e-9)) if step and best else None,
        f"{prefix}_strictly_lower": (step < best * (1 - 1e-6)) if step and best else None,
        f"{prefix}_le_offload_only": (step <= offload.step_s * (1 + 1e-9)) if step and offload.feasible else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.85])
    parser.add_argument("--links", type=float, nargs="+", default=[16.0, 50.0])
    parser.add_argument("--inner-compiler", choices=("inductor", "aot_eager"), default="inductor",
                        help="whose graphs to capture (default inductor)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="cast the models (default: the stall benchmark's bf16)")
    args = parser.parse_args()
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    if args.inner_compiler != "inductor":
        note = "aot_eager graphs: no decompositions, recompute is exact in any dtype"
        print(json.dumps({"bench": "recompute_mix.note", "note": note}), flush=True)
    for name in args.only:
        started = time.perf_counter()
        traces = capture(name, dtype, args.inner_compiler)
        captured = time.perf_counter()
        chosen = backend_choices(name, args.fractions, args.links, dtype, args.inner_compiler)
        print(json.dumps({"bench": "recompute_mix.capture", "model": name, "dtype": args.dtype or "bfloat16",
                          "captures": len(traces), "seconds": round(captured - started, 1),
                          "backend_search_seconds": round(time.perf_counter() - captured, 1),
                          "measured": True}), flush=True)
        for gbps in args.links:
            for fraction in args.fractions:
                result = row(name, traces, fraction, gbps, chosen[fraction, gbps, True],
                             chosen[fraction, gbps, False])
                print(json.dumps({**result, "dtype": args.dtype or "bfloat16",
                                  "inner_compiler": args.inner_compiler}), flush=True)


if __name__ == "__main__":
    main()
