"""Rank-local order construction: compute order, overlap / dx-dw variants, P2P steps.

Stages are numbered globally ``0 .. num_stages-1``; a rank holds ``stages_per_rank`` of them:
``loop`` placement puts stage ``s`` on rank ``s % num_ranks`` (GPipe, 1F1B, interleaved
schedules); ``v`` placement puts stages ``r`` and ``2R-1-r`` on rank ``r`` (ZBV, DualPipeV).

Compute orders hold compute slots only (FWD/BWD/BWD_INPUT/BWD_WEIGHT leaves and OVERLAP
composites). :func:`add_p2p` then adds, per compute leaf whose neighbour stage lives on
another rank (the stage in a P2P step is the stage that owns the step, as in torch):

* ``RECV_F s m`` right before the slot with ``F s m`` (s > 0), ``SEND_F s m`` right after it
  (s < last);
* ``RECV_B s m`` right before the slot with ``B s m`` / ``I s m`` (s < last), ``SEND_B s m``
  right after it (s > 0); ``W`` has no P2P.

Within one slot, receives follow the order of the slot's leaves, and so do sends.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple

from hyper_offload.errors import ConfigurationError

from .meta_step import MetaStep, StepKind

#: Schedule names accepted by :func:`compute_orders` and ``build_rank_orders``.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
_V_SCHEDULES = frozenset({"zbv", "dualpipev"})
_SINGLE_STAGE_SCHEDULES = frozenset({"gpipe", "1f1b"})


class Placement(str, Enum):
    """How global stages are laid out over ranks (see the module docstring)."""

    LOOP = "loop"
    V = "v"

    def __repr__(self) -> str:
        return self.value


class PipelineLayout(NamedTuple):
    """Which rank holds which global stage (see the module docstring for the two styles)."""

    num_ranks: int
    stages_per_rank: int
    style: Placement = Placement.LOOP

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise ConfigurationError(f"stage {stage} outside 0..{self.num_stages - 1}")
        if self.style is Placement.LOOP:
            return stage % self.num_ranks
        lap, offset = divmod(stage, self.num_ranks)
        return offset if lap % 2 == 0 else self.num_ranks - 1 - offset

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s in range(self.num_stages) if self.rank_of(s) == rank)


def layout_for(schedule: str, *, num_ranks: int, stages_per_rank: int) -> PipelineLayout:
    """The stage placement ``schedule`` uses; raises ConfigurationError for shapes it cannot run."""
    if schedule not in SCHEDULES:
        raise ConfigurationError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if num_ranks < 1 or stages_per_rank < 1:
        raise ConfigurationError(f"num_ranks ({num_ranks}) and stages_per_rank ({stages_per_rank}) must be >= 1")
    if schedule in _SINGLE_STAGE_SCHEDULES and stages_per_rank != 1:
        raise ConfigurationError(
            f"schedule {schedule!r} runs one stage per rank, got stages_per_rank={stages_per_rank}; "
            "use interleaved-1f1b for several virtual stages"
        )
    if schedule in _V_SCHEDULES and stages_per_rank != 2:
        raise ConfigurationError(
            f"schedule {schedule!r} is V-shaped and needs stages_per_rank=2, got {stages_per_rank}"
        )
    style = Placement.V if schedule in _V_SCHEDULES else Placement.LOOP
    return PipelineLayout(num_ranks, stages_per_rank, style)


def gpipe_compute_order(rank: int, num_microbatches: int) -> list[MetaStep]:
    """GPipe on stage ``rank``: every forward, then every backward, micro-batches ascending."""
    return [MetaStep(StepKind.FWD, rank, m) for m in range(num_microbatches)] + [
        MetaStep(StepKind.BWD, rank, m) for m in range(num_microbatches)
    ]


def one_f_one_b_compute_order(rank: int, num_ranks: int, num_microbatches: int) -> list[MetaStep]:
    """Classic 1F1B on stage ``rank``, exactly as torch's ``Schedule1F1B`` runtime executes it.

    Warm-up runs ``min(M, R - rank)`` forwards; then backward and forward alternate (1B1F)
    until the forwards run out; the cool-down runs the remaining backwards.
    """
    warmup = min(num_microbatches, num_ranks - rank)
    order = [MetaStep(StepKind.FWD, rank, m) for m in range(warmup)]
    next_fwd, next_bwd = warmup, 0
    while next_bwd < num_microbatches:
        order.append(MetaStep(StepKind.BWD, rank, next_bwd))
        next_bwd += 1
        if next_fwd < num_microbatches:
            order.append(MetaStep(StepKind.FWD, rank, next_fwd))
            next_fwd += 1
    return order


def compute_orders(
    schedule: str, *, num_ranks: int, stages_per_rank: int, num_microbatches: int
) -> dict[int, list[MetaStep]]:
    """Compute-only order of every rank. GPipe and 1F1B are built here; the interleaved and
    V-shaped schedules come from torch's own order generators (see ``torch_actions``)."""
    layout_for(schedule, num_ranks=num_ranks, stages_per_rank=stages_per_rank)
    if num_microbatches < 1:
        raise ConfigurationError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if schedule == "gpipe":
        return {r: gpipe_compute_order(r, num_microbatches) for r in range(num_ranks)}
    if schedule == "1f1b":
        return {r: one_f_one_b_compute_order(r, num_ranks, num_microbatches) for r in range(num_ranks)}
    # Imported here: torch.distributed.pipelining is only needed for torch-built schedules.
    from .torch_actions import torch_compute_orders

    return torch_compute_orders(
        schedule, num_ranks=num_ranks, stages_per_rank=stages_per_rank, num_microbatches=num_microbatches
    )


