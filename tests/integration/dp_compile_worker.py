"""The per-rank side of ``test_compile_data_parallel.py``: one spawned job, every case.

Each rank runs, for each case (DDP or FSDP2, aot_eager or Inductor), one training step
of a tiny model compiled twice: with plain ``torch.compile`` and the inner compiler
(the reference) and with the ``hyper_offload`` backend at a budget of 0 MiB (everything
offloadable is offloaded). It saves the losses, the gradients (local shards under
FSDP2), the backend's region reports and, per region, the names of the graph inputs
and of every storage the plan offloads, so the parent can assert on them.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

import hyper_offload
import hyper_offload.compiler

DIM, BATCH = 256, 8
LAYERS = {"ddp": 2, "fsdp": 3}
"""FSDP2 gets a third layer: Dynamo then runs one compiled region for two layers
(several forwards of one region before its first backward)."""
CASES = (("ddp", "aot_eager"), ("fsdp", "aot_eager"), ("ddp", "inductor"), ("fsdp", "inductor"))
TIMEOUT = datetime.timedelta(seconds=60)


class Layer(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear, residual: saved activations of several
    kinds (LayerNorm statistics, the wide hidden state, GELU's input)."""

    def __init__(self, d: int = DIM) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class Net(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(layers))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


@dataclass(frozen=True)
class RegionFacts:
    """What the parent checks about one compiled region of the offload run."""

    report: dict[str, Any]
    offloaded_sources: tuple[str, ...]  # per offloaded storage: op creating it ("fw:<node>")
    fw_placeholders: tuple[str, ...]
    fw_collectives: tuple[str, ...]  # targets of communication ops inside the forward graph
    saved_inputs: tuple[str, ...]  # saved for backward, classified "parameter or input"
    offloadable: tuple[str, ...]  # saved activations the trace lets the planner move


def _wrap(kind: str, model: nn.Module) -> nn.Module:
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # 1 MiB buckets (the smallest DDPOptimizer accepts: not under DDP's first
        # bucket): each layer (2 MiB) ends a bucket, DDPOptimizer splits the graph there, so
        # the backend sees several regions.
        return DistributedDataParallel(model, bucket_cap_mb=1)
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _grads(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        grad = p.grad
        if hasattr(grad, "to_local"):
            grad = grad.to_local()
        out.append(grad.detach().clone())
    return out


def _step(kind: str, backend: Any, rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _wrap(kind, Net(LAYERS[kind]))
    compiled = torch.compile(model, backend=backend)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    x = torch.randn(BATCH, DIM, generator=generator)
    loss = compiled(x)
    loss.backward()
    return loss.detach().clone(), _grads(model)


def _collectives(graph: fx.Graph) -> tuple[str, ...]:
    return tuple(
        str(n.target) for n in graph.nodes
        if n.op == "call_function" and ("c10d" in str(n.target) or "fsdp" in str(n.target))
    )


def _region_facts(backend: hyper_offload.compiler.HyperOffloadBackend) -> list[RegionFacts]:
    facts = []
    for region in backend.regions:
        planned = region.planned
        if planned is None:
            continue
        fw = region.graphs[0]
        d2h = {a.storage for _, _, a in planned.schedule.actions() if a.kind.value == "COPY_D2H"}
        creators = _storage_creators(planned.fx_trace)
        facts.append(RegionFacts(
            report=planned.report.summary(),
            offloaded_sources=tuple(sorted(creators[s] for s in d2h)),
            fw_placeholders=tuple(n.name for n in fw.graph.find_nodes(op="placeholder")),
            fw_collectives=_collectives(fw.graph),
            saved_inputs=tuple(s.name for s in planned.fx_trace.saved if s.storage is None),
            offloadable=tuple(s.name for s in planned.fx_trace.saved if s.offloadable),
        ))
    return facts


def _storage_creators(fx_trace: Any) -> dict[int, str]:
    """Storage -> the op that first writes it (its creator in the trace)."""
    creators: dict[int, str] = {}
    for op in fx_trace.trace.ops:
        for access in op.accesses:
            creators.setdefault(access.storage, op.name)
    return creators


def run_case(kind: str, inner: str, rank: int) -> dict[str, Any]:
    """The reference step (plain compile, same inner compiler), then the offload step."""
    reference = _step(kind, inner, rank)
    backend = hyper_offload.backend(inner_compiler=inner, max_resident_activation_mb=0)
    offload = _step(kind, backend, rank)
    return {
        "reference": reference,
        "offload": offload,
        "regions": [f.__dict__ for f in _region_facts(backend)],
        "num_regions": len(backend.regions),
    }


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Entry point of ``torch.multiprocessing.spawn``: every case, results to a file."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # 0 MiB is infeasible at every op by design: keep the per-region warning off CI logs.
    logging.getLogger("hyper_offload").setLevel(logging.ERROR)
    torch.use_deterministic_algorithms(True)  # plain Inductor on CPU needs it (TORCH_NOTES)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    results: dict[str, Any] = {}
    try:
        for kind, inner in CASES:
            started = time.perf_counter()
            try:
                results[f"{kind}-{inner}"] = run_case(kind, inner, rank)
                results[f"{kind}-{inner}"]["seconds"] = time.perf_counter() - started
            except Exception:  # saved, then this job ends: see ranks.py
                results[f"{kind}-{inner}"] = {"error": traceback.format_exc()}
                raise
            dist.barrier()
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
