"""Worker-side cases for the multi-process pipeline tests (run inside ``dist_harness``).

The model is a stack of MLP blocks (``h -> 4h -> GELU -> h``), tiny in parameters but
heavy in activations, so swapped bytes dominate each rank's memory. Every rank builds the
same full model from one seed and keeps the stages the layout gives it; the test process
builds it too, for the single-process reference.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

HIDDEN = 16
ROWS_PER_MICRO = 32
BLOCKS_PER_STAGE = 2


@dataclass(frozen=True)
class Case:
    schedule: str
    ranks: int
    micro: int
    stages_per_rank: int = 1
    transport: str = "plain"
    fsdp: bool = False
    dxdw_split: bool = False
    overlap: bool = False
    real_overlap: bool = False
    steps: int = 2
    measure: bool = True
    reshard_after_forward: bool = False
    group_swap: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return self.ranks * self.stages_per_rank

    def label(self) -> str:
        parts = [self.schedule, f"{self.ranks}r", f"{self.micro}mb", self.transport]
        parts += [name for name in ("fsdp", "dxdw_split", "overlap", "real_overlap", "group_swap") if getattr(self, name)]
        parts += [f"{k}={v}" for k, v in sorted(self.extra.items())]
        return "-".join(parts)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def full_model(num_stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[
        nn.Sequential(*[Block() for _ in range(BLOCKS_PER_STAGE)]) for _ in range(num_stages)
    ])


def batch(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(case.micro * ROWS_PER_MICRO, HIDDEN, generator=gen)
    y = torch.randn(case.micro * ROWS_PER_MICRO, HIDDEN, generator=gen)
    return x, y


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def reference(case: Case) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Single process: micro-batches in order, gradients accumulated, divided by M."""
    model = full_model(case.num_stages)
    x, y = batch(case)
    losses = []
    for xs, ys in zip(x.chunk(case.micro), y.chunk(case.micro)):
        loss = loss_fn(model(xs), ys)
        loss.backward()
        losses.append(loss.detach())
    for p in model.parameters():
        p.grad.div_(case.micro)
    return losses, {name: p.grad for name, p in model.named_parameters()}


def _stage_modules(case: Case, swap_wrapped: bool) -> dict[int, nn.Module]:
    from hyper_offload.pipeline import swap_wrapper

    model = full_model(case.num_stages)
    modules = {}
    for index, stage in enumerate(model):
        stage = copy.deepcopy(stage)
        if swap_wrapped:
            for i, block in enumerate(stage):
                stage[i] = swap_wrapper(block, group_swap=case.group_swap)
        modules[index] = stage
    return modules


def run_case(ctx: Any, arg: tuple[Case, bool]) -> dict[str, Any] | None:
    """One configuration on this rank: ``steps`` steps; returns losses, grads, memory."""
    from torch.distributed.pipelining import PipelineStage

    from hyper_offload.passes.pipeline import layout_for, predicted_peak
    from hyper_offload.runtime import DeviceMemoryMeter
    from hyper_offload.pipeline import PipelineSwapSchedule
    from hyper_offload.runtime.pipeline import FootprintRecorder

    case, swap = arg
    group = ctx.group(case.ranks)
    if group is None:
        return None
    rank = ctx.rank
    layout = layout_for(case.schedule, num_ranks=case.ranks, stages_per_rank=case.stages_per_rank)
    modules = _stage_modules(case, swap_wrapped=True)
    local = layout.stages_of(rank)
    if case.fsdp:
        _shard(ctx, modules, local, case.reshard_after_forward)
    stages = [PipelineStage(modules[s], s, case.num_stages, torch.device("cpu"), group=group) for s in local]
    extra = dict(case.extra)
    if extra.pop("cost_aware", False):
        from hyper_offload.passes.pipeline import ActivationSizes, SwapCostModel

        # One chunk = what a stage's swap_wrapper'd blocks save per micro-batch (fp32).
        per_chunk = BLOCKS_PER_STAGE * (ROWS_PER_MICRO * (4 * HIDDEN * 2 + HIDDEN) * 4)
        extra.update(swap_cost=SwapCostModel(), activation_sizes=ActivationSizes(default_bytes=per_chunk))
    sched = PipelineSwapSchedule(
        stages, case.micro, schedule=case.schedule, loss_fn=loss_fn, swap=swap, transport=case.transport,
        dxdw_split=case.dxdw_split, overlap=case.overlap, real_overlap=case.real_overlap, timeout=30,
        **extra,
    )
    x, y = batch(case)
    result: dict[str, Any] = {"losses": [], "peaks": [], "live_groups": [], "pool_bytes": [], "copies": []}
    if sched.swap_report is not None:
        result["chosen"] = sorted(sched.swap_report.chosen)
        result["eligible"] = sorted(sched.session.eligible)
    recorder = _Recorder(sched) if swap and case.measure else None
    footprints = None
    try:
        for step in range(case.steps):
            for module in modules.values():
                module.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            meter = DeviceMemoryMeter("cpu")
            # Step 1 calibrates the residency model (stage footprints); later steps are
            # predicted from it and measured.
            calibrating = swap and case.measure and step == 0
            sched.observer = _Both(recorder, FootprintRecorder(meter, sched.session)) if calibrating else recorder
            with meter if case.measure else _null():
                sched.step(x, target=y, losses=losses)
            if calibrating:
                footprints = sched.observer.second.footprints(sched.last_sends)
            result["losses"].append([loss.detach() for loss in losses])
            result["peaks"].append(meter.peak_bytes)
            if sched.session is not None:
                _record_session(result, sched.session)
    finally:
        sched.close()
    result["grads"] = {
        f"{s}.{name}": _full_grad(p) for s in local for name, p in modules[s].named_parameters()
    }
    result["order"] = [repr(step) for step in sched.order]
    result["send_releases"] = dict(sched.send_releases or {})
    result["last_sends"] = {key: tuple(sent) for key, sent in sched.last_sends.items()}
    result["generation"] = sched.session.generation if sched.session is not None else 0
    if recorder is not None:
        result.update(recorder.summary())
    if footprints is not None:
        releases = sched.send_releases
        result["footprint_peak"] = predicted_peak(sched.order, footprints, releases=releases)
        result["footprint_peak_activations_only"] = predicted_peak(
            sched.order, footprints, weight_swapped=(), releases=releases
        )
        result["footprint_peak_without"] = predicted_peak(
            sched.order, footprints, swapped=(), weight_swapped=(), releases=releases
        )
    return result


