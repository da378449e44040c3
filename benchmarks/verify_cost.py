"""What ``verify`` costs (issue 34): measured on this machine's CPU in both doors, and
predicted on a GPU for the stall benchmark's rows.

One JSON line per result.

* ``verify_cost`` (``"measured": true``): the demo GPT (``examples/gpt_model.py`` at
  ``benchmarks/eager_step.py``'s sizes: vocab 1024, dim 256, 4 layers, 4 heads, seq 128,
  batch 4) with verify off and on, both in this process, warmed up, then their steps
  timed in alternation (off, on, off, on, ...); ``ratio`` = median verified step /
  median unverified step. Doors: ``eager`` (``OffloadSession``, budget 50% of the plain
  peak, SGD step as in eager_step) and ``compile`` (``torch.compile(backend=
  hyper_offload.backend(inner_compiler=..., max_resident_activation_fraction=0.5,
  verify=...))``, forward + backward as in compile_step). ``checks``: comparisons that
  passed in the verified run (the compile door's count is ``backend.runtime.checks``
  where the runtime has it). Target: ratio <= 1.15 on CPU.

* ``verify_cost.predicted`` (``"predicted": true``, ``--predict``): per row of
  ``benchmarks/stall.py`` (its models, budgets and links, the compile pipeline's plan
  ``plan_graphs``), the compute-stream time the checks add at 3 TB/s: the checksum at
  the D2H and the one at the release each read the moved bytes once, the one after the
  reload's wait reads the reloaded bytes once, so ``(2 x D2H bytes + H2D bytes) / 3 TB/s``.
  Added to compute, not re-timed through the timeline model. ``host_syncs``: the
  comparisons, each reading 16 bytes back (one host synchronization each: one at the
  release and one at the reload per moved storage; the checksum at the D2H reads nothing
  back). Syncs are counted, not priced.

    .venv/bin/python benchmarks/verify_cost.py               # measured, ~40 s on 2 cores
    .venv/bin/python benchmarks/verify_cost.py --predict     # + predicted rows (~25 s more)
    .venv/bin/python benchmarks/verify_cost.py --only predict
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import hyper_offload
import stall
from bench_common import gpt_module
from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.config import MIB
from hyper_offload.passes import check_schedule, predict_timeline, resident_bytes_without_offload
from hyper_offload.passes.ir.schedule import ActionKind

CHECK_BYTES_PER_S = 3e12  # the roofline's device bandwidth in benchmarks/stall.py


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def _timed(fn: Callable[[], None]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def alternate(off: Callable[[], None], on: Callable[[], None], steps: int) -> tuple[float, float]:
    """Medians of ``off`` and ``on`` timed in alternation (a load change on a shared
    machine hits both alike)."""
    times_off, times_on = [], []
    for _ in range(steps):
        times_off.append(_timed(off))
        times_on.append(_timed(on))
    return statistics.median(times_off), statistics.median(times_on)


def eager(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> dict[str, Any]:
    """The eager door at 50% of the plain peak, verify off against on."""
    probe = OffloadSession(OffloadConfig())
    with probe:
        copy.deepcopy(model)(*batch).backward()
    assert probe.trace is not None
    budget = max(resident_bytes_without_offload(probe.trace)) // 2
    runs = {}
    for verify in (False, True):
        config = OffloadConfig(max_resident_activation_mb=budget / MIB, verify=verify)
        session = OffloadSession(config)
        sess_model = copy.deepcopy(model)
        opt = torch.optim.SGD(sess_model.parameters(), lr=1e-4)

        def step(session: OffloadSession = session, sess_model: nn.Module = sess_model,
                 opt: torch.optim.Optimizer = opt) -> None:
            with session:
                opt.zero_grad(set_to_none=True)
                sess_model(*batch).backward()
                opt.step()

        step()  # trace + online eviction + plan
        step()  # first replay (allocator warm-up)
        runs[verify] = (session, step)
    off, on = alternate(runs[False][1], runs[True][1], steps)
    session = runs[True][0]
    stats = session.last_stats
    return {"door": "eager", "budget": "half_peak", "budget_bytes": budget,
            "step_off_s": off, "step_on_s": on, "ratio": on / off,
            "verified_steps": session.verified_steps, "bytes_d2h": stats.bytes_d2h,
            "bytes_h2d": stats.bytes_h2d, "transfers": stats.transfers}


def compile_door(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], inner: str,
                 steps: int) -> dict[str, Any]:
    """The compile door at a budget of 0.5 of the peak, verify off against on: two
    compiled copies of the model, one backend each."""
    runs = {}
    for verify in (False, True):
        backend = hyper_offload.backend(inner_compiler=inner, max_resident_activation_fraction=0.5,
                                        verify=verify)
        copy_ = copy.deepcopy(model)
        compiled = torch.compile(copy_, backend=backend)

        def step(
            compiled: Callable[..., torch.Tensor] = compiled, copy_: nn.Module = copy_
        ) -> None:
            copy_.zero_grad(set_to_none=False)
            compiled(*batch).backward()

        started = time.perf_counter()
        for _ in range(3):  # compile; the step plan (budget_scope="step") after a step
            step()
        runs[verify] = (backend, step, time.perf_counter() - started)
    off, on = alternate(runs[False][1], runs[True][1], steps)
    backend = runs[True][0]
    reports = backend.reports
    return {"door": "compile", "inner": inner, "budget_fraction": 0.5,
            "step_off_s": off, "step_on_s": on, "ratio": on / off,
            "warmup_off_s": runs[False][2], "warmup_on_s": runs[True][2],
            "checks": getattr(backend.runtime, "checks", None),
            "verified_steps": getattr(backend, "verified_steps", None),
            "bytes_moved": sum(r.bytes_d2h + r.bytes_h2d for r in reports)}


def predicted(fractions: list[float], links: list[float]) -> list[dict[str, Any]]:
    """The stall benchmark's rows (its models, the compile pipeline's plan, the time
    planner the backend runs) with the checks' compute-stream time."""
    out = []
    for name, make in stall.MODELS.items():
        model, inputs = make()
        graphs = stall.capture_graphs(model, inputs, device="cpu", inner_compiler="inductor")
        for gbps in links:
            for fraction in fractions:
                budget = {"max_resident_activation_fraction": fraction}
                options = stall.parse_backend_options(budget)
                fx_trace, schedule, *_ = stall.plan_graphs(
                    graphs.fw, graphs.bw, num_fwd_outputs=graphs.num_fwd_outputs, options=options,
                    bandwidth=stall.TransferBandwidth(gbps, gbps, measured=False), region=0,
                    throughput=stall.GPU,
                )
                check = check_schedule(fx_trace.trace, schedule)
                timeline = predict_timeline(fx_trace.trace, schedule, release_waits_for_d2h=True)
                actions = [a.kind for slot in (*schedule.pre, *schedule.post) for a in slot]
                d2h, h2d = actions.count(ActionKind.COPY_D2H), actions.count(ActionKind.COPY_H2D)
                extra = (2 * check.bytes_d2h + check.bytes_h2d) / CHECK_BYTES_PER_S
                compute = timeline.compute_s
                out.append({
                    "bench": "verify_cost.predicted", "model": name, "budget_fraction": fraction,
                    "link_gbps": gbps, "moved_d2h_mib": round(check.bytes_d2h / MIB, 1),
                    "moved_h2d_mib": round(check.bytes_h2d / MIB, 1),
                    "copies_d2h": d2h, "copies_h2d": h2d,
                    "compute_ms": round(compute * 1e3, 2),
                    "stall_ms": round(timeline.exposed_transfer_s * 1e3, 2),
                    "verify_extra_ms": round(extra * 1e3, 3),
                    "verify_extra_over_compute": round(extra / compute, 4) if compute else None,
                    "host_syncs": d2h + h2d, "host_syncs_priced": False, "predicted": True,
                })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("measured", "predict"), default=None)
    parser.add_argument("--predict", action="store_true", help="also the predicted GPU rows")
    parser.add_argument("--inner", default="aot_eager,inductor",
                        help="compile door inner compilers")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per side")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (default 1, as eager_step: steadier timing)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.7, 0.85])
    parser.add_argument("--links", type=float, nargs="+", default=[16.0, 50.0])
    for name, default in (("vocab", 1024), ("dim", 256), ("layers", 4), ("heads", 4),
                          ("seq", 128), ("batch", 4)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    if args.only != "predict":
        torch.manual_seed(0)
        torch.set_num_threads(args.threads)
        gm = gpt_module()
        model = gm.GPT(gm.GPTConfig(vocab=args.vocab, dim=args.dim, layers=args.layers,
                                    heads=args.heads, seq_len=args.seq))
        idx = torch.randint(0, args.vocab, (args.batch, args.seq))
        batch = (idx, torch.roll(idx, -1, dims=1))
        common = {"bench": "verify_cost", "model": "gpt", "layers": args.layers, "dim": args.dim,
                  "seq": args.seq, "batch": args.batch, "threads": args.threads,
                  "timed_steps": args.steps, "measured": True}
        _emit({**common, **eager(model, batch, args.steps)})
        for inner in args.inner.split(","):
            torch._dynamo.reset()
            _emit({**common, **compile_door(model, batch, inner, args.steps)})
    if args.predict or args.only == "predict":
        for row in predicted(args.fractions, args.links):
            _emit(row)


if __name__ == "__main__":
    main()
