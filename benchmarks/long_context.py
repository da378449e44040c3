"""The long-context table (issue 44, item 5): the longest sequence Llama-3-8B trains at,
and the step's stall, on an 80 GiB device of an 8-rank node (all figures *predicted*).

    .venv/bin/python benchmarks/long_context.py                 # both links (see runtime)
    .venv/bin/python benchmarks/long_context.py --links 25 --grid 16384,32768

Setup (one rank of eight): Llama-3-8B (``examples/llama_model.py``, 32 layers, bf16,
batch 1) with its loss in 16 checkpointed chunks; the model FSDP-sharded 8 ways
(fp32 master weights, fp32 gradients and Adam's two fp32 moments: 16 B per parameter,
an eighth per rank, plus the bf16 working copies of two blocks and of the LM head,
unsharded while they run); the rest of the 80 GiB is the activation budget. Eight ranks
share 1 TiB of host RAM: 128 GiB per rank for the activations a plan moves.

Every row is computed the same way: ``hyper_offload.estimate`` (one step on fake
tensors through the compile backend, Inductor's graphs, the one timeline/cost model,
ops priced at :data:`PRICES`, blocks compiled per block: ``layout="auto"``):

* ``plain``: no offload, no checkpointing: fits when the step's peak without offload
  is within the budget (no stall);
* ``full_ac``: every layer under ``torch.utils.checkpoint`` (saves its input, recomputes
  its forward in the backward), no offload: fits when its peak is within the budget;
* ``offload``: offload only (``recompute="off"``): fits when the plan meets the device
  budget and moves at most the host budget;
* ``default``: our default (offload + ``recompute="auto"``) under both budgets. Every
  estimate gets ``max_host_activation_mb`` = 128 GiB (the node's share, never the
  running machine's node view), so the step plan keeps the host budget and its
  recompute search recomputes where the host binds; where that is not enough (the plan
  still keeps slots on the device past its budget because the host has no room), the
  first ``k`` layers are checkpointed whole, ``k`` grown until the plan fits.

A row's ``longest_seq`` is the longest sequence of ``--grid`` that fits (a binary
search over the grid: fitting is monotone in the length), ``next_seq_in_grid`` the
first that does not; ``stall_share`` is its predicted stall over its predicted compute
(recomputation included), ``within_stall_share`` whether that is at most 10%. Runtime: about 40 s per
estimate on 2 loaded cores without the recompute search and up to ~3 min with it; the
whole table (both links, the default grid) took the time its last line reports.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hyper_offload  # noqa: E402
from hyper_offload.passes.fx.cost_model import DeviceThroughput  # noqa: E402
from llama_model import LLAMA3_8B, llama3_8b  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
DEVICE_BYTES = 80 * GIB
RANKS = 8
HOST_BYTES = (1 << 40) // RANKS
LAYERS = 32
LOSS_CHUNKS = 16
PRICES = DeviceThroughput(flops_per_s=400e12, bytes_per_s=2.6e12)
"""An H100 at about 40% of its dense bf16 peak and 80% of its HBM bandwidth."""
STALL_SHARE = 0.10
GRID = (8192, 16384, 32768, 49152, 65536, 98304, 114688, 131072, 163840, 196608, 229376,
        262144, 393216, 524288)
MODES = ("plain", "full_ac", "offload", "default")


def model_state_bytes() -> int:
    """Device bytes per rank the model itself takes (module docstring)."""
    model = llama3_8b(layers=1)
    block = sum(p.numel() for p in model.layers[0].parameters())
    head = LLAMA3_8B.vocab * LLAMA3_8B.dim
    total = block * LAYERS + sum(p.numel() for n, p in model.named_parameters()
                                 if not n.startswith("layers."))
    return 16 * total // RANKS + 2 * (2 * block + head)


def _estimate(seq: int, link: float, budget_mb: float, *, checkpoint: int,
              recompute: str) -> dict[str, Any]:
    model = llama3_8b(LAYERS, LOSS_CHUNKS, checkpoint_layers=checkpoint,
                      max_seq_len=max(seq, LLAMA3_8B.max_seq_len))
    tokens = torch.empty(1, seq, dtype=torch.int64, device="meta")
    # Each estimate as in a fresh process (the table was measured so; the estimate now
    # compiles with static sizes, which fixed what made a later estimate in one process
    # differ: an 8B x 32K floor of 60.4 GiB after a 16K estimate, instead of 7.6).
    torch._dynamo.reset()
    started = time.perf_counter()
    report = hyper_offload.estimate(
        model, (tokens, tokens), budget=budget_mb, device="cpu", bandwidth=link,
        throughput=PRICES, recompute=recompute,
        max_host_activation_mb=HOST_BYTES / MIB,  # the node's share, not this machine's
    )
    step = report.step
    assert step is not None
    found = {
        "seq": seq, "link_gbps": link, "checkpoint_layers": checkpoint, "recompute": recompute,
        "peak_without_offload_bytes": step.peak_without_offload_bytes,
        "floor_bytes": step.floor_peak_bytes, "peak_bytes": step.peak_bytes,
        "fits_device": step.fits, "host_bytes": step.moved_bytes, "binding": step.binding,
        "stall_s": step.predicted_stall_s, "compute_s": report.step_compute_s,
        "budget_mb": budget_mb, "layout": report.layout,
        "estimate_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(found), file=sys.stderr, flush=True)
    return found


class Table:
    """The estimates of one link, cached (plain and offload share one); ``shared``: the
    full-checkpointing estimates, which move nothing where they fit, for every link."""

    def __init__(self, link: float, budget_mb: float, shared: dict[Any, Any],
                 saved: Path | None = None) -> None:
        self.link, self.budget_mb = link, budget_mb
        self._cache: dict[tuple[int, int, str], dict[str, Any]] = {}
        self._shared = shared
        self._saved = saved
        if saved is not None and saved.exists():  # --cache: resume an interrupted run
            for line in saved.read_text().splitlines():
                found = json.loads(line)
                key = (found["seq"], found["checkpoint_layers"], found["recompute"])
                if found["link_gbps"] == link and found["budget_mb"] == budget_mb:
                    self._cache[key] = found
                if key[1:] == (LAYERS, "off") and found["budget_mb"] == budget_mb:
                    shared.setdefault(key, found)

    def at(self, seq: int, checkpoint: int = 0, recompute: str = "off") -> dict[str, Any]:
        key = (seq, checkpoint, recompute)
        cache = self._shared if checkpoint == LAYERS and recompute == "off" else self._cache
        if key not in cache:
            cache[key] = _estimate(seq, self.link, self.budget_mb, checkpoint=checkpoint,
                                   recompute=recompute)
            if self._saved is not None:
                with self._saved.open("a") as out:
                    out.write(json.dumps(cache[key]) + "\n")
        return cache[key]

    def probe(self, mode: str, seq: int) -> dict[str, Any] | None:
        """The estimate of ``mode`` at ``seq`` if it fits, else None."""
        budget = self.budget_mb * MIB
        if mode in ("plain", "full_ac"):
            found = self.at(seq, LAYERS if mode == "full_ac" else 0)
            return found if found["peak_without_offload_bytes"] <= budget else None
        if mode == "offload":
            found = self.at(seq)
            return found if found["fits_device"] and found["host_bytes"] <= HOST_BYTES else None
        return self._default(seq)

    def _default(self, seq: int) -> dict[str, Any] | None:
        """Our default under both budgets: ``k`` checkpointed first layers, where its
        plan would move more than the host budget (module docstring). ``k`` starts from
        the offload-only plan's bytes per layer at ``seq`` (no search: cheap), and grows
        until the default's own plan moves at most the host budget."""
        offload = self.at(seq)
        excess = offload["host_bytes"] - HOST_BYTES
        per_layer = max(offload["host_bytes"] // LAYERS, 1)
        # A checkpointed layer still moves its input: one more layer than the bytes say.
        checkpoint = 0 if excess <= 0 else min(LAYERS, math.ceil(excess / per_layer) + 1)
        while True:
            found = self.at(seq, checkpoint, "auto")
            host_bound = found.get("binding") in ("host", "both")
            if not found["fits_device"] and not host_bound:
                return None  # the device alone: checkpointing more cannot help here
            excess = found["host_bytes"] - HOST_BYTES
            if found["fits_device"] and excess <= 0:
                return found
            if checkpoint == LAYERS:
                return None
            excess = max(excess, per_layer)  # the host kept slots on the device: one more
            per_layer = max(found["host_bytes"] // LAYERS, 1)
            checkpoint = min(LAYERS, checkpoint + max(1, math.ceil(excess / per_layer)))


def _row(mode: str, link: float, table: Table, grid: tuple[int, ...],
         start: int = 0) -> dict[str, Any]:
    """The longest sequence of ``grid`` at which ``mode`` fits: a binary search over the
    grid (fitting is monotone in the length: every byte grows with it) from index
    ``start`` (a length known to fit)."""
    best: dict[str, Any] | None = None
    lo, hi = start, len(grid) - 1
    while lo <= hi:
        middle = (lo + hi) // 2
        found = table.probe(mode, grid[middle])
        if found is None:
            hi = middle - 1
        else:
            best, lo = found, middle + 1
    row: dict[str, Any] = {
        "benchmark": "long_context", "label": "predicted", "mode": mode, "link_gbps": link,
        "device_gib": DEVICE_BYTES / GIB, "activation_budget_mib": round(table.budget_mb, 1),
        "host_gib_per_rank": HOST_BYTES / GIB, "longest_seq": best and best["seq"],
        "next_seq_in_grid": grid[lo] if lo < len(grid) else None, "grid": list(grid),
    }
    if best is not None:
        moves = mode not in ("plain", "full_ac")
        stall = best["stall_s"] if moves else 0.0
        row.update(
            stall_s=round(stall, 4), compute_s=round(best["compute_s"], 4),
            stall_share=round(stall / best["compute_s"], 4) if best["compute_s"] else None,
            within_stall_share=bool(stall <= STALL_SHARE * best["compute_s"]),
            checkpoint_layers=best["checkpoint_layers"],
            device_peak_bytes=best["peak_bytes"] if moves else best["peak_without_offload_bytes"],
            host_bytes=best["host_bytes"] if moves else 0,
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", type=float, nargs="+", default=[25.0, 50.0])
    parser.add_argument("--grid", default=",".join(map(str, GRID)),
                        help="sequence lengths to walk, ascending, comma-separated")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--cache", type=Path, default=None,
                        help="JSON lines of estimates to reuse and extend (resume a run)")
    args = parser.parse_args()
    grid = tuple(int(s) for s in args.grid.split(","))
    started = time.perf_counter()
    state = model_state_bytes()
    budget_mb = (DEVICE_BYTES - state) / MIB
    shared: dict[Any, Any] = {}
    for link in args.links:
        table = Table(link, budget_mb, shared, args.cache)
        rows: dict[str, dict[str, Any]] = {}
        for mode in args.modes.split(","):
            # Our default is offload plus recompute: it fits wherever offload alone does.
            known = rows.get("offload", {}).get("longest_seq")
            start = grid.index(known) if mode == "default" and known in grid else 0
            row = rows[mode] = _row(mode, link, table, grid, start)
            row["model_state_bytes_per_rank"] = state
            print(json.dumps(row), flush=True)
    print(json.dumps({"benchmark": "long_context", "label": "measured",
                      "runtime_s": round(time.perf_counter() - started)}), flush=True)


if __name__ == "__main__":
    main()
