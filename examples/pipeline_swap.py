"""Pipeline-parallel training of a small GPT with activation swap.

Each rank holds one or two stages of the model (depending on the schedule), wraps every
transformer block with ``swap_wrapper`` and runs ``PipelineSwapSchedule`` once without and
once with ``swap=True``. Rank 0 prints, per rank, the peak device bytes of one training
step with and without swap and the step-time ratio, and checks that losses are equal.

    torchrun --nproc-per-node 4 examples/pipeline_swap.py --schedule gpipe
    python examples/pipeline_swap.py --spawn --nproc 4 --schedule interleaved-1f1b --plot pp.png

On CPU the "device" bytes are those of a dispatch-level meter (``DeviceMemoryMeter``); on
CUDA (``--device cuda``, NCCL) the allocator's own peak. Every P2P wait has a timeout
(``--timeout``), so a failing rank never leaves the others hanging.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpt_model import Block, GPTConfig  # the examples' shared GPT block
from hyper_offload.passes.pipeline import (
    SCHEDULES,
    StageFootprints,
    build_rank_orders,
    build_timeline,
    layout_for,
    parse_order,
    predicted_peak,
)
from hyper_offload.pipeline import PipelineSwapSchedule, swap_wrapper
from hyper_offload.runtime import DeviceMemoryMeter
from hyper_offload.runtime.pipeline import FootprintRecorder

V_OR_INTERLEAVED = {"interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"}


class GPTStage(nn.Module):
    """One pipeline stage: [embedding] + blocks + [final norm and LM head]."""

    def __init__(self, args: argparse.Namespace, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.dim) if first else None
        self.pos = nn.Parameter(torch.zeros(args.seq, args.dim)) if first else None
        # The blocks' saved activations may be swapped; which ones move is the schedule's call.
        block_shape = GPTConfig(vocab=args.vocab, seq_len=args.seq, dim=args.dim, heads=args.heads)
        self.blocks = nn.ModuleList(
            swap_wrapper(Block(block_shape), group_swap=args.group_swap) for _ in range(args.blocks)
        )
        self.head = nn.Sequential(nn.LayerNorm(args.dim), nn.Linear(args.dim, args.vocab)) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule in V_OR_INTERLEAVED else 1


def build_stage_modules(args: argparse.Namespace, world: int, device: torch.device) -> dict[int, GPTStage]:
    """The full model, built identically on every rank from one seed; returns all stages."""
    num_stages = world * stages_per_rank(args.schedule)
    torch.manual_seed(0)
    return {s: GPTStage(args, s == 0, s == num_stages - 1).to(device) for s in range(num_stages)}


def run_rank(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """Train ``args.steps`` steps without and with swap; returns this rank's figures."""
    from torch.distributed.pipelining import PipelineStage

    spr = stages_per_rank(args.schedule)
    layout = layout_for(args.schedule, num_ranks=world, stages_per_rank=spr)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(args.vocab, (args.micro * args.batch, args.seq + 1), generator=gen).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    out: dict[str, Any] = {"rank": rank}
    for swap in (False, True):
        modules = build_stage_modules(args, world, device)
        stages = [PipelineStage(modules[s], s, layout.num_stages, device) for s in layout.stages_of(rank)]
        sched = PipelineSwapSchedule(
            stages, args.micro, schedule=args.schedule, loss_fn=loss_fn, swap=swap,
            transport=args.transport, timeout=args.timeout, release_sends=not args.wait_sends_at_end,
        )
        times, losses = [], []
        for _ in range(args.steps):  # step 1 also initialises the stages: not timed
            start = time.perf_counter()
            sched.step(inputs, target=targets, losses=losses)
            if device.type != "cpu":
                torch.accelerator.synchronize()
            times.append(time.perf_counter() - start)
        key = "with" if swap else "without"
        if swap:  # calibrate the residency model on one step, predict the next one
            out["footprints"] = measure_footprints(sched, inputs, targets, losses, device)
            out["order"] = [repr(step) for step in sched.order]
            out["releases"] = dict(sched.send_releases or {})
        meter = DeviceMemoryMeter(device)  # one more step, metered (the meter slows it down)
        with meter:
            sched.step(inputs, target=targets, losses=losses)
        peak = meter.allocator_peak_bytes if meter.allocator_peak_bytes is not None else meter.peak_bytes
        if sched.session is not None:
            out["copies"] = sched.session.copies()  # of the metered step
        sched.close()
        out[f"peak_{key}"] = peak  # a warm step: the host pool and the stages are set up
        out[f"time_{key}"] = statistics.median(times[1:] or times)
        out[f"losses_{key}"] = [loss.item() for loss in losses]
    return out


