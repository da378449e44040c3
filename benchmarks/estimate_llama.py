"""How long ``hyper_offload.estimate`` takes on Llama configs built on the meta device,
and how little memory it uses. One JSON line per config.

    .venv/bin/python benchmarks/estimate_llama.py                  # 2 layers of 7B width
    .venv/bin/python benchmarks/estimate_llama.py --layers 32      # the full 7B (minutes)
    # issue 44's check: Llama-3-8B x 128K, 32 layers, default options, <= 60 s, <= 1 GiB
    .venv/bin/python benchmarks/estimate_llama.py --config llama3_8b --layers 32 \
        --seq 131072 --budget-mb 57344 --max-wall-s 60 --max-rss-gib 1

Each line: layers, sequence length, wall seconds (trace + plan), the process's RSS growth
(``ru_maxrss`` minus the RSS before the call) against the parameters' bytes, and the
report's figures. RSS growth far below the parameter bytes shows nothing was allocated.
``--max-wall-s`` / ``--max-rss-gib`` make it a check: exit 1 when the estimate took longer
or the process's peak RSS (``ru_maxrss``, imports included) was higher. Timed checks
belong here, not in the tests (the machine running them is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hyper_offload  # noqa: E402
from llama_model import LLAMA3_8B, LLAMA_7B, Llama  # noqa: E402

CONFIGS = {"llama_7b": LLAMA_7B, "llama3_8b": LLAMA3_8B}


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--budget-mb", type=float, default=16384)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="llama_7b")
    parser.add_argument("--loss-chunks", type=int, default=1)
    parser.add_argument("--layout", default="auto", help="estimate's layout= (default auto)")
    parser.add_argument("--max-wall-s", type=float, default=None)
    parser.add_argument("--max-rss-gib", type=float, default=None)
    args = parser.parse_args()
    config = replace(CONFIGS[args.config], layers=args.layers, loss_chunks=args.loss_chunks)
    with torch.device("meta"):
        model = Llama(config).to(torch.bfloat16)
    tokens = torch.empty(1, args.seq, dtype=torch.int64, device="meta")
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    before = _rss_bytes()
    started = time.perf_counter()
    report = hyper_offload.estimate(model, (tokens, tokens), budget=args.budget_mb,
                                    layout=args.layout)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grown = peak - before
    print(report.summary(), file=sys.stderr)
    print(json.dumps({
        "benchmark": "estimate_llama", "config": args.config, "layers": args.layers,
        "seq": args.seq, "loss_chunks": args.loss_chunks, "wall_s": round(seconds, 2),
        "max_rss_bytes": peak, "rss_growth_bytes": grown, "parameter_bytes": param_bytes,
        "rss_growth_over_parameters": round(grown / param_bytes, 4),
        "load_average_1m": os.getloadavg()[0], **report.to_dict(),
    }))
    over = []
    if args.max_wall_s is not None and seconds > args.max_wall_s:
        over.append(f"took {seconds:.1f} s > {args.max_wall_s:g} s")
    if args.max_rss_gib is not None and peak > args.max_rss_gib * (1 << 30):
        over.append(f"peak RSS {peak / (1 << 30):.2f} GiB > {args.max_rss_gib:g} GiB")
    if over:
        print(f"estimate_llama: check failed: {'; '.join(over)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
