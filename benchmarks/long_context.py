"""The long-context table (issue 50, item 5): the longest sequence Llama-3-8B trains at on
one rank of an 8-rank node at <= 10% predicted stall, and what stops it (all figures
*predicted*; ALST's are *published*, theirs, beside ours).

    .venv/bin/python benchmarks/long_context.py                 # both links (see runtime)
    .venv/bin/python benchmarks/long_context.py --links 25 --modes default --grid 229376,262144

Setup (one rank of eight): Llama-3-8B (``examples/llama_model.py``, 32 layers, bf16,
batch 1) with its LM head and loss in checkpointed chunks of 8K tokens (16 chunks up to
128K; the model is the same in every row); the model FSDP-sharded 8 ways (fp32 master
weights, fp32 gradients and Adam's two fp32 moments: 16 B per parameter, an eighth per
rank, plus the bf16 working copies of two blocks and of the LM head, unsharded while
they run); the rest of the 80 GiB is the activation budget. Eight ranks share 1 TiB of
host RAM: 128 GiB per rank for the activations a plan moves; a disk tier of 2 TB per
rank at 6 GB/s (``--modes default_disk``: used once the backend has
``max_disk_activation_mb``, issue 50 item 3; until then its row says so).

Every row is ``hyper_offload.estimate`` (one step on fake tensors through the compile
backend, Inductor's graphs, the one timeline/cost model, ops priced at :data:`PRICES`,
blocks compiled per block: ``layout="auto"``); ``max_host_activation_mb`` is the node's
share (128 GiB), never the running machine's node view:

* ``plain``: no offload, no checkpointing: its step's peak without offload fits;
* ``full_ac``: every layer under ``torch.utils.checkpoint``, no offload: its peak fits;
* ``full_ac_offload``: every layer checkpointed by hand and its saved input moved to the
  host by the offload planner (``recompute="off"``): ALST's pattern;
* ``offload``: offload only (``recompute="off"``), nothing checkpointed;
* ``default``: our default (offload + ``recompute="auto"``), nothing checkpointed by
  hand: the planner chooses what to keep, move or recompute, op by op (exact);
* ``default_disk``: the same with the disk tier; ``default_tiled``: with sequence tiling
  (issue 50 item 2, not exact): rows that say "pending" until those land.

A mode fits at a length when its plan meets the device budget and moves at most the
host budget, and is predicted to stall at most 10% of its compute (recomputation
included). A row's ``longest_seq`` is the longest length of ``--grid`` that fits (a
binary search: fitting is taken to be monotone in the length), ``next_seq_in_grid`` the
first that does not, and ``stops_at`` what stops it there: the binding budget, the floor
and what is on the device at the floor's op (``floor_detail``).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hyper_offload  # noqa: E402
from hyper_offload.compiler.options import BackendOptions  # noqa: E402
from hyper_offload.passes.fx.cost_model import DeviceThroughput  # noqa: E402
from llama_model import LLAMA3_8B, llama3_8b  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
DEVICE_BYTES = 80 * GIB
RANKS = 8
HOST_BYTES = (1 << 40) // RANKS
DISK_BYTES = 2 * 10 ** 12
DISK_GBPS = 6.0
LAYERS = 32
LOSS_CHUNK_TOKENS = 8192
PRICES = DeviceThroughput(flops_per_s=400e12, bytes_per_s=2.6e12)
"""An H100 at about 40% of its dense bf16 peak and 80% of its HBM bandwidth."""
STALL_SHARE = 0.10
GRID = (8192, 16384, 32768, 49152, 65536, 98304, 114688, 131072, 163840, 196608, 229376,
        262144, 327680, 393216, 524288, 786432, 1048576)
MODES = ("plain", "full_ac", "full_ac_offload", "offload", "default", "default_disk",
         "default_tiled")
PUBLISHED = (
    ("ALST: Llama-3.1-8B, 1 x H100 80GB", 500_000, 1),
    ("ALST: Llama-3.1-8B, 1 x H200 141GB", 1_200_000, 1),
    ("ALST: Llama-3.1-8B, 8 x H100 80GB, Ulysses sequence parallel", 3_700_000, 8),
)
"""Arctic Long Sequence Training (arXiv 2506.13996): sequence length, GPUs. Theirs:
weights and optimizer on the host, tiled MLP and loss, checkpointed-layer inputs on the
host, by hand; not measured or predicted here."""


def loss_chunks(seq: int) -> int:
    """The LM head and loss in chunks of :data:`LOSS_CHUNK_TOKENS` (at least 16)."""
    return max(16, -(-seq // LOSS_CHUNK_TOKENS))


def model_state_bytes() -> int:
    """Device bytes per rank the model itself takes (module docstring)."""
    model = llama3_8b(layers=1)
    block = sum(p.numel() for p in model.layers[0].parameters())
    head = LLAMA3_8B.vocab * LLAMA3_8B.dim
    total = block * LAYERS + sum(p.numel() for n, p in model.named_parameters()
                                 if not n.startswith("layers."))
    return 16 * total // RANKS + 2 * (2 * block + head)


def disk_tier() -> dict[str, Any] | None:
    """The backend options of the disk tier, or None while the backend has none."""
    fields = {f.name for f in dataclasses.fields(BackendOptions)}
    if "max_disk_activation_mb" not in fields:
        return None
    options: dict[str, Any] = {"max_disk_activation_mb": DISK_BYTES / MIB}
    if "disk_bandwidth_gbps" in fields:
        options["disk_bandwidth_gbps"] = DISK_GBPS
    return options


def _estimate(seq: int, link: float, budget_mb: float, *, checkpoint: int, recompute: str,
              disk: bool = False) -> dict[str, Any]:
    model = llama3_8b(LAYERS, loss_chunks(seq), checkpoint_layers=checkpoint,
                      max_seq_len=max(seq, LLAMA3_8B.max_seq_len))
    tokens = torch.empty(1, seq, dtype=torch.int64, device="meta")
    # Each estimate as in a fresh process (the estimate compiles with static sizes).
    torch._dynamo.reset()
    started = time.perf_counter()
    report = hyper_offload.estimate(
        model, (tokens, tokens), budget=budget_mb, device="cpu", bandwidth=link,
        throughput=PRICES, recompute=recompute,
        max_host_activation_mb=HOST_BYTES / MIB,  # the node's share, not this machine's
        **((disk_tier() or {}) if disk else {}),
    )
    step = report.step
    assert step is not None
    found = {
        "seq": seq, "link_gbps": link, "checkpoint_layers": checkpoint, "recompute": recompute,
        "disk": disk, "loss_chunks": loss_chunks(seq),
        "peak_without_offload_bytes": step.peak_without_offload_bytes,
        "floor_bytes": step.floor_peak_bytes, "peak_bytes": step.peak_bytes,
        "fits_device": step.fits, "host_bytes": step.moved_bytes,
        "peak_host_bytes": step.peak_host_bytes, "disk_bytes": getattr(step, "disk_bytes", None),
        "binding": step.binding, "stall_s": step.predicted_stall_s,
        "compute_s": report.step_compute_s, "budget_mb": budget_mb, "layout": report.layout,
        "floor_op": report.floor_explained,
        "floor_detail": None if report.floor_detail is None else report.floor_detail.describe(),
        "estimate_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(found), file=sys.stderr, flush=True)
    return found


_SETUPS = {  # mode: (checkpointed layers, recompute, disk)
    "plain": (0, "off", False), "full_ac": (LAYERS, "off", False),
    "full_ac_offload": (LAYERS, "off", False), "offload": (0, "off", False),
    "default": (0, "auto", False), "default_disk": (0, "auto", True),
}


class Table:
    """The estimates of one link, cached (modes that share a setup share them; ``plain``
    and ``full_ac`` read no figure a link changes, so every link shares theirs:
    ``unlinked``), and resumable from a ``--cache`` file of earlier estimates."""

    def __init__(self, link: float, budget_mb: float, unlinked: dict[Any, Any],
                 saved: Path | None = None) -> None:
        self.link, self.budget_mb = link, budget_mb
        self._cache: dict[tuple[int, int, str, bool], dict[str, Any]] = {}
        self._unlinked = unlinked
        self._saved = saved
        if saved is not None and saved.exists():  # --cache: resume an interrupted run
            for line in saved.read_text().splitlines():
                found = json.loads(line)
                if found["budget_mb"] == budget_mb:
                    key = (found["seq"], found["checkpoint_layers"], found["recompute"],
                           found.get("disk", False))
                    if found["link_gbps"] == link:
                        self._cache[key] = found
                    unlinked.setdefault(key, found)

    def at(self, seq: int, mode: str) -> dict[str, Any]:
        checkpoint, recompute, disk = _SETUPS[mode]
        key = (seq, checkpoint, recompute, disk)
        if mode in ("plain", "full_ac") and key in self._unlinked:
            return self._unlinked[key]
        if key not in self._cache:
            self._cache[key] = _estimate(seq, self.link, self.budget_mb, checkpoint=checkpoint,
                                         recompute=recompute, disk=disk)
            if self._saved is not None:
                with self._saved.open("a") as out:
                    out.write(json.dumps(self._cache[key]) + "\n")
            self._unlinked.setdefault(key, self._cache[key])
        return self._cache[key]

    def fits(self, mode: str, found: dict[str, Any]) -> bool:
        """Whether ``found`` (an estimate of ``mode``) fits, within the stall share."""
        if mode in ("plain", "full_ac"):  # nothing moves: the step as it is
            return found["peak_without_offload_bytes"] <= self.budget_mb * MIB
        return (found["fits_device"] and found["host_bytes"] <= HOST_BYTES
                and found["stall_s"] <= STALL_SHARE * found["compute_s"])


def _row(mode: str, link: float, table: Table, grid: tuple[int, ...],
         start: int = 0) -> dict[str, Any]:
    """The longest length of ``grid`` at which ``mode`` fits: a binary search over the
    grid from index ``start`` (a length known to fit)."""
    best: dict[str, Any] | None = None
    lo, hi = start, len(grid) - 1
    while lo <= hi:
        middle = (lo + hi) // 2
        found = table.at(grid[middle], mode)
        if not table.fits(mode, found):
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
            checkpoint_layers=best["checkpoint_layers"], loss_chunks=best["loss_chunks"],
            device_peak_bytes=best["peak_bytes"] if moves else best["peak_without_offload_bytes"],
            host_bytes=best["host_bytes"] if moves else 0,
            peak_host_bytes=best["peak_host_bytes"] if moves else 0,
            disk_bytes=best["disk_bytes"] if moves else 0,
        )
    if lo < len(grid):  # what stops it at the next length (estimated by the search)
        stop = table.at(grid[lo], mode)
        row["stops_at"] = {k: stop[k] for k in (
            "seq", "peak_without_offload_bytes", "fits_device", "binding", "floor_bytes",
            "host_bytes", "stall_s", "compute_s", "floor_op", "floor_detail")}
    return row


def _pending(mode: str, link: float, why: str) -> dict[str, Any]:
    return {"benchmark": "long_context", "label": "predicted", "mode": mode, "link_gbps": link,
            "longest_seq": None, "pending": why}


def published_rows() -> list[dict[str, Any]]:
    """ALST's published figures (:data:`PUBLISHED`), labelled as theirs."""
    return [{"benchmark": "long_context", "label": "published (theirs: ALST, arXiv 2506.13996)",
             "setup": setup, "longest_seq": seq, "gpus": gpus,
             "longest_seq_per_gpu": seq // gpus} for setup, seq, gpus in PUBLISHED]


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
    unlinked: dict[Any, Any] = {}
    for link in args.links:
        table = Table(link, budget_mb, unlinked, args.cache)
        for mode in args.modes.split(","):
            if mode == "default_tiled":
                row = _pending(mode, link, "sequence tiling (issue 50 item 2) not built yet")
            elif mode == "default_disk" and disk_tier() is None:
                row = _pending(mode, link, "no disk tier in this backend yet (issue 50 item 3: "
                               "max_disk_activation_mb)")
            else:
                row = _row(mode, link, table, grid)
                row["model_state_bytes_per_rank"] = state
            print(json.dumps(row), flush=True)
    for row in published_rows():
        print(json.dumps(row), flush=True)
    print(json.dumps({"benchmark": "long_context", "label": "measured",
                      "runtime_s": round(time.perf_counter() - started)}), flush=True)


if __name__ == "__main__":
    main()
