"""Rank-side cases of ``test_eager_stacks.py``: the eager door inside real training stacks.

Each case runs the same stack twice on every rank, from the same seed and batch: plain
(the reference), then with every step inside one ``OffloadSession`` at ``FRACTION`` of the
reference's most saved device bytes on this rank. Per step it returns the loss, every
gradient (shard), the saved device bytes the step reached (autograd's saved tensors,
measured with :func:`~hyper_offload.compiler.autograd_saved_device_bytes`), and the
session's figures (phase, bytes moved, warmups). The test compares them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.compiler import autograd_saved_device_bytes

FRACTION = 0.5
STEPS = 3
MIB = float(1 << 20)
HIDDEN, ROWS_PER_MICRO, MICRO = 32, 128, 4


class Block(nn.Module):
    """``h -> 4h -> GELU -> h``: few parameters, many activation bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(rows, HIDDEN, generator=gen), torch.randn(rows, HIDDEN, generator=gen)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().clone()
            for p in model.parameters()]


class SavedPeak:
    """The most device bytes autograd holds for the backward, read at each ``sample``:
    the graphs of every root still registered (``roots``) minus ``exclude``."""

    def __init__(self, exclude: list[torch.Tensor]) -> None:
        self.exclude = exclude
        self.peak = 0

    def sample(self, roots: list[torch.Tensor], exclude: list[torch.Tensor]) -> None:
        saved = autograd_saved_device_bytes(*roots, exclude=[*self.exclude, *exclude])
        self.peak = max(self.peak, saved)


def session_steps(
    step: Callable[[SavedPeak], dict[str, Any]], session: OffloadSession | None,
    exclude: list[torch.Tensor], after_step: Callable[[], None], steps: int = STEPS,
) -> list[dict[str, Any]]:
    """``steps`` steps of ``step`` (inside ``session`` when given): per step its own
    figures plus the saved peak and the session's."""
    out = []
    for _ in range(steps):
        saved = SavedPeak(exclude)
        with session if session is not None else contextlib.nullcontext():
            figures = step(saved)
        figures["saved"] = saved.peak
        if session is not None:
            stats = session.last_stats
            figures.update(phase=stats.phase, moved=stats.bytes_d2h,
                           peak=stats.peak_resident_bytes, warmups=stats.warmups,
                           settled=stats.settled, region_bytes=stats.region_bytes)
        after_step()
        out.append(figures)
    return out


def run_stack(build: Callable[[OffloadSession | None], list[dict[str, Any]]],
              fraction: float = FRACTION, **config: Any) -> dict[str, Any]:
    """The plain run, then the session's at ``fraction`` of its most saved bytes (more
    ``OffloadConfig`` fields in ``config``)."""
    plain = build(None)
    budget = int(fraction * max(step["saved"] for step in plain))
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB, **config))
    steps = build(session)
    foreign = session.foreign
    assert all(session.trace.storage_sizes[sid] == 0 for sid in foreign)
    assert not any(a.storage in foreign for _, _, a in session.schedule.actions())
    return {"plain": plain, "budget": budget, "steps": steps, "foreign": len(foreign),
            "pins": len(session.pins)}


# ---------------------------------------------------------------------------- pipelining


def _stage_outputs(stage: Any) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
    for outputs, inputs in stage.fwd_cache.values():
        yield from ((t, inputs) for t in outputs if isinstance(t, torch.Tensor))


