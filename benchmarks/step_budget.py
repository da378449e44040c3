"""Step-budget benchmark (issue 31): one budget for the whole step, however it is compiled.

The issue's model: a 4-block MLP-transformer (d=128, batch 8, seq 256), aot_eager inner
compiler, compiled three ways (the whole model; each block on its own, torchtitan's way;
the whole model with a graph break after block 2), at 70 / 50 / 30% of the plain step's
saved bytes. Per row, in one process, against plain ``torch.compile`` of the same layout:

* **measured**: device bytes the compiled backward holds after the forward (first step
  and third), the profiler's peak of the third step (``examples/step_memory.py``), bytes
  the runtime moved per step (first and third), and whether loss and every gradient are
  ``torch.equal`` to plain compile's;
* **predicted** (GPU pricing: ops on the roofline at 400 TFLOP/s and 3 TB/s, links at
  16 and 50 GB/s, the one timeline model): the step plan's stall, the first step's (the
  floor: everything movable moves);
* **compile cost** (measured): the first two steps' wall time over plain per-layout
  compile's; and the bytes-moved reference: the whole model compiled as one region with
  ``budget_scope="region"`` (the region plan of before issue 31) at the same budget.

One JSON line per row; ``--table`` prints the Markdown table of docs/benchmarks.md.
Run from the repository root: ``python benchmarks/step_budget.py [--table] [--quick]``.

``--recompute``: recompute co-planned with the step (issue 31, item 3), as an H200 would
plan it: the backend prices ops on the GPU roofline and copies at 16 GB/s (so its step
plan, its predicted stall and the re-lowering's search see a GPU's step, while the step
itself runs here), ``recompute="off"`` against ``"auto"`` per layout and budget:
measured bytes moved per step and exactness, predicted stall and compute of the step,
the regions the search re-lowered, and the first two steps' wall time auto / off.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import hyper_offload
from hyper_offload.compiler.backend import HyperOffloadBackend
from hyper_offload.compiler.options import parse_backend_options
from hyper_offload.runtime.saved_bytes import saved_device_bytes
from hyper_offload.passes.analysis.predicted_timeline import op_durations, predict_timeline
from hyper_offload.passes.fx.cost_model import DeviceThroughput, node_seconds
from hyper_offload.passes.ir.schedule import ResidencySchedule
from hyper_offload.passes.plan.step.layout import StepTrace, lay_out_step
from hyper_offload.runtime.device import TransferBandwidth

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from step_memory import profiled_step  # noqa: E402

D, BATCH, SEQ, LAYERS = 128, 8, 256, 4
GPU = DeviceThroughput(flops_per_s=400e12, bytes_per_s=3e12)
LINKS_GBPS = (16.0, 50.0)
FRACTIONS = (0.7, 0.5, 0.3)
LAYOUTS = ("whole", "per_block", "graph_break")
STEPS = 3
_MIB = float(1 << 20)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, graph_break: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head, self.graph_break = nn.Linear(D, 1), graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if self.graph_break and i == LAYERS // 2:
                torch._dynamo.graph_break()
            x = layer(x)
        return self.head(x).pow(2).mean()


def _build(layout: str, backend: Any) -> tuple[nn.Module, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack(graph_break=layout == "graph_break")
    if layout == "per_block":
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, backend=backend)
        return model, model
    return model, torch.compile(model, backend=backend)


def _train(layout: str, backend: Any, runtime: Any = None) -> dict[str, Any]:
    """``STEPS`` steps: measured saved bytes, moved bytes, peak, numerics, wall times."""
    model, step = _build(layout, backend)
    x = torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {"saved": [], "moved": [], "seconds": []}
    for number in range(STEPS):
        before = runtime.bytes_d2h if runtime is not None else 0
        started = time.perf_counter()

        def run() -> torch.Tensor:
            loss = step(x)
            out["saved"].append(saved_device_bytes(loss, exclude=[*model.parameters(), x]))
            loss.backward()
            return loss

        if number == STEPS - 1:
            loss, memory = profiled_step(run, torch.device("cpu"), model.parameters())
            out["profiler_peak"] = memory.peak_bytes
        else:
            loss = run()
        out["seconds"].append(time.perf_counter() - started)
        out["moved"].append((runtime.bytes_d2h - before) if runtime is not None else 0)
        out["loss"], out["grads"] = loss.detach(), [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    return out


def _gpu_seconds(backend: Any) -> dict[tuple[int, str], float]:
    """Each region op's duration on the GPU roofline, by region and op name (the ops of
    its floor's trace and of its lowering in force)."""
    seconds = {}
    for region in backend.regions:
        if region.graphs is None:
            continue
        fw, bw = region.graphs
        nodes = {f"fw:{n.name}": n for n in fw.graph.nodes}
        nodes.update({f"bw:{n.name}": n for n in bw.graph.nodes})
        for plan in (region.floor_plan, region.planned):
            if plan is None:
                continue
            for op, name in zip(plan.fx_trace.trace.ops, plan.fx_trace.op_nodes):
                if name in nodes:
                    seconds[region.index, op.name] = node_seconds(nodes[name], GPU)
    return seconds