def measure_footprints(
    sched: PipelineSwapSchedule, inputs: torch.Tensor, targets: torch.Tensor, losses: list, device: torch.device
) -> StageFootprints:
    """Each local stage's footprint, measured on one metered step (the residency model's input)."""
    meter = DeviceMemoryMeter(device)
    recorder = FootprintRecorder(meter, sched.session)
    sched.observer = recorder
    try:
        with meter:
            sched.step(inputs, target=targets, losses=losses)
    finally:
        sched.observer = None
    return recorder.footprints(sched.last_sends)


def predicted_peaks(result: dict[str, Any]) -> tuple[int, int]:
    """The residency model's peak of this rank's order without and with swap (bytes)."""
    order = parse_order(result["order"])
    footprints, releases = result["footprints"], result["releases"]
    without = predicted_peak(order, footprints, swapped=(), weight_swapped=(), releases=releases)
    return without, predicted_peak(order, footprints, releases=releases)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"schedule={args.schedule} ranks={len(results)} micro-batches={args.micro} transport={args.transport}")
    print(f"{'rank':>4} {'peak w/o swap':>14} {'peak with swap':>15} {'drop':>6} {'predicted':>9}")
    for r in results:
        drop = 1 - r["peak_with"] / r["peak_without"] if r["peak_without"] else 0.0
        without, with_swap = predicted_peaks(r)
        predicted = 1 - with_swap / without if without else 0.0
        print(f"{r['rank']:>4} {r['peak_without']:>14,} {r['peak_with']:>15,} {drop:>6.1%} {predicted:>9.1%}")
    ratio = max(r["time_with"] for r in results) / max(r["time_without"] for r in results)
    print(f"step time with swap / without: {ratio:.2f}")
    same = all(r["losses_with"] == r["losses_without"] for r in results)
    print(f"losses identical with and without swap: {same}")


def plot(args: argparse.Namespace, world: int) -> None:
    from hyper_offload.viz import plot_timeline

    orders = build_rank_orders(
        args.schedule, num_ranks=world, stages_per_rank=stages_per_rank(args.schedule),
        num_microbatches=args.micro, transport=args.transport, swap=True,
    )
    print(f"timeline written to {plot_timeline(build_timeline(orders), args.plot, title=args.schedule)}")


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout * 2))
    try:
        result = run_rank(args, rank, world, device)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            report(gathered, args)
            if args.plot:
                plot(args, world)
    finally:
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="gpipe")
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=2, help="transformer blocks per stage")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--transport", choices=("plain", "batch", "boundary"), default="plain")
    parser.add_argument("--group-swap", action="store_true", help="swap_wrapper(..., group_swap=True)")
    parser.add_argument(
        "--wait-sends-at-end", action="store_true",
        help="wait every P2P send at the end of the step (release_sends=False), as before send release",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any P2P wait may take")
    parser.add_argument("--plot", default=None, help="write the swap timeline picture here (needs matplotlib)")
    parser.add_argument("--spawn", action="store_true", help="start --nproc processes here instead of torchrun")
    parser.add_argument("--nproc", type=int, default=4)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.spawn:
        import torch.multiprocessing as mp

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        mp.spawn(worker, args=(args.nproc, args), nprocs=args.nproc, join=True)
    else:  # torchrun sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)


if __name__ == "__main__":
    main()
