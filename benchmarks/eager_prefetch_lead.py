"""How far ahead of its read the eager session issues each reload (measured, CPU).

The eager warmup plans through the shared pipeline (``passes.plan_residency``), which
moves each ``COPY_H2D`` earlier on the step's one timeline as far as the warmup's
measured op durations say the copy needs and the budget allows. One JSON line::

    {"bench": "eager_prefetch_lead", "reloads": 29, "lead_ops": {"2": 14, ...}, ...}

``lead_ops`` counts reloads by the ops between their ``COPY_H2D`` and ``WAIT_H2D``
(0 = issued at the reading op, all of them before the shared pipeline); the leads follow
the durations measured in the warmup, so they vary a little from run to run while the
peak does not. ``baseline_lead0`` is the same count for the planner's own schedule
(before placement), in the same run.

    .venv/bin/python benchmarks/eager_prefetch_lead.py --budget-mb 12   # demo GPT, seconds
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from bench_common import gpt_module

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.passes import plan_residency
from hyper_offload.passes.plan.planning import prefetch_leads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mb", type=float, default=12.0)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    gm = gpt_module()
    torch.manual_seed(0)
    config = gm.GPTConfig()
    model, batch = gm.GPT(config), gm.random_batch(config, args.batch)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=args.budget_mb))
    with session:  # as examples/train_gpt.py: the loss outlives the step
        loss = model(*batch)
        loss.backward()
    assert session.schedule is not None and session.trace is not None and session.report is not None
    leads = [wait - copy for _, copy, wait in prefetch_leads(session.schedule)]
    # The planner's schedule before placement, re-planned on the same trace.
    unplaced = plan_residency(session.trace, session.config.resolved_planner()).planned
    print(json.dumps({
        "bench": "eager_prefetch_lead", "figures": "measured", "budget_mb": args.budget_mb,
        "reloads": len(leads),
        "lead_ops": {str(k): v for k, v in sorted(collections.Counter(leads).items())},
        "baseline_lead0": sum(1 for _, c, w in prefetch_leads(unplaced) if c == w),
        "peak_bytes": session.report.peak_resident_bytes,
        "budget_bytes": session.config.budget_bytes,
    }))


if __name__ == "__main__":
    main()