def fuse_overlap_b_f(order: Sequence[MetaStep]) -> list[MetaStep]:
    """Pair each backward leaf (BWD / BWD_INPUT) that is directly followed by a forward leaf
    into one ``OVERLAP_B_F(backward, forward)`` slot — the steady-state B/F pairs of 1F1B-like
    orders. Everything else is kept as is."""
    out: list[MetaStep] = []
    i = 0
    while i < len(order):
        step = order[i]
        nxt = order[i + 1] if i + 1 < len(order) else None
        if step.kind in (StepKind.BWD, StepKind.BWD_INPUT) and nxt is not None and nxt.kind is StepKind.FWD:
            out.append(MetaStep(StepKind.OVERLAP_B_F, None, None, (step, nxt)))
            i += 2
        else:
            out.append(step)
            i += 1
    return out


def split_dx_dw(order: Sequence[MetaStep]) -> list[MetaStep]:
    """Split each BWD into BWD_INPUT (dx) and BWD_WEIGHT (dw).

    The BWD_INPUT takes the BWD's place (inside an OVERLAP composite too); the BWD_WEIGHT
    becomes its own slot right after. Stage 0 keeps a plain BWD: it sends no input gradient,
    so there is nothing to run early.
    """
    out: list[MetaStep] = []
    for step in order:
        weights: list[MetaStep] = []
        if step.kind in (StepKind.OVERLAP_B_F, StepKind.OVERLAP_F_B):
            subs = []
            for sub in step.sub_steps:
                dx, dw = _split_one(sub)
                subs.append(dx)
                weights.extend(dw)
            out.append(step._replace(sub_steps=tuple(subs)))
        else:
            dx, dw = _split_one(step)
            out.append(dx)
            weights.extend(dw)
        out.extend(weights)
    return out


def _split_one(step: MetaStep) -> tuple[MetaStep, list[MetaStep]]:
    if step.kind is not StepKind.BWD or step.stage == 0:
        return step, []
    return step._replace(kind=StepKind.BWD_INPUT), [step._replace(kind=StepKind.BWD_WEIGHT)]


def add_p2p(order: Sequence[MetaStep], layout: PipelineLayout, rank: int) -> list[MetaStep]:
    """Add plain P2P leaves around each compute slot (rules in the module docstring)."""
    out: list[MetaStep] = []
    for step in order:
        if not step.is_compute_slot:
            raise ConfigurationError(
                f"rank {rank}: add_p2p expects a compute-only order, found {step!r}; "
                "run it before the FSDP, transport and swap passes"
            )
        leaves = list(step.leaves())
        for leaf_step in leaves:
            _check_on_rank(leaf_step, layout, rank)
        out.extend(r for leaf_step in leaves if (r := _recv_for(leaf_step, layout)) is not None)
        out.append(step)
        out.extend(s for leaf_step in leaves if (s := _send_for(leaf_step, layout)) is not None)
    return out


def _check_on_rank(step: MetaStep, layout: PipelineLayout, rank: int) -> None:
    assert step.stage is not None
    if layout.rank_of(step.stage) != rank:
        raise ConfigurationError(
            f"rank {rank}: step {step!r} belongs to stage {step.stage}, which lives on rank "
            f"{layout.rank_of(step.stage)} in a {layout.style.value} layout"
        )


def _crosses(stage: int, neighbour: int, layout: PipelineLayout) -> bool:
    return 0 <= neighbour < layout.num_stages and layout.rank_of(neighbour) != layout.rank_of(stage)


def _recv_for(step: MetaStep, layout: PipelineLayout) -> MetaStep | None:
    assert step.stage is not None
    if step.kind is StepKind.FWD and _crosses(step.stage, step.stage - 1, layout):
        return MetaStep(StepKind.RECV_F, step.stage, step.micro)
    if step.kind in (StepKind.BWD, StepKind.BWD_INPUT) and _crosses(step.stage, step.stage + 1, layout):
        return MetaStep(StepKind.RECV_B, step.stage, step.micro)
    return None


def _send_for(step: MetaStep, layout: PipelineLayout) -> MetaStep | None:
    assert step.stage is not None
    if step.kind is StepKind.FWD and _crosses(step.stage, step.stage + 1, layout):
        return MetaStep(StepKind.SEND_F, step.stage, step.micro)
    if step.kind in (StepKind.BWD, StepKind.BWD_INPUT) and _crosses(step.stage, step.stage - 1, layout):
        return MetaStep(StepKind.SEND_B, step.stage, step.micro)
    return None
