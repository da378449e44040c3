"""Predicted compute stall of the compile path's plans on LLM-shaped traces (issue 16):
how much step time the copies cost when ops are priced as a GPU, against a lower bound.

Each model's training step is captured once on fake tensors (``estimate``'s capture:
Inductor's graphs, nothing allocated), then planned by the compile path's own pipeline
(``compiler.region_plan.plan_graphs``: per proposal plan -> check -> place prefetches ->
check -> hold releases -> check, keep the least predicted stall) at each budget and
link speed, and timed with the one timeline model, ``predict_timeline(...,
release_waits_for_d2h=True)`` (one compute stream, one serial copy stream, a release
waits for its D2H, a reload is waited for before its reader). Ops are priced by the
roofline at 400 TFLOP/s and 3 TB/s. All figures are *predicted*.

One JSON line per (model, budget, link, planner): bytes moved, compute, stall and
stall/compute for

* ``time``  the default planner (``GreedyResidencyPlanner()``, objective step time),
* ``bytes`` the bytes-only planner (``objective="bytes"``) through the same placement,
* ``time, 2 copy streams (model only)`` the first re-timed with a copy stream per
  direction (the runtime has one),

and ``stall_lower_bound`` (``passes/analysis/liveness.py``: no schedule under the budget
stalls less), with ``target_met`` for issue 16's figure (stall <= 5% of compute or <=
1.1 x the bound) on rows at >= 70% of peak and 50 GB/s. ``--only planning_time`` times
the pipeline on a 10k-op synthetic trace (measured, this machine).

    .venv/bin/python benchmarks/stall.py                 # three models (~1 min on 2 cores)
    .venv/bin/python benchmarks/stall.py --only gpt2_small_b4_seq2048
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic import timed_transformer_trace  # noqa: E402

from hyper_offload.compiler.fake_capture import capture_graphs  # noqa: E402
from hyper_offload.compiler.options import parse_backend_options  # noqa: E402
from hyper_offload.compiler.region_plan import plan_graphs  # noqa: E402
from hyper_offload.passes import (  # noqa: E402
    GreedyResidencyPlanner,
    check_schedule,
    plan_residency,
    predict_timeline,
)
from hyper_offload.passes.analysis.liveness import stall_lower_bound  # noqa: E402
from hyper_offload.passes.fx.cost_model import DeviceThroughput  # noqa: E402
from hyper_offload.passes.plan.planning import backward_start  # noqa: E402
from hyper_offload.runtime.device import TransferBandwidth  # noqa: E402

GPU = DeviceThroughput(flops_per_s=400e12, bytes_per_s=3e12)
MIB = 1 << 20


def llama_7b_width_4_layers() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from llama_model import LLAMA_7B, Llama

    with torch.device("meta"):
        model = Llama(replace(LLAMA_7B, layers=4)).to(torch.bfloat16)
    tokens = torch.empty(1, 4096, dtype=torch.int64, device="meta")
    return model, (tokens, tokens)


def llama_1b_like_gqa_8_layers() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from llama_model import Llama, LlamaConfig

    config = LlamaConfig(vocab=32000, dim=2048, layers=8, heads=32, kv_heads=8, hidden=8192,
                         max_seq_len=8192)
    with torch.device("meta"):
        model = Llama(config).to(torch.bfloat16)
    tokens = torch.empty(1, 8192, dtype=torch.int64, device="meta")
    return model, (tokens, tokens)


def gpt2_small() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from gpt_model import GPT, GPTConfig

    config = GPTConfig(vocab=50257, seq_len=2048, layers=12, dim=768, heads=12)
    with torch.device("meta"):
        model = GPT(config).to(torch.bfloat16)
    tokens = torch.empty(4, 2048, dtype=torch.int64, device="meta")
    return model, (tokens, tokens)


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]] = {
    "llama_7b_width_4_layers_seq4096": llama_7b_width_4_layers,
    "llama_1b_like_gqa_8_layers_seq8192": llama_1b_like_gqa_8_layers,
    "gpt2_small_b4_seq2048": gpt2_small,
}


PLANNERS = ("time", "bytes", "time, 2 copy streams (model only)")


def _row(name: str, planner: str, fraction: float, gbps: float, fx_trace: Any,
         schedule: Any, plan_s: float, captured_s: float, bound_s: float) -> dict[str, Any]:
    check = check_schedule(fx_trace.trace, schedule)
    timeline = predict_timeline(
        fx_trace.trace, schedule, release_waits_for_d2h=True,
        copy_streams=2 if "2 copy streams" in planner else 1,
    )
    compute, stall = timeline.compute_s, timeline.exposed_transfer_s
    judged = fraction >= 0.7 and gbps == 50.0
    return {
        "bench": "stall", "model": name, "planner": planner,
        "budget_fraction": fraction, "link_gbps": gbps, "feasible": not check.infeasible_ops,
        "peak_before_mib": round(fx_trace.peak_without_offload / MIB, 1),
        "peak_after_mib": round(check.peak_resident_bytes / MIB, 1),
        "moved_d2h_mib": round(check.bytes_d2h / MIB, 1),
        "compute_ms": round(compute * 1e3, 2), "stall_ms": round(stall * 1e3, 2),
        "stall_over_compute": round(stall / compute, 4) if compute else None,
        "lower_bound_ms": round(bound_s * 1e3, 2),
        "lower_bound_over_compute": round(bound_s / compute, 4) if compute else None,
        "stall_over_lower_bound": round(stall / bound_s, 3) if bound_s > 0 else None,
        "target_met": (stall <= 0.05 * compute or stall <= 1.1 * bound_s) if judged else None,
        "ops": fx_trace.trace.num_ops, "plan_s": round(plan_s, 2),
        "capture_s": round(captured_s, 1), "predicted": True,
    }


def rows(name: str, fractions: list[float], links: list[float]) -> list[dict[str, Any]]:
    model, inputs = MODELS[name]()
    started = time.perf_counter()
    graphs = capture_graphs(model, inputs, device="cpu", inner_compiler="inductor")
    captured = time.perf_counter() - started
    out = []
    for gbps in links:
        for fraction in fractions:
            options = parse_backend_options({"max_resident_activation_fraction": fraction})
            planned_at = time.perf_counter()
            fx_trace, schedule, *_ = plan_graphs(
                graphs.fw, graphs.bw, num_fwd_outputs=graphs.num_fwd_outputs, options=options,
                bandwidth=TransferBandwidth(gbps, gbps, measured=False), region=0, throughput=GPU,
            )
            plan_s = time.perf_counter() - planned_at
            door = dict(earliest_prefetch_op=fx_trace.num_fw_ops,
                        latest_release_op=fx_trace.num_fw_ops - 1)
            by_bytes = plan_residency(
                fx_trace.trace, GreedyResidencyPlanner(objective="bytes"),
                release_waits_for_d2h=True, **door,
            ).schedule
            bound = stall_lower_bound(fx_trace.trace, **door).stall_s
            for planner, chosen in zip(PLANNERS, (schedule, by_bytes, schedule)):
                out.append(_row(name, planner, fraction, gbps, fx_trace, chosen, plan_s,
                                captured, bound))
    return out


def planning_time(num_layers: int = 1100) -> dict[str, Any]:
    """The whole pipeline (time objective, compile door) on a ~10k-op synthetic trace."""
    trace = timed_transformer_trace(num_layers)
    num_fw = backward_start(trace)
    started = time.perf_counter()
    planned = plan_residency(trace, GreedyResidencyPlanner(), earliest_prefetch_op=num_fw,
                             release_waits_for_d2h=True, latest_release_op=num_fw - 1)
    seconds = time.perf_counter() - started
    return {"bench": "stall.planning_time", "ops": trace.num_ops, "plan_s": round(seconds, 2),
            "target_s": 5.0, "target_met": seconds <= 5.0, "proposals": planned.proposals,
            "measured": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(MODELS) + ["planning_time"],
                        default=[*MODELS, "planning_time"])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.7, 0.85])
    parser.add_argument("--links", type=float, nargs="+", default=[16.0, 50.0])
    args = parser.parse_args()
    for name in args.only:
        if name == "planning_time":
            print(json.dumps(planning_time()), flush=True)
            continue
        for row in rows(name, args.fractions, args.links):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
