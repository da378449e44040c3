"""The disk tier (issue 50): a directory's bandwidth as the probe measures it, and an
eager step's time and memory with and without the disk tier, in the same process.

One JSON line per result (every figure **measured** on the machine that runs it)::

    {"bench": "disk_tier.probe", "dir": "/tmp", "write_gbps": ..., "read_gbps": ...}
    {"bench": "disk_tier.eager", "mode": "disk", "step_s": ..., "ratio": ..., ...}

Modes of the eager step (an MLP stack, ``--layers`` blocks of d -> 4d -> d on
``--tokens`` rows; the device budget is the step's floor, what its largest op needs):

* ``host_free``: a host budget that never binds (the baseline of ``ratio``);
* ``host_bound``: a quarter of what ``host_free`` held on the host (at least the largest
  pool bucket, which a copy needs on its way to disk): the host binds, bytes stay on the
  device past its budget;
* ``disk``: the same host budget and a disk tier in ``--dir``: the host copies that wait
  longest go to files, and the device budget holds again.

``ratio`` is step time / ``host_free`` step time (medians of steps timed in
alternation). On CPU the "device" is host memory too: these are the costs of the tier's
machinery (writes, reads, their overlap with compute), not a GPU's.

    .venv/bin/python benchmarks/disk_tier.py --dir /tmp            # ~1 minute on 2 cores
    .venv/bin/python benchmarks/disk_tier.py --dir /tmp --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from typing import Any

import torch
from torch import nn

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.config import MIB
from hyper_offload.passes import (
    GreedyResidencyPlanner,
    plan_residency,
    predict_timeline,
    required_bytes,
)
from hyper_offload.passes.ir.schedule import host_bucket_bytes
from hyper_offload.runtime.disk_store import profile_disk_bandwidth


class Stack(nn.Module):
    def __init__(self, layers: int, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x.pow(2).mean()


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).backward()


def _session(config: OffloadConfig, model: nn.Module, x: torch.Tensor) -> OffloadSession:
    session = OffloadSession(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):  # warmup, then one replay
            with session:
                _step(model, x)
    return session


def _budgets(model: nn.Module, x: torch.Tensor) -> tuple[float, float, float]:
    """(device MiB, free host MiB, bound host MiB) from a warmup's trace."""
    warm = _session(OffloadConfig(max_resident_activation_mb=1, max_host_activation_mb=1 << 16),
                    model, x)
    assert warm.trace is not None
    trace = warm.trace.with_budget(max(required_bytes(warm.trace)))
    free = plan_residency(trace, GreedyResidencyPlanner(), where="bench").peak_host_bytes
    # A copy passes through the host on its way to disk: room for the largest bucket.
    largest = host_bucket_bytes(max(trace.storage_sizes.values()))
    return trace.budget_bytes / MIB, free / MIB, max(free / 4, largest) / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.tokens, args.steps = 3, 512, 2
    torch.manual_seed(0)
    probe = profile_disk_bandwidth(args.dir)
    _emit({"bench": "disk_tier.probe", "dir": args.dir, "write_gbps": probe.write_gbps,
           "read_gbps": probe.read_gbps, "planning_gbps": probe.gbps, "measured": True})
    model = Stack(args.layers, args.dim)
    x = torch.randn(args.tokens, args.dim)
    device, free, bound = _budgets(model, x)
    configs = {
        "host_free": OffloadConfig(max_resident_activation_mb=device, max_host_activation_mb=free * 2),
        "host_bound": OffloadConfig(max_resident_activation_mb=device, max_host_activation_mb=bound),
        "disk": OffloadConfig(max_resident_activation_mb=device, max_host_activation_mb=bound,
                              max_disk_activation_mb=free * 2, disk_dir=args.dir,
                              disk_bandwidth_gbps=probe.gbps),
    }
    sessions = {mode: _session(config, model, x) for mode, config in configs.items()}
    times: dict[str, list[float]] = {mode: [] for mode in sessions}
    for _ in range(args.steps):  # in alternation: load changes hit every mode alike
        for mode, session in sessions.items():
            start = time.perf_counter()
            with session:
                _step(model, x)
            times[mode].append(time.perf_counter() - start)
    base = statistics.median(times["host_free"])
    for mode, session in sessions.items():
        stats = session.last_stats
        assert stats is not None and stats.pool is not None
        _emit({
            "bench": "disk_tier.eager", "mode": mode, "measured": True,
            "layers": args.layers, "dim": args.dim, "tokens": args.tokens,
            "device_budget_mb": round(device, 3),
            "host_budget_mb": round(configs[mode].max_host_activation_mb or 0, 3),
            "step_s": statistics.median(times[mode]),
            "ratio": statistics.median(times[mode]) / base,
            "peak_resident_mb": stats.peak_resident_bytes / MIB,
            "host_pool_peak_mb": stats.pool.pinned_bytes_peak / MIB,
            "disk_written_mb": stats.bytes_to_disk / MIB,
            "disk_peak_mb": 0.0 if stats.disk is None else stats.disk.bytes_peak / MIB,
            # the timeline model on the warmup's measured op times and links: predicted
            "predicted_stall_s": predict_timeline(session.trace, session.schedule)
            .exposed_transfer_s if session.trace is not None and session.schedule is not None
            else None,
        })


if __name__ == "__main__":
    main()