def _schedule(name: str, stage: Any) -> Any:
    """torch's ``"gpipe"`` / ``"1f1b"``, or hyper-offload's executor ``"swap-executor"``
    (``PipelineSwapSchedule``, GPipe order, ``swap=False``: the session plans the
    chunks) and ``"swap-executor-swapping"`` (``swap=True``: the session refuses)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    if name.startswith("swap-executor"):
        from hyper_offload.pipeline import PipelineSwapSchedule

        return PipelineSwapSchedule([stage], MICRO, schedule="gpipe",
                                    loss_fn=nn.functional.mse_loss,
                                    swap=name.endswith("swapping"), timeout=30)
    schedule_type = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    return schedule_type(stage, MICRO, loss_fn=nn.functional.mse_loss)


def pipeline(ctx: Any, arg: tuple[str, int, dict[str, Any]]) -> dict[str, Any]:
    """A pipeline of one stage of 2 blocks per rank, ``arg = (schedule, steps, config)``
    (:func:`_schedule`; more ``OffloadConfig`` fields) over ``MICRO`` micro-batches, SGD
    between steps. The saved bytes are sampled after each micro-batch's forward over
    every micro-batch still waiting for its backward."""
    from torch.distributed.pipelining import PipelineStage

    from hyper_offload.pipeline import swap_wrapper

    schedule_name, steps, config = arg
    x, y = _batch(MICRO * ROWS_PER_MICRO)

    def build(session: OffloadSession | None) -> list[dict[str, Any]]:
        torch.manual_seed(ctx.rank)
        model = nn.Sequential(Block(), Block())
        inner = model
        if schedule_name.startswith("swap-executor"):  # as docs/distributed.md's pipeline section does
            model = nn.Sequential(*(swap_wrapper(block) for block in model))
        stage = PipelineStage(model, ctx.rank, ctx.world_size, torch.device("cpu"))
        schedule = _schedule(schedule_name, stage)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        current: list[SavedPeak] = []

        def sample(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            cached = list(_stage_outputs(stage))
            roots = [output, *(t for t, _ in cached)]
            current[0].sample(roots, [*args, *(i for _, ins in cached for i in ins)])

        inner[-1].register_forward_hook(sample)

        def step(saved: SavedPeak) -> dict[str, Any]:
            current[:] = [saved]
            losses: list[torch.Tensor] = []
            if ctx.rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
            return {"loss": torch.stack(losses).detach().clone() if losses else None,
                    "grads": _grads(model)}

        def after_step() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return session_steps(step, session, list(model.parameters()), after_step, steps)

    return run_stack(build, **config)


def swap_refused(ctx: Any, _: Any) -> str | None:
    """``PipelineSwapSchedule(swap=True)`` inside a session: the plain run, then the
    session's, refused at the step's first op (before any communication) on every rank.
    Returns the refusal."""
    from hyper_offload.errors import OffloadSessionError

    try:
        pipeline(ctx, ("swap-executor-swapping", 1, {}))
    except OffloadSessionError as error:
        return str(error)
    return None


# ---------------------------------------------------------------------------- data parallel


def _model_steps(ctx: Any, wrap: Callable[[nn.Module], nn.Module], steps: int,
                 session: OffloadSession | None, blocks: int = 3) -> list[dict[str, Any]]:
    """A stack of blocks wrapped by ``wrap`` (DDP, FSDP2, ...), each rank its own batch,
    SGD between steps; saved bytes read after the forward."""
    torch.manual_seed(0)
    model = wrap(nn.Sequential(*[Block() for _ in range(blocks)]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(10 + ctx.rank)
    x, y = torch.randn(4 * ROWS_PER_MICRO, HIDDEN, generator=gen), torch.randn(
        4 * ROWS_PER_MICRO, HIDDEN, generator=gen)

    def step(saved: SavedPeak) -> dict[str, Any]:
        loss = nn.functional.mse_loss(model(x), y)
        saved.sample([loss], [x])
        loss.backward()
        return {"loss": loss.detach().clone(), "grads": _grads(model)}

    def after_step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return session_steps(step, session, list(model.parameters()), after_step, steps)


def ddp(ctx: Any, arg: tuple[int, dict[str, Any], bool]) -> dict[str, Any]:
    """``DistributedDataParallel`` (gloo): its first steps run other ops (the bucket
    rebuild on the second iteration). ``compiled``: the middle block is
    ``torch.compile``d (aot_eager) inside the DDP model; the session counts what it
    saves (``StepStats.region_bytes``)."""
    from torch.nn.parallel import DistributedDataParallel

    steps, config, compiled = arg

    def wrap(model: nn.Module) -> nn.Module:
        if compiled:  # Dynamo's DDPOptimizer refuses a first bucket larger than the rest
            torch._dynamo.reset()
            model[1] = torch.compile(model[1], backend="aot_eager")
            return DistributedDataParallel(model)
        return DistributedDataParallel(model, bucket_cap_mb=0.01)

    return run_stack(lambda session: _model_steps(ctx, wrap, steps, session), **config)


def fsdp2(ctx: Any, arg: tuple[int, dict[str, Any]]) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` on each block and the root), 2 ranks sharding everything."""
    from torch.distributed.fsdp import fully_shard

    def wrap(model: nn.Module) -> nn.Module:
        for block in model:
            fully_shard(block)
        return fully_shard(model)

    steps, config = arg
    return run_stack(lambda session: _model_steps(ctx, wrap, steps, session), **config)
