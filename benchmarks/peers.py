"""Peers (issue 43): the default door, region scope, torchtitan's rule and torch's AOT
offloading on the same Llama-shaped graphs, priced by the one timeline model.

Each model's training step is captured once through Dynamo on fake tensors (nothing is
allocated; Dynamo's module paths give torchtitan's rule its layers), partitioned by
torch's min-cut for Inductor, and traced as one region. Ops are priced on the roofline
at 400 TFLOP/s and 3 TB/s; copies at ``--links`` GB/s each way; every schedule is judged
by ``check_schedule`` and timed by ``predict_timeline(..., release_waits_for_d2h=True)``
(one compute stream, one serial copy stream, a release waits for its D2H, a reload is
waited for before its reader). All figures are **predicted**. ``recompute="off"``
throughout (``--search`` has recompute).

Per (model, budget, link) one JSON line with, for each peer, bytes moved (both ways,
GiB), stall (ms and % of compute) and peak (GiB):

* ``default``: ``budget_scope="step"``, the backend's own planner
  (``passes/plan/step/plan.py``'s ``plan_step``) on the region's floor, the step being
  that region run once;
* ``region``: ``budget_scope="region"`` (``compiler.region_plan.plan_graphs``);
* ``torchtitan`` and ``torch_aot`` (``benchmarks/peer_rules.py``; no budget: their own
  peak, the same on every row);
* ``lower_bound_ms``: no schedule within the budget stalls less
  (``passes/analysis/liveness.py``; below the floor, within the floor's peak).

Budgets: 70 / 50 / 30% of the saved bytes, 50% of the peak without offload, and
torchtitan's own peak (the comparison at equal memory).

    .venv/bin/python benchmarks/peers.py --table         # both Llama shapes (~2 min)
    .venv/bin/python benchmarks/peers.py --search        # Llama-3-8B, 32 x 32K (long)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_rules import aot_schedule, titan_schedule  # noqa: E402

from hyper_offload.compiler.options import parse_backend_options  # noqa: E402
from hyper_offload.compiler.region_plan import GraphPlan, plan_graphs  # noqa: E402
from hyper_offload.passes import ResidencySchedule, check_schedule, predict_timeline  # noqa: E402
from hyper_offload.passes.plan.step.model import (  # noqa: E402
    Invocation,
    StepEvent,
    StepEventKind,
    StepTimeline,
)
from hyper_offload.passes.plan.step.plan import plan_step  # noqa: E402
from hyper_offload.passes.analysis.liveness import stall_lower_bound  # noqa: E402
from hyper_offload.passes.fx.cost_model import DeviceThroughput  # noqa: E402
from hyper_offload.passes.fx.fx_trace import FxTrace  # noqa: E402
from hyper_offload.runtime.device import TransferBandwidth  # noqa: E402

GPU = DeviceThroughput(flops_per_s=400e12, bytes_per_s=3e12)
GIB = float(1 << 30)
ONE_STEP = StepTimeline(
    (StepEvent(StepEventKind.FORWARD, Invocation(0, 0)),
     StepEvent(StepEventKind.BACKWARD, Invocation(0, 0))),
    {Invocation(0, 0): 0},
)


@dataclass(frozen=True)
class Captured:
    fw: torch.fx.GraphModule
    bw: torch.fx.GraphModule
    num_fwd_outputs: int


def llama_7b_width_4_layers() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from llama_model import LLAMA_7B, Llama

    with torch.device("meta"):
        model = Llama(replace(LLAMA_7B, layers=4)).to(torch.bfloat16)
    tokens = torch.empty(1, 4096, dtype=torch.int64, device="meta")
    return model, (tokens, tokens)


def llama_1b_gqa_8_layers() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from llama_model import Llama, LlamaConfig

    config = LlamaConfig(vocab=32000, dim=2048, layers=8, heads=32, kv_heads=8, hidden=8192,
                         max_seq_len=8192)
    with torch.device("meta"):
        model = Llama(config).to(torch.bfloat16)
    tokens = torch.empty(1, 8192, dtype=torch.int64, device="meta")
    return model, (tokens, tokens)


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]] = {
    "llama_7b_width_4_layers_seq4096": llama_7b_width_4_layers,
    "llama_1b_gqa_8_layers_seq8192": llama_1b_gqa_8_layers,
}


def capture(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> Captured:
    """The model's step through Dynamo on fake tensors, partitioned by torch's min-cut as
    Inductor would (graphs only: nothing compiled, nothing allocated)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.custom_graph_pass import CustomPartitionerFn
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hyper_offload.compiler.fake_capture import compile_graphs_only, fake_inputs, fake_module

    kept: dict[str, Any] = {}

    class Keep(CustomPartitionerFn):
        def __call__(self, gm: Any, joint_inputs: Any, **kwargs: Any) -> Any:
            fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
            kept.update(fw=fw, bw=bw, n=kwargs["num_fwd_outputs"])
            return fw, bw

        def uuid(self) -> Any:
            return "benchmarks.peers"

        def __deepcopy__(self, memo: Any) -> Any:
            return self

    def backend(gm: Any, example_inputs: Any) -> Any:
        return compile_graphs_only(gm, example_inputs, Keep(), "inductor", {})

    torch._dynamo.reset()
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    device = torch.device("cpu")
    fake, args = fake_module(model, mode, device), fake_inputs(mode, inputs, device)
    with mode, torch.enable_grad():
        torch._dynamo.optimize(backend)(fake)(*args)
    return Captured(kept["fw"], kept["bw"], kept["n"])


