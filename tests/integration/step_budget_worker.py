"""The per-rank side of ``test_step_budget_distributed.py`` (issue 31): one spawned job.

Each rank runs, for DDP (1 MiB buckets: DDPOptimizer splits the graph between layers) and
FSDP2 (``fully_shard`` per block and on the root: a graph break at every block), one
reference step with plain ``torch.compile`` (aot_eager) and then, at 50% and 30% of that
step's saved bytes (measured on this rank), ``STEPS`` steps with the ``hyper_offload``
backend under the step scope. It saves, per step, the device bytes the compiled backward
held after the forward, the bytes the runtime moved, the loss and every gradient (FSDP2:
the local shard), and the step report, for the parent to assert on.
"""

from __future__ import annotations

import datetime
import logging
import os
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hyper_offload
from hyper_offload.runtime.saved_bytes import saved_device_bytes

from ..compiler.step_models import Stack
from .dp_compile_worker import _grads, _wrap  # DDP with 1 MiB buckets, FSDP2 per block

DIM, SEQ, BATCH = 256, 256, 4
LAYERS = {"ddp": 2, "fsdp": 3}
FRACTIONS = (0.5, 0.3)
STEPS = 4  # a step lowered again for the step plan settles at the third (issue 43)
TIMEOUT = datetime.timedelta(seconds=120)
_MIB = float(1 << 20)


def _train(kind: str, backend: Any, rank: int, steps: int) -> list[dict[str, Any]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _wrap(kind, Stack(layers=LAYERS[kind], d=DIM))
    compiled = torch.compile(model, backend=backend)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    x = torch.randn(BATCH, SEQ, DIM, generator=generator)
    runtime = getattr(backend, "runtime", None)
    out = []
    for _ in range(steps):
        before = runtime.bytes_d2h if runtime is not None else 0
        loss = compiled(x)
        saved = saved_device_bytes(loss, exclude=[*model.parameters(), x])
        loss.backward()
        out.append({
            "saved": saved, "loss": loss.detach().clone(), "grads": _grads(model),
            "moved": (runtime.bytes_d2h - before) if runtime is not None else 0,
            "replans": getattr(getattr(backend, "step_report", None), "replans", 0),
        })
        model.zero_grad(set_to_none=True)
    return out


def run_case(kind: str, rank: int) -> dict[str, Any]:
    reference = _train(kind, "aot_eager", rank, 1)[0]
    case: dict[str, Any] = {"reference": reference}
    for fraction in FRACTIONS:
        budget = int(fraction * reference["saved"])
        backend = hyper_offload.backend(
            inner_compiler="aot_eager", max_resident_activation_mb=budget / _MIB
        )
        steps = _train(kind, backend, rank, STEPS)
        report = backend.step_report
        case[fraction] = {
            "budget": budget, "steps": steps, "regions": len(backend.regions),
            "report": None if report is None else report.summary(),
            "invocations": [] if report is None else [
                (p.invocation.region, p.invocation.ordinal) for p in report.invocations
            ],
        }
    return case


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Entry point of ``torch.multiprocessing.spawn``: every case, results to a file."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    logging.getLogger("hyper_offload").setLevel(logging.ERROR)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    results: dict[str, Any] = {}
    try:
        for kind in LAYERS:
            try:
                results[kind] = run_case(kind, rank)
            except Exception:  # saved, then this job ends: see ranks.py
                results[kind] = {"error": traceback.format_exc()}
                raise
            dist.barrier()
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
