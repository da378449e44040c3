"""One Llama-3-8B block's backward at a long sequence: its floor (everything movable moved)
and predicted compute under each way of recomputing, and what is on the device at the
floor's op. One JSON line per backward; figures are *predicted* (fake tensors, CPU
kernels, Inductor's decompositions and partitions, ops priced as an H100).

    .venv/bin/python benchmarks/long_context_floor.py --seq 229376
    .venv/bin/python benchmarks/long_context_floor.py --seq 393216 --link-gbps 50

Backwards: torch's default partition (offload only), torch's ``activation_memory_budget=0``
partition, and the spliced backward with every option recomputed, op by op, holding what
costs more to recompute than to reload (``held``), holding every option (how chains
read each other before op-granular recompute: every dropped value a chain needed was
materialized there and held to its own readers), holding nothing (an attention
recomputed for each op that needs its output early), and holding with a stage barrier at
the op where the first peaks (the search's last resort: nothing recomputed before it is
alive there, and each stage recomputes an attention once). The block's input is an activation input (the planner may move it), as in the
per-block step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch._functorch import config as functorch_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.llama_model import LLAMA3_8B, Block  # noqa: E402
from hyper_offload.compiler.recompute import splice as rs  # noqa: E402
from hyper_offload.compiler.fake_capture import capture_graphs  # noqa: E402
from hyper_offload.compiler.recompute.candidates import copy_joint  # noqa: E402
from hyper_offload.compiler.recompute.rules import unrepeatable  # noqa: E402
from hyper_offload.passes.fx.cost_model import DeviceThroughput, node_seconds  # noqa: E402
from hyper_offload.passes.fx.fx_trace import floor_detail  # noqa: E402
from hyper_offload.passes.fx.fx_trace import FxTrace  # noqa: E402
from hyper_offload.passes.fx.graph_trace import build_fx_trace  # noqa: E402

PRICES = DeviceThroughput(flops_per_s=400e12, bytes_per_s=2.6e12)


class _Block(torch.nn.Module):
    def __init__(self, seq: int) -> None:
        super().__init__()
        with torch.device("meta"):
            self.block = Block(replace(LLAMA3_8B, max_seq_len=max(seq, 131072))).to(torch.bfloat16)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.block(x, cos, sin)


def _graphs(seq: int) -> dict[str, Any]:
    got: dict[str, Any] = {}

    def hook(joint: Any, stock: Any, num_fwd_outputs: int) -> Any:
        pristine = copy_joint(joint)
        fw, bw = stock(joint)
        with functorch_config.patch(activation_memory_budget=0.0):
            got["zero"] = stock(copy_joint(pristine))
        got.update(default=(fw, bw), n=num_fwd_outputs)
        return fw, bw

    x = torch.empty(1, seq, LLAMA3_8B.dim, dtype=torch.bfloat16, device="meta", requires_grad=True)
    half = LLAMA3_8B.dim // LLAMA3_8B.heads // 2
    table = [torch.empty(seq, half, device="meta") for _ in range(2)]
    capture_graphs(_Block(seq), (x, *table), device=torch.device("cpu"), partition=hook)
    return got


def _floor(fx_trace: FxTrace) -> tuple[int, str]:
    """The floor of the backward (each storage from its first backward access to its
    last; everything movable moved across the forward/backward gap) and its op."""
    trace, split = fx_trace.trace, fx_trace.num_fw_ops
    curve = [0] * trace.num_ops
    for sid in trace.accessed_storages():
        backward = [i for i, _ in trace.accesses_of(sid) if i >= split]
        for i in range(backward[0], backward[-1] + 1) if backward else ():
            curve[i] += trace.storage_sizes[sid]
    at = max(range(split, trace.num_ops), key=lambda i: curve[i])
    return curve[at], trace.ops[at].name


def _row(name: str, fw: Any, bw: Any, n: int, x: str, seq: int) -> dict[str, Any]:
    fx_trace = build_fx_trace(fw, bw, num_fwd_outputs=n, activation_inputs=frozenset({x}),
                              throughput=PRICES)
    floor, op = _floor(fx_trace)
    kept = sum(fx_trace.trace.storage_sizes[s] for s in {*fx_trace.movable(), *fx_trace.kept()})
    detail = floor_detail(fx_trace, op, least_bytes=1 << 28, graphs=(fw, bw))
    return {
        "benchmark": "long_context_floor", "label": "predicted", "seq": seq, "backward": name,
        "floor_bytes": floor, "floor_op": op, "compute_s": round(sum(
            o.duration_s or 0 for o in fx_trace.trace.ops), 4),
        "saved_bytes_besides_input": kept - fx_trace.trace.storage_sizes.get(
            fx_trace.node_storage[f"fw:{x}"], 0) * (fx_trace.node_storage[f"fw:{x}"] in
                                                    fx_trace.movable()),
        "floor_detail": detail.describe(held=8),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=229376)
    parser.add_argument("--link-gbps", type=float, default=25.0)
    args = parser.parse_args()
    started = time.perf_counter()
    got = _graphs(args.seq)
    (fw, bw), (_, zero_bw) = got["default"], got["zero"]
    x = next(n.name for n in fw.graph.find_nodes(op="placeholder")
             if n.meta["val"].shape[-2:] == (args.seq, LLAMA3_8B.dim))
    options = rs.recompute_order(rs.splice_options(
        fw, bw, zero_bw, unrepeatable=unrepeatable,
        seconds=partial(node_seconds, throughput=PRICES)))
    held = rs.held_options(options, args.link_gbps)
    rows = [_row("default partition (offload only)", fw, bw, got["n"], x, args.seq),
            _row("budget-0 partition", *got["zero"], got["n"], x, args.seq)]
    for name, hold in (
        ("spliced, every option, held: " + ", ".join(sorted(held)), held),
        ("spliced, every option held (as before op by op)", frozenset(o.name for o in options)),
        ("spliced, every option, nothing held", frozenset()),
    ):
        rows.append(_row(name, *rs.splice(fw, bw, zero_bw, options, hold), got["n"], x, args.seq))
    op = rows[2]["floor_op"].split(":", 1)[1]  # where the op-by-op splice peaks
    rows.append(_row(f"spliced, every option, held, a stage barrier at {op} (last resort)",
                     *rs.splice(fw, bw, zero_bw, options, held, barriers={op}), got["n"], x,
                     args.seq))
    for row in rows:
        row["wall_s"] = round(time.perf_counter() - started, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
