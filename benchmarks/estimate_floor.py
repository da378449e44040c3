"""What sets a long-context step's floor: Llama-3-8B-shaped steps estimated on fake tensors,
compiled whole or block by block (the LM head and the loss then run eagerly), with the
loss whole or in checkpointed chunks. One JSON line per run; figures are *predicted*
(wall seconds measured).

    .venv/bin/python benchmarks/estimate_floor.py --layers 4 --seq 131072 --per-block
    .venv/bin/python benchmarks/estimate_floor.py --layers 4 --seq 131072 --per-block --loss-chunks 16
    .venv/bin/python benchmarks/estimate_floor.py --layers 4 --seq 131072          # compiled whole

Each line: the floor (``min_feasible_budget_bytes``), the floor of the compiled regions
alone (what the estimate reported before it counted the eager code between regions:
the per-block 4 x 128K step "fit" 57,344 MiB), the op that sets the floor and its own
bytes, whether the budget fits, and the wall seconds of the estimate.

The host budget is explicit (``--host-budget-mb``, default 131,072 MiB: one rank's share
of a 1 TiB, 8-rank node), never the node view of the machine that runs the benchmark:
where the host binds, ``recompute="auto"`` trades host bytes for recompute, which raises
the floor (measured: 4 layers x 128K, 16 chunks, with this 24 GiB machine's own view the
floor is 33,792.5 MiB instead of 31,744), so the figures would depend on that machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hyper_offload  # noqa: E402
from llama_model import llama3_8b  # noqa: E402

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--loss-chunks", type=int, default=1)
    parser.add_argument("--per-block", action="store_true",
                        help="torch.compile each block on its own (FSDP2's layout)")
    parser.add_argument("--budget-mb", type=float, default=57344)
    parser.add_argument("--bandwidth-gbps", type=float, default=25.0)
    parser.add_argument("--host-budget-mb", type=float, default=131072.0)
    args = parser.parse_args()
    model = llama3_8b(layers=args.layers, loss_chunks=args.loss_chunks)
    if args.per_block:
        for index, block in enumerate(model.layers):
            model.layers[index] = torch.compile(block)
    tokens = torch.empty(1, args.seq, dtype=torch.int64, device="meta")
    started = time.perf_counter()
    report = hyper_offload.estimate(model, (tokens, tokens), budget=args.budget_mb,
                                    device="cpu", bandwidth=args.bandwidth_gbps,
                                    max_host_activation_mb=args.host_budget_mb)
    seconds = time.perf_counter() - started
    print(report.summary(), file=sys.stderr)
    step = report.step
    print(json.dumps({
        "benchmark": "estimate_floor", "layers": args.layers, "seq": args.seq,
        "loss_chunks": args.loss_chunks, "per_block": args.per_block,
        "budget_mib": args.budget_mb, "host_budget_mib": args.host_budget_mb, "fits": report.fits,
        "floor_mib": report.min_feasible_budget_bytes / MIB,
        "regions_floor_mib": None if step.regions_floor_bytes is None
        else step.regions_floor_bytes / MIB,
        "floor_op": report.floor_op.op, "floor_op_mib": report.floor_op.op_bytes / MIB,
        "floor_op_eager": report.floor_op.region is None,
        "peak_without_offload_mib": report.peak_without_offload / MIB,
        "wall_s": round(seconds, 1),
    }))


if __name__ == "__main__":
    main()
