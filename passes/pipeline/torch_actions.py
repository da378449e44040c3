"""Conversion between torch.distributed.pipelining action lists and MetaStep orders.

torch describes a schedule as ``pipeline_order: dict[rank, list[_Action | None]]`` (``None``
is a bubble). :func:`from_torch_actions` turns one rank's list into a MetaStep order (bubbles
dropped: a rank-local order has no notion of time slots); :func:`to_torch_actions` goes
back for the kinds torch knows. :func:`torch_pipeline_order` builds a torch schedule's
``pipeline_order`` **without processes**: the schedule classes only read a few attributes
of their stages while computing the order (``num_stages``, ``group_size``, ``group_rank``,
``stage_index``, ``submod`` for a torch.compile check), so a placeholder object that has
just those attributes is enough. No process group is created and no step is run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from hyper_offload.errors import ConfigurationError, TorchCompatibilityError

from .meta_step import COMPOSITE_KINDS, MetaStep, StepKind, validate_step

# torch's action kinds by *member name*: the names are stable across releases, the values are
# not (torch <= 2.10 numbers them 1, 2, ... and prints the short form through __str__; newer
# releases make the short form the value). OVERLAP_B_F, BATCH_SEND_RECV and the swap kinds
# have no torch counterpart.
_KIND_OF_TORCH_NAME: dict[str, StepKind] = {
    "FORWARD": StepKind.FWD,
    "FULL_BACKWARD": StepKind.BWD,
    "BACKWARD_INPUT": StepKind.BWD_INPUT,
    "BACKWARD_WEIGHT": StepKind.BWD_WEIGHT,
    "UNSHARD": StepKind.FSDP_UNSHARD,
    "RESHARD": StepKind.FSDP_RESHARD,
    "SEND_F": StepKind.SEND_F,
    "RECV_F": StepKind.RECV_F,
    "SEND_B": StepKind.SEND_B,
    "RECV_B": StepKind.RECV_B,
    "OVERLAP_F_B": StepKind.OVERLAP_F_B,
    "REDUCE_GRAD": StepKind.REDUCE_GRAD,
}
# The installed torch's members for the kinds it has.
_TORCH_TYPE_OF_KIND: dict[StepKind, _ComputationType] = {
    kind: _ComputationType[name]
    for name, kind in _KIND_OF_TORCH_NAME.items()
    if name in _ComputationType.__members__
}

#: Schedule names we take from torch's own order generators, and their class names (looked
#: up when used: older torch releases lack some of them).
TORCH_SCHEDULE_CLASSES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def from_torch_action(action: _Action) -> MetaStep:
    """One torch action as a MetaStep (composites keep their sub-steps, stage ``-1`` → None)."""
    name = action.computation_type.name
    if name not in _KIND_OF_TORCH_NAME:
        raise ConfigurationError(
            f"torch action {action}: computation type {name} has no MetaStep kind; "
            f"known: {', '.join(_KIND_OF_TORCH_NAME)} (add it to _KIND_OF_TORCH_NAME in torch_actions.py)"
        )
    kind = _KIND_OF_TORCH_NAME[name]
    sub_actions = getattr(action, "sub_actions", None)  # torch <= 2.8 actions have no sub_actions
    if sub_actions:
        step = MetaStep(kind, None, None, tuple(from_torch_action(a) for a in sub_actions))
    else:
        step = MetaStep(kind, action.stage_index, action.microbatch_index)
    validate_step(step)
    return step


def from_torch_actions(actions: Iterable[_Action | None]) -> list[MetaStep]:
    """A rank's torch action list as a MetaStep order; ``None`` bubbles are dropped."""
    return [from_torch_action(a) for a in actions if a is not None]


