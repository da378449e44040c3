"""torch.distributed.pipelining through the eager door, many runs in a row (issue 41 item 5).

Each run spawns 2 fresh gloo ranks and runs ``tests/integration/eager_stacks_cases``'s
pipelining case for GPipe and 1F1B (4 micro-batches, ``--steps`` steps with SGD between
them, half of the plain run's most saved bytes per rank): plain, then inside one
``OffloadSession``. A run is exact when the loss and every gradient are ``torch.equal``
to the plain run's at every step on every rank. One JSON line per run and schedule, then
a summary line::

    .venv/bin/python benchmarks/eager_pipelining_repeat.py              # 10 runs
    .venv/bin/python benchmarks/eager_pipelining_repeat.py --rewarm-on-mismatch
    .venv/bin/python benchmarks/eager_pipelining_repeat.py --runs 3 --steps 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration import eager_stacks_cases as cases  # noqa: E402
from tests.runtime.pipeline.dist_harness import Cluster  # noqa: E402

SCHEDULES = ("gpipe", "1f1b")


def mismatches(results: list[dict[str, Any]]) -> list[str]:
    """``"rank r step s"`` for every step whose loss or a gradient differs."""
    bad = []
    for rank, case in enumerate(results):
        for number, (plain, step) in enumerate(zip(case["plain"], case["steps"], strict=True)):
            same = plain["loss"] is None or torch.equal(plain["loss"], step["loss"])
            same = same and all(torch.equal(a, b) for a, b in zip(plain["grads"], step["grads"]))
            if not same:
                bad.append(f"rank {rank} step {number}")
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=cases.STEPS)
    parser.add_argument("--rewarm-on-mismatch", action="store_true",
                        help="OffloadConfig(rewarm_on_mismatch=True) (default: settle by itself)")
    args = parser.parse_args(argv)
    config = {"rewarm_on_mismatch": True} if args.rewarm_on_mismatch else {}
    exact = 0
    for run in range(args.runs):
        cluster = Cluster(2)
        try:
            for schedule in SCHEDULES:
                started = time.perf_counter()
                results = cluster.run(cases.pipeline, (schedule, args.steps, config))
                bad = mismatches(results)
                exact += not bad
                print(json.dumps({
                    "bench": "eager_pipelining_repeat", "run": run, "schedule": schedule,
                    "steps": args.steps, "config": config, "exact": not bad, "mismatches": bad,
                    "warmups": [case["steps"][-1]["warmups"] for case in results],
                    "budget": [case["budget"] for case in results],
                    "saved": [[s["saved"] for s in case["steps"]] for case in results],
                    "plain_saved": [case["plain"][-1]["saved"] for case in results],
                    "moved": [[s["moved"] for s in case["steps"]] for case in results],
                    "seconds": round(time.perf_counter() - started, 2),
                }), flush=True)
        finally:
            cluster.close()
    total = args.runs * len(SCHEDULES)
    print(json.dumps({"bench": "eager_pipelining_repeat", "summary": True,
                      "exact_runs": exact, "runs": total}))
    return 0 if exact == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