@dataclass(frozen=True)
class Priced:
    moved_bytes: int
    stall_s: float
    peak_bytes: int

    def fields(self, prefix: str, compute_s: float) -> dict[str, Any]:
        return {
            f"{prefix}_moved_gib": round(2 * self.moved_bytes / GIB, 3),
            f"{prefix}_stall_ms": round(self.stall_s * 1e3, 3),
            f"{prefix}_stall_pct": round(100 * self.stall_s / compute_s, 2),
            f"{prefix}_peak_gib": round(self.peak_bytes / GIB, 3),
        }


def price(fx_trace: FxTrace, schedule: ResidencySchedule) -> Priced:
    """Bytes to the host, predicted stall and peak of ``schedule`` (any budget)."""
    trace = fx_trace.trace.with_budget(1 << 62)
    check = check_schedule(trace, schedule)
    assert check.ok, check.violations[:1]
    stall = predict_timeline(trace, schedule, release_waits_for_d2h=True).exposed_transfer_s
    return Priced(check.bytes_d2h, stall, check.peak_resident_bytes)


class Setting:
    """One model on one link: its floor, the peers' schedules, and how to plan a budget."""

    def __init__(self, graphs: Captured, gbps: float) -> None:
        self.graphs, self.gbps = graphs, gbps
        self.link = TransferBandwidth(gbps, gbps, measured=False)
        self.floor = self._plan(None, floor=True)
        self.fx_trace = self.floor.fx_trace
        self.compute_s = predict_timeline(
            self.fx_trace.trace, self.floor.schedule, release_waits_for_d2h=True).compute_s
        titan, self.titan_skipped = titan_schedule(self.fx_trace, graphs.fw, graphs.bw)
        aot, self.aot_skipped = aot_schedule(self.fx_trace, graphs.fw, graphs.bw,
                                             graphs.num_fwd_outputs, gbps)
        self.titan, self.aot = price(self.fx_trace, titan), price(self.fx_trace, aot)
        self.floor_peak = max(self.floor.check.resident_bytes)

    def _plan(self, budget: int | None, *, floor: bool = False) -> GraphPlan:
        options = parse_backend_options(
            {} if budget is None else {"max_resident_activation_mb": budget / (1 << 20)})
        return plan_graphs(self.graphs.fw, self.graphs.bw,
                           num_fwd_outputs=self.graphs.num_fwd_outputs, options=options,
                           bandwidth=self.link, region=0, throughput=GPU, floor=floor)

    def region(self, budget: int) -> Priced:
        plan = self._plan(budget)
        return price(plan.fx_trace, plan.schedule)

    def default(self, budget: int) -> Priced:
        """The default door: the step plan of the region run once (its own planner)."""
        region = self.fx_trace.region_floor(self.floor.schedule, lowerable=True)
        plan = plan_step(ONE_STEP, {0: region}, budget)
        schedule = plan.schedules.get(0, self.floor.schedule)
        priced = price(self.fx_trace, schedule)
        assert abs(priced.stall_s - plan.predicted_stall_s) < 1e-9 or plan.keep_for(
            Invocation(0, 0)), "the door's own price differs from the timeline's"
        return Priced(plan.moved_bytes, plan.predicted_stall_s, plan.peak_bytes)

    def lower_bound(self, budget: int) -> float:
        """No schedule within ``budget`` (or the floor's peak, when the budget is under it:
        then no schedule is within the budget) stalls less."""
        trace = self.fx_trace.trace.with_budget(max(budget, self.floor_peak))
        num_fw = self.fx_trace.num_fw_ops
        return stall_lower_bound(trace, earliest_prefetch_op=num_fw,
                                 latest_release_op=num_fw - 1).stall_s


