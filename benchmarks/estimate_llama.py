"""How long ``hyper_offload.estimate`` takes on Llama configs built on the meta device,
and how little memory it uses. One JSON line per config.

    .venv/bin/python benchmarks/estimate_llama.py                  # 2 layers of 7B width
    .venv/bin/python benchmarks/estimate_llama.py --layers 32      # the full 7B (minutes)

Each line: layers, sequence length, wall seconds (trace + plan), the process's RSS growth
(``ru_maxrss`` minus the RSS before the call) against the parameters' bytes, and the
report's figures. RSS growth far below the parameter bytes shows nothing was allocated.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hyper_offload  # noqa: E402
from llama_model import LLAMA_7B, Llama  # noqa: E402


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--budget-mb", type=float, default=16384)
    args = parser.parse_args()
    with torch.device("meta"):
        model = Llama(replace(LLAMA_7B, layers=args.layers)).to(torch.bfloat16)
    tokens = torch.empty(1, args.seq, dtype=torch.int64, device="meta")
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    before = _rss_bytes()
    started = time.perf_counter()
    report = hyper_offload.estimate(model, (tokens, tokens), budget=args.budget_mb)
    seconds = time.perf_counter() - started
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    print(report.summary(), file=sys.stderr)
    print(json.dumps({
        "benchmark": "estimate_llama", "layers": args.layers, "seq": args.seq,
        "wall_s": round(seconds, 2), "rss_growth_bytes": grown, "parameter_bytes": param_bytes,
        "rss_growth_over_parameters": round(grown / param_bytes, 4), **report.to_dict(),
    }))


if __name__ == "__main__":
    main()