def _stall_on_gpu(step: StepTrace, schedule: ResidencySchedule,
                  seconds: dict[tuple[int, str], float], gbps: float) -> float:
    """Seconds ``schedule`` of the step waits for copies with region ops priced on the GPU
    roofline and copies at ``gbps`` each way (*predicted*, the one timeline model; the
    compile lowering's releases wait for their D2H)."""
    ops = tuple(
        op if owner.invocation is None else dataclasses.replace(
            op, duration_s=seconds.get((owner.invocation.region, op.name), op.duration_s))
        for op, owner in zip(step.trace.ops, step.owners)
    )
    trace = dataclasses.replace(step.trace, ops=ops, d2h_bandwidth_gbps=gbps,
                                h2d_bandwidth_gbps=gbps)
    return predict_timeline(trace, schedule, release_waits_for_d2h=True).exposed_transfer_s


def _predicted(backend: Any) -> dict[str, Any]:
    """The step plan's stall on GPU pricing, per link, and the first step's (every region
    at its floor, whatever it runs now)."""
    plan = backend.step_plan
    first = lay_out_step(plan.timeline, {
        r.index: r.floor_plan.fx_trace.region_floor(r.floor_plan.schedule)
        for r in backend.regions if r.floor_plan is not None
    })
    seconds = _gpu_seconds(backend)
    figures: dict[str, Any] = {}
    for gbps in LINKS_GBPS:
        figures[f"stall_ms_{gbps:g}gbps"] = 1e3 * _stall_on_gpu(
            plan.layout, plan.schedule, seconds, gbps)
        figures[f"first_step_stall_ms_{gbps:g}gbps"] = 1e3 * _stall_on_gpu(
            first, first.floor, seconds, gbps)
    return figures


def _in_force(backend: Any, region: int) -> Any:
    """Region ``region`` as it runs now (its lowering in force, as the step plan sees it)."""
    floor = backend.regions[region].step_floor(in_force=True)
    assert floor is not None, f"region {region} was never planned"
    return floor


def _exact(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return torch.equal(a["loss"], b["loss"]) and all(
        torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))


def run_row(layout: str, fraction: float) -> dict:
    # Plain compile of the same layout right before ours, so that both pay the same
    # process state (the first compile in a process pays one-time costs: warm up first).
    plain = _train(layout, "aot_eager")
    budget = int(fraction * plain["saved"][0])
    # The reference for bytes moved: the same model compiled whole as one region and
    # planned on its own (the region plan of before issue 31), at the same budget.
    region = hyper_offload.backend(inner_compiler="aot_eager", budget_scope="region",
                                   max_resident_activation_mb=budget / _MIB)
    reference_moved = _train("whole", region, region.runtime)["moved"][-1]
    backend = hyper_offload.backend(inner_compiler="aot_eager",
                                    max_resident_activation_mb=budget / _MIB)
    ours = _train(layout, backend, backend.runtime)
    report = backend.step_report
    return {
        "benchmark": "step_budget", "layout": layout, "fraction": fraction,
        "budget_bytes": budget, "plain_saved_bytes": plain["saved"][0],
        "measured_saved_bytes_step1": ours["saved"][0],
        "measured_saved_bytes_step3": ours["saved"][-1],
        "measured_profiler_peak_bytes": ours["profiler_peak"],
        "plain_profiler_peak_bytes": plain["profiler_peak"],
        "measured_moved_bytes_step1": ours["moved"][0],
        "measured_moved_bytes_step3": ours["moved"][-1],
        "whole_model_region_moved_bytes": reference_moved,
        "moved_ratio_vs_whole_model": ours["moved"][-1] / max(reference_moved, 1),
        "exact": _exact(ours, plain),
        "invocations": len(report.invocations), "regions": len(backend.regions),
        "predicted_peak_bytes": report.peak_bytes,
        "predicted_floor_peak_bytes": report.floor_peak_bytes,
        **{f"predicted_{k}": v for k, v in _predicted(backend).items()},
        "first_two_steps_ratio_vs_plain": sum(ours["seconds"][:2]) / sum(plain["seconds"][:2]),
    }


