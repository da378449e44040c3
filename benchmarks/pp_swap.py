"""Pipeline swap benchmark: per schedule and rank, peak device bytes and step time with and
without swap, measured in the same run, plus the swap pass's prediction.

Prints one JSON object per line (``"bench": "pp_swap"``) with: schedule, ranks,
micro-batches, rank, ``peak_without`` / ``peak_with`` (measured, bytes), ``drop`` (1 -
with/without), ``time_ratio`` (this rank's median step time with swap / without),
``predicted_peak_without`` / ``predicted_peak_with`` / ``predicted_drop`` (the residency
model of the order pass, fed the stage footprints ``FootprintRecorder`` measured on the
step before the metered one), ``copies_d2h`` / ``copies_h2d`` / ``moved_bytes`` (what the
swap groups issued in the metered step; ``--group-swap`` packs each group: one copy each
way per window), ``release_sends`` (sends waited once proven received, the default; off
with ``--wait-sends-at-end``) and whether losses were identical. Then one ``pp_swap.table`` line per
schedule with the worst rank.

    python benchmarks/pp_swap.py [--nproc 4] [--micro 8] [--schedules gpipe 1f1b ...]

The model is the GPT of ``examples/pipeline_swap.py`` (imported from there). On CPU copies
are synchronous and the meter is dispatch-level, so the time ratio shows the cost of the
copies, not how well they hide; run with ``--device cuda`` on a GPU machine for that.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent


def _example() -> Any:
    sys.path.insert(0, str(ROOT / "examples"))  # the example imports the shared gpt_model
    spec = importlib.util.spec_from_file_location("pipeline_swap_example", ROOT / "examples" / "pipeline_swap.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def worker(rank: int, world: int, bench: argparse.Namespace) -> None:
    example = _example()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        for schedule in bench.schedules:
            args = example.parse_args([
                "--schedule", schedule, "--micro", str(bench.micro), "--steps", str(bench.steps),
                "--transport", bench.transport, *(["--group-swap"] if bench.group_swap else []),
                *(["--wait-sends-at-end"] if bench.wait_sends_at_end else []),
            ])
            try:
                result = example.run_rank(args, rank, world, torch.device("cpu"))
                error = None
            except Exception as exc:  # report and go on with the next schedule
                result, error = {"rank": rank}, f"{type(exc).__name__}: {exc}"
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, (result, error))
            if rank == 0:
                _emit(example, schedule, world, bench, gathered)
    finally:
        dist.destroy_process_group()


def _emit(example: Any, schedule: str, world: int, bench: argparse.Namespace, gathered: list[Any]) -> None:
    rows = []
    for result, error in gathered:
        row = {"bench": "pp_swap", "schedule": schedule, "ranks": world, "micro": bench.micro, "rank": result["rank"]}
        if error is not None:
            row["error"] = error
        else:
            row.update(
                peak_without=result["peak_without"],
                peak_with=result["peak_with"],
                drop=round(1 - result["peak_with"] / result["peak_without"], 4),
                time_ratio=round(result["time_with"] / result["time_without"], 3),
                **_predicted(example, result),
                copies_d2h=result["copies"]["d2h"],
                copies_h2d=result["copies"]["h2d"],
                moved_bytes=result["copies"]["bytes"],
                group_swap=bench.group_swap,
                release_sends=not bench.wait_sends_at_end,
                losses_identical=result["losses_with"] == result["losses_without"],
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    ok = [r for r in rows if "error" not in r]
    if ok:
        print(json.dumps({
            "bench": "pp_swap.table", "schedule": schedule, "ranks": world, "micro": bench.micro,
            "min_drop": min(r["drop"] for r in ok), "max_drop": max(r["drop"] for r in ok),
            "max_time_ratio": max(r["time_ratio"] for r in ok),
            "losses_identical": all(r["losses_identical"] for r in ok),
        }), flush=True)


def _predicted(example: Any, result: dict[str, Any]) -> dict[str, Any]:
    """The residency model's peaks (footprints measured on an earlier step of the run)."""
    without, with_swap = example.predicted_peaks(result)
    return {
        "predicted_peak_without": without,
        "predicted_peak_with": with_swap,
        "predicted_drop": round(1 - with_swap / without, 4) if without else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--transport", default="plain")
    parser.add_argument("--group-swap", action="store_true", help="pack each group: one copy each way")
    parser.add_argument(
        "--wait-sends-at-end", action="store_true",
        help="baseline: wait every P2P send at the end of the step instead of once it is proven received",
    )
    parser.add_argument(
        "--schedules", nargs="+",
        default=["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"],
    )
    bench = parser.parse_args()
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    mp.spawn(worker, args=(bench.nproc, bench), nprocs=bench.nproc, join=True)


if __name__ == "__main__":
    main()