def to_torch_action(step: MetaStep) -> _Action:
    """One MetaStep as a torch action; raises for kinds torch has no action for."""
    if step.kind not in _TORCH_TYPE_OF_KIND:
        raise ConfigurationError(
            f"step {step!r}: torch.distributed.pipelining has no action for {step.kind.name}; "
            "convert the order before the transport and swap passes (or flatten BATCH_SEND_RECV)"
        )
    ctype = _TORCH_TYPE_OF_KIND[step.kind]
    if step.kind in COMPOSITE_KINDS:
        return _Action(-1, ctype, None, tuple(to_torch_action(s) for s in step.sub_steps))
    assert step.stage is not None  # validate_step guarantees a stage on every leaf
    return _Action(step.stage, ctype, step.micro)


def to_torch_actions(order: Sequence[MetaStep]) -> list[_Action]:
    return [to_torch_action(step) for step in order]


class _OrderOnlyStage:
    """Stands in for a PipelineStage while a torch schedule computes its pipeline_order.

    Carries only what the schedule constructors read; using it to run a step fails loudly
    (no forward/backward methods), which is what we want.
    """

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = torch.nn.Module()
        self.stage_index_to_group_rank: dict[int, int] = {}


def torch_pipeline_order(
    schedule: str, *, num_ranks: int, stages_per_rank: int, num_microbatches: int
) -> dict[int, list[_Action | None]]:
    """torch's compute-only ``pipeline_order`` for ``schedule``, built without processes.

    Raises ``ConfigurationError`` (with torch's reason) for combinations torch rejects.
    Note: torch 2.13's ``Schedule1F1B`` order is malformed for lowering (the last rank lacks
    ``F0``); use :func:`~hyper_offload.passes.pipeline.build.compute_orders` for 1F1B.
    """
    if schedule not in TORCH_SCHEDULE_CLASSES:
        raise ConfigurationError(
            f"schedule {schedule!r}: torch has no order generator we use for it; "
            f"known: {', '.join(TORCH_SCHEDULE_CLASSES)}"
        )
    cls = getattr(torch_schedules, TORCH_SCHEDULE_CLASSES[schedule], None)
    if cls is None:
        raise ConfigurationError(
            f"schedule {schedule!r} needs torch.distributed.pipelining."
            f"{TORCH_SCHEDULE_CLASSES[schedule]}, which torch {torch.__version__} does not have"
        )
    num_stages = num_ranks * stages_per_rank
    try:
        if issubclass(cls, torch_schedules.PipelineScheduleSingle):
            stage = _OrderOnlyStage(0, num_stages, num_ranks, 0)
            order = cls(stage, num_microbatches)._get_pipeline_order()
        else:
            stages = [_OrderOnlyStage(i, num_stages, num_ranks, 0) for i in range(stages_per_rank)]
            order = cls(stages, num_microbatches).pipeline_order
    except (ValueError, AssertionError, RuntimeError, ZeroDivisionError) as exc:
        raise ConfigurationError(
            f"torch {cls.__name__} rejects ranks={num_ranks}, stages_per_rank={stages_per_rank}, "
            f"microbatches={num_microbatches}: {exc}"
        ) from exc
    except AttributeError as exc:
        # This torch version reads more of its stages than _OrderOnlyStage provides.
        raise TorchCompatibilityError(
            f"torch {cls.__name__} ({torch.__version__}) needs a stage attribute the order-only "
            f"placeholder lacks ({exc}); add it to _OrderOnlyStage in torch_actions.py"
        ) from exc
    assert order is not None
    return {rank: list(actions) for rank, actions in order.items()}


def torch_compute_orders(
    schedule: str, *, num_ranks: int, stages_per_rank: int, num_microbatches: int
) -> dict[int, list[MetaStep]]:
    """:func:`torch_pipeline_order` as compute-only MetaStep orders.

    Bubbles are dropped, and so is the ``REDUCE_GRAD`` that torch's single-stage schedules
    append: our FSDP pass adds its own.
    """
    raw = torch_pipeline_order(
        schedule, num_ranks=num_ranks, stages_per_rank=stages_per_rank, num_microbatches=num_microbatches
    )
    return {
        rank: [s for s in from_torch_actions(actions) if s.is_compute_slot]
        for rank, actions in sorted(raw.items())
    }
