"""Eager ``OffloadSession`` step time against plain eager, in the same process.

One JSON line per result::

    {"bench": "eager_step", "model": "gpt", "mode": "replay", "budget": "peak", ...}

Modes: ``plain`` (no session), ``warmup`` (step 1: trace + online eviction + plan),
``replay`` at a budget >= the plain peak (nothing to move: pure dispatch overhead) and at
50% of it (offload + prefetch). ``ratio`` is step time / plain step time (medians);
``overhead_us_per_op`` is (replay - plain) / ops. The target is ratio <= 1.3 at budget
>= peak on a model whose mean op takes >= 200 us (``mean_op_us`` says which it was).

    .venv/bin/python benchmarks/eager_step.py            # small GPT, ~1 minute on 2 cores
    .venv/bin/python benchmarks/eager_step.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.config import MIB
from hyper_offload.passes import resident_bytes_without_offload


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    opt.zero_grad(set_to_none=True)
    model(*batch).backward()
    opt.step()


def _time(fn: Any, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_alternating(fn_a: Any, fn_b: Any, steps: int) -> tuple[float, float]:
    """Medians of ``fn_a`` and ``fn_b`` timed in alternation, so that load changes on a
    shared machine hit both alike."""
    times_a, times_b = [], []
    for _ in range(steps):
        times_a.append(_time(fn_a, 1))
        times_b.append(_time(fn_b, 1))
    return statistics.median(times_a), statistics.median(times_b)


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps({"bench": "eager_step", **record}), flush=True)


def run(model_name: str, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> None:
    base = copy.deepcopy(model)
    opt = torch.optim.SGD(base.parameters(), lr=1e-4)
    _step(base, opt, batch)  # warm allocator and kernels
    plain = _time(lambda: _step(base, opt, batch), steps)

    probe = OffloadSession(OffloadConfig())
    probe_model = copy.deepcopy(model)
    probe_opt = torch.optim.SGD(probe_model.parameters(), lr=1e-4)
    with probe:
        _step(probe_model, probe_opt, batch)
    trace = probe.trace
    assert trace is not None
    peak = max(resident_bytes_without_offload(trace))
    ops = trace.num_ops
    common = {"model": model_name, "ops": ops, "plain_peak_bytes": peak}
    _emit({**common, "mode": "plain", "step_s": plain, "mean_op_us": plain / ops * 1e6})
    # Replay ratios use a plain median re-measured in alternation with the replay steps.

    for label, budget in (("peak", peak), ("half_peak", peak // 2)):
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
        sess_model = copy.deepcopy(model)
        sess_opt = torch.optim.SGD(sess_model.parameters(), lr=1e-4)

        def one_step() -> None:
            with session:
                _step(sess_model, sess_opt, batch)

        warm = _time(one_step, 1)
        warm_stats = session.last_stats
        _emit({**common, "mode": "warmup", "budget": label, "budget_bytes": budget, "step_s": warm,
               "ratio": warm / plain, "peak_resident_bytes": warm_stats.peak_resident_bytes,
               "evictions": warm_stats.evictions})
        one_step()  # first replay (allocator warm-up)
        plain, replay = _time_alternating(lambda: _step(base, opt, batch), one_step, steps)
        stats = session.last_stats
        _emit({**common, "mode": "replay", "budget": label, "budget_bytes": budget, "step_s": replay,
               "plain_step_s": plain, "ratio": replay / plain, "overhead_us_per_op": (replay - plain) / ops * 1e6,
               "peak_resident_bytes": stats.peak_resident_bytes, "bytes_d2h": stats.bytes_d2h,
               "bytes_h2d": stats.bytes_h2d, "transfers": stats.transfers})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 timed steps")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="intra-op threads (default 1: on a shared CPU, OpenMP spin-waits swamp the timing)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    steps = 2 if args.quick else args.steps
    # Small GPT whose mean op takes >= 200 us on 2 CPU cores (the target's setting).
    sizes = dict(vocab=512, dim=128, layers=2, heads=4, seq=64) if args.quick else dict(
        vocab=1024, dim=256, layers=4, heads=4, seq=128
    )
    batch_size = 2 if args.quick else 4
    gpt = GPT(**sizes)
    idx = torch.randint(0, sizes["vocab"], (batch_size, sizes["seq"]))
    run("gpt", gpt, (idx, torch.roll(idx, -1, dims=1)), steps)
    # Dispatch overhead on a model of tiny ops (mean op a few us): the per-op cost.
    tiny = GPT(vocab=64, dim=32, layers=2, heads=2, seq=16)
    tidx = torch.randint(0, 64, (2, 16))
    run("tiny_gpt", tiny, (tidx, torch.roll(tidx, -1, dims=1)), steps * 4)


if __name__ == "__main__":
    main()