def budgets(setting: Setting) -> list[tuple[str, int]]:
    saved, peak = setting.fx_trace.saved_bytes, setting.fx_trace.peak_without_offload
    return [
        *((f"{f:.0%} of saved", int(f * saved)) for f in (0.7, 0.5, 0.3)),
        ("50% of peak", int(0.5 * peak)),
        ("torchtitan's peak", setting.titan.peak_bytes),
    ]


def row(name: str, setting: Setting, label: str, budget: int) -> dict[str, Any]:
    compute = setting.compute_s
    default, region = setting.default(budget), setting.region(budget)
    bound = setting.lower_bound(budget)
    out: dict[str, Any] = {
        "bench": "peers", "model": name, "link_gbps": setting.gbps, "budget": label,
        "budget_gib": round(budget / GIB, 3), "compute_ms": round(compute * 1e3, 2),
        "saved_gib": round(setting.fx_trace.saved_bytes / GIB, 3),
        "peak_without_offload_gib": round(setting.fx_trace.peak_without_offload / GIB, 3),
        "floor_peak_gib": round(setting.floor_peak / GIB, 3),
        **default.fields("default", compute), **region.fields("region", compute),
        **setting.titan.fields("torchtitan", compute), **setting.aot.fields("torch_aot", compute),
        "torchtitan_not_expressible": setting.titan_skipped,
        "torch_aot_not_expressible": setting.aot_skipped,
        "lower_bound_ms": round(bound * 1e3, 3),
        "default_over_region_moved": _ratio(default.moved_bytes, region.moved_bytes),
        "default_over_region_stall": _ratio(default.stall_s, region.stall_s),
        "default_over_lower_bound": _ratio(default.stall_s, bound),
        "predicted": True,
    }
    if label == "torchtitan's peak":
        titan = setting.titan
        out["default_over_torchtitan_stall"] = _ratio(default.stall_s, titan.stall_s)
        out["default_over_torchtitan_moved"] = _ratio(default.moved_bytes, titan.moved_bytes)
        out["target_met"] = (default.stall_s <= max(0.7 * titan.stall_s, 1.1 * bound) + 1e-12
                             and default.moved_bytes <= titan.moved_bytes)
    elif label == "50% of peak":
        out["target_met"] = default.stall_s <= 1.1 * bound + 1e-12
    else:
        out["target_met"] = (default.moved_bytes <= region.moved_bytes
                             and default.stall_s <= region.stall_s + 1e-12)
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else (1.0 if a == 0 else None)


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | link | budget | default: moved GiB, stall % | region: moved, stall % | "
            "torchtitan: moved, stall %, peak GiB | torch AOT: moved, stall %, peak GiB | "
            "lower bound % |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        bound = 100 * r["lower_bound_ms"] / r["compute_ms"]
        lines.append(
            f"| {r['model'].split('_seq')[0]} | {r['link_gbps']:g} GB/s | {r['budget']} "
            f"({r['budget_gib']:.2f} GiB) | {r['default_moved_gib']:.2f}, "
            f"{r['default_stall_pct']:.1f} | {r['region_moved_gib']:.2f}, "
            f"{r['region_stall_pct']:.1f} | {r['torchtitan_moved_gib']:.2f}, "
            f"{r['torchtitan_stall_pct']:.1f}, {r['torchtitan_peak_gib']:.2f} | "
            f"{r['torch_aot_moved_gib']:.2f}, {r['torch_aot_stall_pct']:.1f}, "
            f"{r['torch_aot_peak_gib']:.2f} | {bound:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--links", type=float, nargs="+", default=[50.0, 25.0])
    parser.add_argument("--table", action="store_true", help="also print the Markdown table")
    parser.add_argument("--search", action="store_true",
                        help="the recompute search on Llama-3-8B, 32 x 32K (peers_search.py)")
    args, rest = parser.parse_known_args()
    if args.search:
        from peers_search import main as search_main

        search_main(rest)
        return
    rows = []
    for name in args.models:
        started = time.perf_counter()
        graphs = capture(*MODELS[name]())
        print(f"# {name}: captured in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        for gbps in args.links:
            setting = Setting(graphs, gbps)
            for label, budget in budgets(setting):
                rows.append(row(name, setting, label, budget))
                print(json.dumps(rows[-1]), flush=True)
    if args.table:
        print(table(rows))


if __name__ == "__main__":
    main()
