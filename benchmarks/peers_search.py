"""The default door with its recompute search against region scope's full search
(issue 43), on a Llama-3-8B shape at 32K tokens, bf16, batch 1, 56 GiB. *Predicted*.

* ``default``: the backend as ``torch.compile(model, backend="hyper_offload")`` runs it
  (``budget_scope="step"``, ``recompute="auto"``), on fake tensors: the first step at the
  floor, then, where the step plan stalls or cannot fit, the recompute search ranked on
  the step (work-bounded) and the lowering made for the step; its predicted step time is
  the step's compute (every invocation's ops) plus the plan's predicted stall;
* ``region``: ``budget_scope="region"`` with the search unbounded
  (``choose_partition(bounded=False)``): its chosen partition's compute plus stall.

Both price ops on the roofline at 400 TFLOP/s and 3 TB/s, copies at ``--links`` GB/s.
``--repeat-loaded`` plans the default door a second time while a CPU-bound process runs
beside it and reports whether both plans are identical (the search reads no clock).

    .venv/bin/python benchmarks/peers.py --search [--layers 32] [--links 25 50]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from hyper_offload.compiler.backend import HyperOffloadBackend  # noqa: E402
from hyper_offload.compiler.fake_capture import (  # noqa: E402
    capture_graphs,
    fake_inputs,
    fake_module,
)
from hyper_offload.compiler.options import parse_backend_options  # noqa: E402
from hyper_offload.compiler.recompute.search import choose_partition, graph_planner  # noqa: E402
from hyper_offload.compiler.step.controller import StepState  # noqa: E402
from hyper_offload.compiler.estimate.step_scope import compile_as_given  # noqa: E402
from hyper_offload.passes.analysis.predicted_timeline import op_durations  # noqa: E402
from hyper_offload.passes.fx.cost_model import DeviceThroughput, node_seconds  # noqa: E402
from hyper_offload.runtime.device import TransferBandwidth  # noqa: E402

GPU = DeviceThroughput(flops_per_s=400e12, bytes_per_s=3e12)
GIB = float(1 << 30)


def llama3_8b(layers: int, seq: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from llama_model import Llama, LlamaConfig

    config = LlamaConfig(vocab=128256, dim=4096, layers=layers, heads=32, kv_heads=8,
                         hidden=14336, max_seq_len=seq, rope_theta=500000.0)
    with torch.device("meta"):
        model = Llama(config).to(torch.bfloat16)
    tokens = torch.empty(1, seq, dtype=torch.int64, device="meta")
    return model, (tokens, tokens)


def default_door(model: torch.nn.Module, inputs: Any, budget_mb: float, gbps: float) -> dict:
    """The backend's plan after the steps a real run takes to settle (fake tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch._dynamo.reset()
    started = time.perf_counter()
    options = parse_backend_options({"max_resident_activation_mb": budget_mb})
    link = TransferBandwidth(gbps, gbps, measured=False)
    backend = HyperOffloadBackend(options, link=link, throughput=GPU, fake_steps=True)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    device = torch.device("cpu")
    compiled = compile_as_given(fake_module(model, mode, device), backend)
    args = fake_inputs(mode, inputs, device)
    for _ in range(4):
        with mode, torch.enable_grad():
            compiled(*args).backward()
        if backend.controller.state is not StepState.RELOWERING:
            break
    plan = backend.step_plan
    compute = sum(sum(op_durations(backend.regions[i.region].step_floor(in_force=True).trace))
                  for i in plan.timeline.invocations)
    reports = [r.planned.report for r in backend.regions if r.planned is not None]
    recompute = [r.recompute for r in reports if r.recompute is not None]
    digest = hashlib.sha256(repr([
        (r.index, r.step_schedule, sorted(r.planned.fx_trace.op_nodes) if r.planned else None)
        for r in backend.regions
    ] + [sorted(plan.keep_for(i)) for i in plan.timeline.invocations]).encode()).hexdigest()
    return {
        "default_step_ms": round(1e3 * (compute + plan.predicted_stall_s), 2),
        "default_compute_ms": round(1e3 * compute, 2),
        "default_stall_ms": round(1e3 * plan.predicted_stall_s, 2),
        "default_moved_gib": round(2 * plan.moved_bytes / GIB, 2),
        "default_peak_gib": round(plan.peak_bytes / GIB, 2),
        "default_relowered": [r.index for r in backend.regions if r.relowered],
        "default_searched_partitions": sum(len(r.partitions) for r in recompute),
        "default_work_bounded": any(r.work_bounded for r in recompute),
        "default_lowered_for_step": sorted(plan.schedules),
        "default_plan_digest": digest[:16],
        "default_seconds": round(time.perf_counter() - started, 1),
    }


def region_full_search(model: torch.nn.Module, inputs: Any, budget_mb: float, gbps: float) -> dict:
    """``budget_scope="region"`` with the recompute search unbounded."""
    started = time.perf_counter()
    options = parse_backend_options({"max_resident_activation_mb": budget_mb,
                                     "budget_scope": "region"})
    link = TransferBandwidth(gbps, gbps, measured=False)
    chosen: list[Any] = []

    def search(joint: Any, stock: Any, num_fwd_outputs: int) -> Any:
        plan = graph_planner(num_fwd_outputs=num_fwd_outputs, options=options,
                             bandwidth=lambda _fw: link, region=0, throughput=GPU)
        choice = choose_partition(
            joint, stock, plan, mode="auto", restrict_low_precision=True, bounded=False,
            seconds=lambda node: node_seconds(node, GPU),
        )
        chosen.append(choice)
        return choice.fw, choice.bw

    capture_graphs(model, inputs, device=torch.device("cpu"), partition=search)
    (choice,) = chosen
    return {
        "region_step_ms": round(1e3 * choice.plan.step_s, 2),
        "region_compute_ms": round(1e3 * choice.plan.compute_s, 2),
        "region_stall_ms": round(1e3 * choice.plan.predicted_stall_s, 2),
        "region_moved_gib": round(2 * choice.plan.check.bytes_d2h / GIB, 2),
        "region_searched_partitions": len(choice.report.partitions),
        "region_seconds": round(time.perf_counter() - started, 1),
    }


def _burner() -> subprocess.Popen[bytes]:
    """A process that keeps one core busy (the 'other load' of --repeat-loaded)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--search", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--budget-gib", type=float, default=56.0)
    parser.add_argument("--links", type=float, nargs="+", default=[25.0, 50.0])
    parser.add_argument("--repeat-loaded", action="store_true")
    parser.add_argument("--skip-region", action="store_true")
    args = parser.parse_args(argv)
    budget_mb = args.budget_gib * 1024
    for gbps in args.links:
        row: dict[str, Any] = {"bench": "peers.search", "layers": args.layers, "seq": args.seq,
                               "budget_gib": args.budget_gib, "link_gbps": gbps,
                               "predicted": True}
        row.update(default_door(*llama3_8b(args.layers, args.seq), budget_mb, gbps))
        if args.repeat_loaded:
            burner = _burner()
            try:
                again = default_door(*llama3_8b(args.layers, args.seq), budget_mb, gbps)
            finally:
                burner.kill()
                burner.wait()
            row["identical_under_load"] = again["default_plan_digest"] == row["default_plan_digest"]
            row["default_seconds_loaded"] = again["default_seconds"]
        if not args.skip_region:
            row.update(region_full_search(*llama3_8b(args.layers, args.seq), budget_mb, gbps))
            row["default_over_region_step"] = round(
                row["default_step_ms"] / row["region_step_ms"], 4)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
