"""Eager ``OffloadSession`` step time against plain eager, in the same process.

One JSON line per result::

    {"bench": "eager_step", "model": "gpt", "mode": "replay", "budget": "peak", ...}

Modes: ``plain`` (no session), ``warmup`` (step 1: trace + online eviction + plan),
``replay`` at a budget >= the plain peak (nothing to move: pure dispatch overhead) and at
50% of it (offload + prefetch); ``replay_lengths``: the same with a sequence length drawn
per step (the same ops with other sizes, :func:`run_lengths`). ``ratio`` is step time / plain step time (medians);
``overhead_us_per_op`` is (replay - plain) / ops. The target is ratio <= 1.3 at budget
>= peak on a model whose mean op takes >= 200 us (``mean_op_us`` says which it was).

    .venv/bin/python benchmarks/eager_step.py            # small GPT, ~1 minute on 2 cores
    .venv/bin/python benchmarks/eager_step.py --quick    # smoke run
    .venv/bin/python benchmarks/eager_step.py --verify   # sessions with OffloadConfig(verify=True)

``--verify`` checks every transfer of the sessions (issue 34): each line then says
``"verify": true``, replay lines give ``verified_steps``, and a copy race raises
``TransferIntegrityError`` (the run fails with its message). Verify costs time: its
ratios are not the overhead figures (``benchmarks/verify_cost.py`` measures the cost).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

import torch
from torch import nn

from bench_common import gpt_module
from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.config import MIB
from hyper_offload.passes import resident_bytes_without_offload


def make_gpt(vocab: int, dim: int, layers: int, heads: int, seq: int) -> nn.Module:
    """The GPT of ``examples/gpt_model.py``; ``forward(idx, targets)`` returns the loss."""
    gm = gpt_module()
    return gm.GPT(gm.GPTConfig(vocab=vocab, dim=dim, layers=layers, heads=heads, seq_len=seq))


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    opt.zero_grad(set_to_none=True)
    model(*batch).backward()
    opt.step()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn: Any, steps: int) -> float:
    times = []
    for _ in range(steps):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
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


def run(model_name: str, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], steps: int,
        verify: bool = False) -> None:
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
    common = {"model": model_name, "ops": ops, "plain_peak_bytes": peak, **_flags(verify)}
    _emit({**common, "mode": "plain", "step_s": plain, "mean_op_us": plain / ops * 1e6})
    # Replay ratios use a plain median re-measured in alternation with the replay steps.

    for label, budget in (("peak", peak), ("half_peak", peak // 2)):
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB, verify=verify))
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
               "bytes_h2d": stats.bytes_h2d, "transfers": stats.transfers, **_verified(session)})


def run_lengths(model: nn.Module, vocab: int, seq: int, batch_size: int, steps: int,
                device: torch.device, verify: bool = False) -> None:
    """Replay over the same ops with other sizes (issue 33): every step draws its sequence
    length from {seq/2, 3seq/4, seq}; the warmup sees 3seq/4, so the first full-length
    step evicts online and the plan is remade for the largest sizes (``replans``). One
    untimed pass over the lengths, then plain and session steps of the same length in
    alternation; ``ratio`` is the median of the per-length step ratios."""
    lengths = (seq // 2, 3 * seq // 4, seq)
    generator = torch.Generator().manual_seed(0)
    order = [lengths[1]] + [lengths[int(i)] for i in torch.randint(0, 3, (3 * steps,),
                                                                   generator=generator)]
    batches = {}
    for n in lengths:
        idx = torch.randint(0, vocab, (batch_size, n), generator=generator).to(device)
        batches[n] = (idx, torch.roll(idx, -1, dims=1))
    base = copy.deepcopy(model)
    opt = torch.optim.SGD(base.parameters(), lr=1e-4)
    probe, probe_model = OffloadSession(OffloadConfig()), copy.deepcopy(model)
    with probe:  # the plain peak at the longest length: the budgets' reference
        _step(probe_model, torch.optim.SGD(probe_model.parameters(), lr=1e-4), batches[seq])
    assert probe.trace is not None
    peak = max(resident_bytes_without_offload(probe.trace))
    for label, budget in (("peak", peak), ("half_peak", peak // 2)):
        session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB, verify=verify))
        sess_model = copy.deepcopy(model)
        sess_opt = torch.optim.SGD(sess_model.parameters(), lr=1e-4)
        for n in (lengths[1], lengths[0], lengths[2], lengths[1]):  # untimed: warmup, growth
            with session:
                _step(sess_model, sess_opt, batches[n])
            _step(base, opt, batches[n])
        ratios, evictions = {n: [] for n in lengths}, 0
        for n in order:
            plain, replay = _time_alternating(lambda: _step(base, opt, batches[n]),
                                              lambda: _session_step(session, sess_model,
                                                                    sess_opt, batches[n]), 1)
            ratios[n].append(replay / plain)
            evictions += session.last_stats.evictions
        per_length = {n: statistics.median(r) for n, r in ratios.items() if r}
        _emit({"model": "gpt", "mode": "replay_lengths", "budget": label, "budget_bytes": budget,
               "plain_peak_bytes": peak, "lengths": list(lengths), "timed_steps": len(order),
               "ratio": statistics.median(per_length.values()),
               "ratio_per_length": {str(n): r for n, r in per_length.items()},
               "replans": session.replans, "rewarms": session.rewarms,
               "timed_evictions": evictions, **_flags(verify), **_verified(session)})


def _flags(verify: bool) -> dict[str, Any]:
    """What ``--verify`` adds to every line (nothing without it: the default output is as
    before)."""
    return {"verify": True} if verify else {}


def _verified(session: OffloadSession) -> dict[str, Any]:
    verify = session.config.verify
    return {"verified_steps": session.verified_steps} if verify else {}


def _session_step(session: OffloadSession, model: nn.Module, opt: torch.optim.Optimizer,
                  batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    with session:
        _step(model, opt, batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 timed steps")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="intra-op threads (default 1: on a shared CPU, OpenMP spin-waits swamp the timing)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    for name in ("layers", "dim", "heads", "seq", "batch", "vocab"):
        parser.add_argument(f"--{name}", type=int, default=None, help="override the preset size")
    parser.add_argument("--no-tiny-model", action="store_true",
                        help="skip the per-op overhead run on the model of tiny ops")
    parser.add_argument("--verify", action="store_true",
                        help="OffloadConfig(verify=True): check every transfer (issue 34)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    steps = 2 if args.quick else args.steps
    # Small GPT whose mean op takes >= 200 us on 2 CPU cores (the target's setting).
    sizes = dict(vocab=512, dim=128, layers=2, heads=4, seq=64) if args.quick else dict(
        vocab=1024, dim=256, layers=4, heads=4, seq=128
    )
    batch_size = 2 if args.quick else 4
    sizes.update({k: getattr(args, k) for k in sizes if getattr(args, k) is not None})
    batch_size = args.batch or batch_size
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gpt = make_gpt(**sizes).to(device=device, dtype=dtype)
    idx = torch.randint(0, sizes["vocab"], (batch_size, sizes["seq"])).to(device)
    run("gpt", gpt, (idx, torch.roll(idx, -1, dims=1)), steps, args.verify)
    run_lengths(gpt, sizes["vocab"], sizes["seq"], batch_size, steps, device, args.verify)
    if args.no_tiny_model:
        return
    # Dispatch overhead on a model of tiny ops (mean op a few us): the per-op cost.
    tiny = make_gpt(vocab=64, dim=32, layers=2, heads=2, seq=16).to(device=device, dtype=dtype)
    tidx = torch.randint(0, 64, (2, 16)).to(device)
    run("tiny_gpt", tiny, (tidx, torch.roll(tidx, -1, dims=1)), steps * 4, args.verify)


if __name__ == "__main__":
    main()
