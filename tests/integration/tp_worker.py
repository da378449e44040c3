"""The per-rank side of ``test_tensor_parallel.py`` (issue 32): one spawned job per mesh.

Each rank runs, for each case (model x door), with ``examples/train_tp.py``'s model,
batch and training loop, the same parallel setup twice: without
offload (the reference: plain ``torch.compile`` with aot_eager, or the plain eager
loop), then with hyper-offload at half the reference's saved bytes (measured on this
rank, from the autograd graph): the compile door (``backend="hyper_offload"``, step
scope) or the eager door (``OffloadSession``). ``STEPS`` steps each on the same batch:
the first compiles (compile door: runs at the floor) or warms up (eager: traces, plans),
the later ones run the plan. It saves per step the device bytes autograd holds after
the forward, the bytes moved, the loss and every gradient shard, and a fingerprint of
the plan (trace and schedule) for the parent to compare across ranks.

Meshes: ``(2,)`` tensor parallel (every rank the same batch), ``(2, 2)`` FSDP2 x TP
(``dp`` x ``tp``: each dp group its own batch).
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import hyper_offload
from hyper_offload.compiler.recompute.rules import is_collective, opaque_inputs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_tp import batch, build_model, offload_run, train  # noqa: E402

STEPS = 2
FRACTION = 0.5
SEARCH_FRACTION = 0.1
TIMEOUT = datetime.timedelta(seconds=600)
"""How long a rank waits for the other at a barrier: one case's two doors take 150 s
alone on 2 cores, and a rank ran past 180 s once beside the other test worker (12-07: the
barrier timed out; alone the same cases pass)."""
MODELS = ("llama", "hf_llama")
DOORS = ("compile", "eager")
_MIB = float(1 << 20)


def _trace_fingerprint(trace: Any) -> list[tuple[str, tuple[tuple[int, str], ...]]]:
    return [(op.name, tuple((a.storage, a.kind.value) for a in op.accesses)) for op in trace.ops]


def _compile_plan(backend: Any) -> dict[str, Any]:
    regions = []
    for region in backend.regions:
        planned = region.planned
        if planned is None:
            continue
        trace = planned.fx_trace.trace
        regions.append({
            "trace": _trace_fingerprint(trace),
            "sizes": sorted(trace.storage_sizes.items()),
            "schedule": [(i, a.kind.value, a.storage) for i, _, a in planned.schedule.actions()],
            "collectives": region.collectives,
        })
    report = backend.step_report
    return {"regions": regions, "kept": None if report is None else report.summary()["kept_bytes"],
            "moved": None if report is None else report.summary()["moved_bytes"]}


def _eager_plan(session: hyper_offload.OffloadSession) -> dict[str, Any]:
    trace, schedule = session.trace, session.schedule
    foreign = session.foreign
    assert all(trace.storage_sizes[sid] == 0 for sid in foreign)
    assert not any(a.storage in foreign for _, _, a in schedule.actions())
    # The eager planner also reads what the warmup measured on this rank (op durations,
    # the link): part of its input, so part of what must agree before plans must.
    measured = ([op.duration_s for op in trace.ops], trace.d2h_bandwidth_gbps,
                trace.h2d_bandwidth_gbps)
    return {
        "trace": (_trace_fingerprint(trace), measured),
        "sizes": sorted(trace.storage_sizes.items()),
        "schedule": [(i, a.kind.value, a.storage) for i, _, a in schedule.actions()],
        "foreign": len(foreign), "settled": session.settled, "warmups": session.warmups,
    }


def run_case(model_name: str, door: str, tp_mesh: DeviceMesh, dp_mesh: DeviceMesh | None,
             dp_rank: int, inner: str = "aot_eager") -> dict[str, Any]:
    """The reference run, then the offload run at ``FRACTION`` of its saved bytes
    (compile door: both with the ``inner`` compiler)."""
    data = batch(dp_rank)
    torch._dynamo.reset()
    model = build_model(model_name, tp_mesh, dp_mesh)
    forward = torch.compile(model, backend=inner) if door == "compile" else model
    reference = train(model, forward, data, 1)[0]
    budget = int(FRACTION * reference["saved"])
    torch._dynamo.reset()
    # The eager door settles first (FSDP2's lazy setup runs other ops on step 1): one
    # step more, so that a replayed step is checked too.
    steps, planner = offload_run(door, build_model(model_name, tp_mesh, dp_mesh), data,
                                 STEPS + (door == "eager"), budget, inner)
    plan = _compile_plan(planner) if door == "compile" else _eager_plan(planner)
    return {"reference": reference, "budget": budget, "steps": steps, "plan": plan}


def run_search_case(tp_mesh: DeviceMesh) -> dict[str, Any]:
    """The region scope at ``SEARCH_FRACTION``: the recompute search runs on a graph whose
    inputs include the device mesh (an opaque object) and whose ops include collectives."""
    data = batch(0)
    torch._dynamo.reset()
    model = build_model("llama", tp_mesh, None)
    reference = train(model, torch.compile(model, backend="aot_eager"), data, 1)[0]
    budget = int(SEARCH_FRACTION * reference["saved"])
    torch._dynamo.reset()
    model = build_model("llama", tp_mesh, None)
    backend = hyper_offload.backend(inner_compiler="aot_eager", budget_scope="region",
                                    max_resident_activation_mb=budget / _MIB)
    steps = train(model, torch.compile(model, backend=backend), data, STEPS)
    searches = []
    for region in backend.regions:
        fw, bw = region.graphs
        collectives = {n.name for g in (fw, bw) for n in g.graph.nodes if is_collective(n)}
        report = region.planned.report.recompute
        searches.append({
            "searched": report.searched, "recomputed": tuple(report.recomputed),
            "collectives": collectives, "restriction": report.restriction,
            "opaque_inputs": tuple(opaque_inputs(fw.graph).values()),
        })
    return {"reference": reference, "budget": budget, "steps": steps, "searches": searches}


def _inductor_case(tp_mesh: DeviceMesh) -> dict[str, Any]:
    """The compile door with Inductor (plain Inductor on CPU needs deterministic
    algorithms to repeat itself bit for bit: TORCH_NOTES.md)."""
    torch.use_deterministic_algorithms(True)
    try:
        return run_case("llama", "compile", tp_mesh, None, 0, inner="inductor")
    finally:
        torch.use_deterministic_algorithms(False)


def worker(rank: int, world: int, port: int, out_dir: str,
           models: tuple[str, ...] = MODELS) -> None:
    """Entry point of ``torch.multiprocessing.spawn``: every case of ``models``, results
    to a file."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    logging.getLogger("hyper_offload").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")  # budget warnings: the parent asserts on figures
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    if world == 2:
        tp_mesh, dp_mesh, dp_rank = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), None, 0
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_mesh, dp_rank = mesh["tp"], mesh["dp"], mesh["dp"].get_local_rank()
    results: dict[str, Any] = {"dp_rank": dp_rank}
    try:
        for model_name in models:
            for door in DOORS:
                name = f"{model_name}-{door}"
                try:
                    results[name] = run_case(model_name, door, tp_mesh, dp_mesh, dp_rank)
                except Exception:  # saved, then this job ends: see ranks.py
                    results[name] = {"error": traceback.format_exc()}
                    raise
                dist.barrier()
        if dp_mesh is None and "llama" in models:  # the example Llama's other cases
            for name, case in (("llama-search", lambda: run_search_case(tp_mesh)),
                               ("llama-inductor", lambda: _inductor_case(tp_mesh))):
                try:
                    results[name] = case()
                except Exception:
                    results[name] = {"error": traceback.format_exc()}
                    raise
                dist.barrier()
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        gc.collect()  # cycles hold the mesh and its group: free them before (train_tp.py)
        dist.destroy_process_group()