class _Both:
    """Two step observers, called in turn."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def before_step(self, position: int, step: Any) -> None:
        for observer in (self.first, self.second):
            if observer is not None:
                observer.before_step(position, step)

    def after_step(self, position: int, step: Any) -> None:
        for observer in (self.first, self.second):
            if observer is not None:
                observer.after_step(position, step)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class _Recorder:
    """Samples the bytes the session's groups hold on the device around each step."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.before: dict[int, int] = {}
        self.measured: dict[int, int] = {}

    def before_step(self, position: int, step: Any) -> None:
        self.before[position] = self.sched.session.resident_bytes()

    def after_step(self, position: int, step: Any) -> None:
        after = self.sched.session.resident_bytes()
        self.measured[position] = after if step.is_swap else max(after, self.before[position])

    def summary(self) -> dict[str, Any]:
        from hyper_offload.passes.pipeline import ActivationSizes, resident_curve

        session = self.sched.session
        swapped_only = ActivationSizes(per_chunk=dict(session.group_bytes))
        # Every micro-batch of a stage has the same activations: size unswapped chunks too.
        every_chunk = ActivationSizes(per_stage={s: n for (s, _), n in session.group_bytes.items()})
        order = self.sched.order
        return {
            "measured_curve": [self.measured[p] for p in range(len(order))],
            "predicted_curve": resident_curve(order, swapped_only),
            "predicted_without": resident_curve(order, swapped_only, swapped=()),
            "predicted_peak_all": max(resident_curve(order, every_chunk), default=0),
            "predicted_peak_all_without": max(resident_curve(order, every_chunk, swapped=()), default=0),
            "group_bytes": dict(session.group_bytes),
        }


def _record_session(result: dict[str, Any], session: Any) -> None:
    """What one step left in the swap session: groups, pool, copies, verified steps."""
    result["live_groups"].append(len(session.live_groups()))
    result["pool_bytes"].append(session.manager.pool.stats().pinned_bytes_held)
    result["copies"].append(session.copies())
    result["weight_swapped"] = sorted(session.weight_swapped)
    result["verified_steps"] = session.verified_steps


def _full_grad(param: torch.Tensor) -> torch.Tensor:
    grad = param.grad
    if grad is None:
        return None  # type: ignore[return-value]
    if hasattr(grad, "full_tensor"):
        grad = grad.full_tensor()
    return grad.detach().clone()


def _shard(ctx: Any, modules: dict[int, nn.Module], local: tuple[int, ...], reshard_after_forward: bool) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(ctx.self_group, "cpu")
    for s in local:
        fully_shard(modules[s], mesh=mesh, reshard_after_forward=reshard_after_forward)


def case_dict(case: Case) -> dict[str, Any]:
    return asdict(case)