def run_recompute_row(layout: str, fraction: float) -> dict[str, Any]:
    """``recompute="off"`` against ``"auto"`` with a backend that plans as an H200 would
    (module docstring)."""
    plain = _train(layout, "aot_eager")
    budget = int(fraction * plain["saved"][0])
    row: dict[str, Any] = {"benchmark": "step_budget_recompute", "layout": layout,
                           "fraction": fraction, "budget_bytes": budget}
    for recompute in ("off", "auto"):
        options = parse_backend_options({
            "inner_compiler": "aot_eager", "max_resident_activation_mb": budget / _MIB,
            "recompute": recompute,
        })
        backend = HyperOffloadBackend(
            options, link=TransferBandwidth(LINKS_GBPS[0], LINKS_GBPS[0], measured=False),
            throughput=GPU,
        )
        ours = _train(layout, backend, backend.runtime)
        report = backend.step_report
        compute = sum(sum(op_durations(_in_force(backend, p.invocation.region).trace))
                      for p in report.invocations)
        row.update({
            f"{recompute}_measured_moved_bytes_step2": ours["moved"][1],
            f"{recompute}_measured_moved_bytes_step3": ours["moved"][-1],
            f"{recompute}_measured_saved_bytes_max": max(ours["saved"]),
            f"{recompute}_predicted_stall_ms": 1e3 * report.predicted_stall_s,
            f"{recompute}_predicted_compute_ms": 1e3 * compute,
            f"{recompute}_predicted_peak_bytes": report.peak_bytes,
            f"{recompute}_relowered": list(report.relowered),
            f"{recompute}_exact": _exact(ours, plain),
            f"{recompute}_first_two_steps_s": sum(ours["seconds"][:2]),
        })
    row["first_two_steps_ratio_auto_vs_off"] = (
        row["auto_first_two_steps_s"] / row["off_first_two_steps_s"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="also print the Markdown table")
    parser.add_argument("--quick", action="store_true", help="50%% only")
    parser.add_argument("--recompute", action="store_true",
                        help="recompute off vs auto, planned as an H200 would (module docstring)")
    args = parser.parse_args()
    fractions = (0.5,) if args.quick else FRACTIONS
    _train("whole", "aot_eager")  # the warm-up: Dynamo's first compile in the process
    run, render = (run_recompute_row, recompute_table) if args.recompute else (run_row, table)
    rows = []
    for fraction in fractions:
        for layout in LAYOUTS:
            row = run(layout, fraction)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.table:
        print(render(rows))


def recompute_table(rows: list[dict[str, Any]]) -> str:
    head = ("| layout | budget | moved per step 2 / 3, off -> auto (MiB, measured) | "
            "saved max, auto (MiB, measured) | stall off -> auto (ms, predicted) | "
            "compute off -> auto (ms, predicted) | regions re-lowered | exact (off, auto) | "
            "first 2 steps auto / off |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['fraction']:.0%} = {r['budget_bytes'] / _MIB:.2f} | "
            f"{r['off_measured_moved_bytes_step2'] / _MIB:.2f} / "
            f"{r['off_measured_moved_bytes_step3'] / _MIB:.2f} -> "
            f"{r['auto_measured_moved_bytes_step2'] / _MIB:.2f} / "
            f"{r['auto_measured_moved_bytes_step3'] / _MIB:.2f} | "
            f"{r['auto_measured_saved_bytes_max'] / _MIB:.2f} | "
            f"{r['off_predicted_stall_ms']:.3f} -> {r['auto_predicted_stall_ms']:.3f} | "
            f"{r['off_predicted_compute_ms']:.3f} -> {r['auto_predicted_compute_ms']:.3f} | "
            f"{', '.join(map(str, r['auto_relowered'])) or 'none'} | "
            f"{r['off_exact']}, {r['auto_exact']} | "
            f"{r['first_two_steps_ratio_auto_vs_off']:.2f}x |"
        )
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| layout | budget | saved step 1 / 3 (MiB, measured) | profiler peak (MiB, "
            "measured; plain) | moved per step 1 / 3 (MiB, measured) | vs whole model | "
            "stall 16 / 50 GB/s (ms, predicted) | first step stall 16 GB/s | "
            "first 2 steps vs plain | exact |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['fraction']:.0%} = {r['budget_bytes'] / _MIB:.2f} | "
            f"{r['measured_saved_bytes_step1'] / _MIB:.2f} / "
            f"{r['measured_saved_bytes_step3'] / _MIB:.2f} | "
            f"{r['measured_profiler_peak_bytes'] / _MIB:.1f}; "
            f"{r['plain_profiler_peak_bytes'] / _MIB:.1f} | "
            f"{r['measured_moved_bytes_step1'] / _MIB:.2f} / "
            f"{r['measured_moved_bytes_step3'] / _MIB:.2f} | "
            f"{r['moved_ratio_vs_whole_model']:.2f}x | "
            f"{r['predicted_stall_ms_16gbps']:.3f} / {r['predicted_stall_ms_50gbps']:.3f} | "
            f"{r['predicted_first_step_stall_ms_16gbps']:.3f} | "
            f"{r['first_two_steps_ratio_vs_plain']:.2f}x | {r['exact']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
