"""Worker-side failure and misuse cases for ``test_pp_swap_dist`` (run in the workers)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .pp_cases import BLOCKS_PER_STAGE, Block, Case, _shard, _stage_modules, batch, loss_fn


def _stages(ctx: Any, case: Case, modules: dict[int, nn.Module], group: Any, indices: Any = None) -> list[Any]:
    from torch.distributed.pipelining import PipelineStage

    from hyper_offload.passes.pipeline import layout_for

    layout = layout_for(case.schedule, num_ranks=case.ranks, stages_per_rank=case.stages_per_rank)
    local = layout.stages_of(ctx.rank) if indices is None else indices
    return [PipelineStage(modules[s], s, case.num_stages, torch.device("cpu"), group=group) for s in local]


def _message(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # the message is what the test checks
        notes = " | ".join(getattr(exc, "__notes__", ()))
        return f"{type(exc).__name__}: {exc} | cause: {exc.__cause__!r} | {notes}"
    return ""


def refuse_reshard_after_forward(ctx: Any, _: Any) -> str | None:
    from hyper_offload.pipeline import PipelineSwapSchedule

    case = Case("zbv", 2, 4, stages_per_rank=2, fsdp=True, reshard_after_forward=True)
    group = ctx.group(2)
    if group is None:
        return None
    modules = _stage_modules(case, swap_wrapped=True)
    local = (ctx.rank, 3 - ctx.rank)
    _shard(ctx, modules, local, reshard_after_forward=True)
    stages = _stages(ctx, case, modules, group)
    return _message(lambda: PipelineSwapSchedule(stages, 4, schedule="zbv", loss_fn=loss_fn, swap=True))


def torch_zbv_fsdp_grads(ctx: Any, reshard_after_forward: bool) -> dict[str, Any] | None:
    """torch's own ScheduleZBVZeroBubble over FSDP2 stages: no swap, no hyper_offload code."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    case = Case("zbv", 2, 4, stages_per_rank=2)
    group = ctx.group(2)
    if group is None:
        return None
    modules = _stage_modules(case, swap_wrapped=False)
    local = (ctx.rank, 3 - ctx.rank)
    _shard(ctx, modules, local, reshard_after_forward)
    sched = ScheduleZBVZeroBubble(_stages(ctx, case, modules, group), 4, loss_fn=loss_fn)
    x, y = batch(case)
    sched.step(x, target=y)
    return {
        f"{s}.{name}": None if p.grad is None else p.grad.full_tensor().detach().clone()
        for s in local for name, p in modules[s].named_parameters()
    }


def misuse_messages(ctx: Any, _: Any) -> dict[str, str] | None:
    from hyper_offload.pipeline import PipelineSwapSchedule

    group = ctx.group(2)
    if group is None:
        return None
    case = Case("gpipe", 2, 4)
    x, y = batch(case)
    out: dict[str, str] = {}
    stages = _stages(ctx, case, _stage_modules(case, swap_wrapped=True), group)
    out["forward_only"] = _message(lambda: PipelineSwapSchedule(stages, 4, schedule="gpipe", swap=True))
    wrong = _stages(ctx, case, _stage_modules(case, swap_wrapped=True), group, indices=(1 - ctx.rank,))
    out["wrong_stages"] = _message(lambda: PipelineSwapSchedule(wrong, 4, schedule="gpipe", loss_fn=loss_fn))
    fsdp_modules = _stage_modules(case, swap_wrapped=True)
    from .pp_cases import _shard

    _shard(ctx, fsdp_modules, (ctx.rank,), reshard_after_forward=False)
    fsdp_stages = _stages(ctx, case, fsdp_modules, group)
    out["overlap_fsdp"] = _message(lambda: PipelineSwapSchedule(
        fsdp_stages, 4, schedule="1f1b", loss_fn=loss_fn, overlap=True, real_overlap=True))
    sched = PipelineSwapSchedule(stages, 4, schedule="gpipe", loss_fn=loss_fn, swap=True)
    out["eval"] = _message(lambda: sched.eval(x, target=y))
    return out


class _Armed(nn.Module):
    """A block that raises on its ``fail_at``-th forward once armed."""

    def __init__(self, block: nn.Module, fail_at: int) -> None:
        super().__init__()
        self.block = block
        self.fail_at = fail_at
        self.calls = 0
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.calls += 1
            if self.calls == self.fail_at:
                raise RuntimeError(f"boom at micro {self.calls - 1}")
        return self.block(x)


class _Tracker:
    """Remembers every storage a swap group held, with its size."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.seen: dict[int, tuple[torch.UntypedStorage, int]] = {}

    def before_step(self, position: int, step: Any) -> None:
        return None

    def after_step(self, position: int, step: Any) -> None:
        manager = self.sched.session.manager
        for sid in manager:
            buffer = manager.buffer(sid)
            self.seen.setdefault(sid, (buffer.storage, buffer.nbytes))


def fail_mid_step(ctx: Any, _: Any) -> dict[str, Any] | None:
    """GPipe on a fresh 2-rank group; rank 1 raises in the FWD of micro 2 during step 2."""
    from torch.distributed.pipelining import PipelineStage

    from hyper_offload.pipeline import PipelineSwapSchedule

    group = dist.new_group([0, 1], timeout=timedelta(seconds=30))  # collective on all ranks
    if ctx.rank >= 2:
        return None
    case = Case("gpipe", 2, 8)
    modules = _stage_modules(case, swap_wrapped=True)
    module = modules[ctx.rank]
    armed = _Armed(module[BLOCKS_PER_STAGE - 1], fail_at=3)
    module[BLOCKS_PER_STAGE - 1] = armed
    stage = PipelineStage(module, ctx.rank, 2, torch.device("cpu"), group=group)
    sched = PipelineSwapSchedule([stage], 8, schedule="gpipe", loss_fn=loss_fn, swap=True, timeout=5)
    tracker = _Tracker(sched)
    sched.observer = tracker
    x, y = batch(case)
    sched.step(x, target=y)
    armed.armed = ctx.rank == 1
    error = _message(lambda: sched.step(x, target=y))
    session = sched.session
    restored = all(storage.nbytes() == nbytes for storage, nbytes in tracker.seen.values())
    stats = session.manager.pool.stats()
    return {
        "error": error,
        "live_groups": len(session.live_groups()),
        "host_bytes_in_use": stats.pinned_bytes_in_use + stats.pageable_bytes_in_use,
        "all_storages_restored": restored and bool(tracker.seen),
    }
