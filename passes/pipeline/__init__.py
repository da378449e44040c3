"""Pipeline-parallel activation swap: MetaStep order IR and rank-local order passes.

Pass order (see :func:`build_rank_orders`): build compute + P2P order → inject FSDP
actions → rewrite P2P transport → inject swap steps. Every pass is a pure
``list[MetaStep] -> list[MetaStep]``; nothing here touches a device or a process group.

Public here: the order IR, building and checking orders, planning swaps, the timeline,
and the bridge to torch's pipelining actions. The individual passes (``compute_orders``,
``inject_swap_steps``, ``rewrite_transport``, ...) live in their modules: ``build`` (the
compute orders, P2P, FSDP and transport passes, and the pipeline that runs them),
``swap``, ``swap_cost``, ``execution``, ``residency``, ``torch_actions``.
"""

from hyper_offload._lazy import lazy_getattr
from hyper_offload.errors import OrderError, StepFormatError, TimelineError

from .build import PipelineLayout, SCHEDULES, TRANSPORTS, build_rank_orders, layout_for
from .check_order import (
    OrderRule,
    OrderViolation,
    assert_valid_order,
    check_order,
    format_order_table,
)
from .meta_step import MetaStep, StepKind, format_order, parse_order
from .residency import (
    ActivationSizes,
    StageFootprint,
    StageFootprints,
    predicted_peak,
    resident_curve,
    step_curve,
)
from .execution import SendReleases, send_releases
from .swap_cost import (
    SwapCostModel,
    SwapCostReport,
    plan_rank_swaps,
    plan_swaps,
)
from .timeline import Timeline, build_timeline

__all__ = [
    "ActivationSizes",
    "MetaStep",
    "OrderError",
    "OrderRule",
    "OrderViolation",
    "PipelineLayout",
    "SCHEDULES",
    "SendReleases",
    "StepFormatError",
    "StageFootprint",
    "StageFootprints",
    "StepKind",
    "SwapCostModel",
    "SwapCostReport",
    "TRANSPORTS",
    "Timeline",
    "TimelineError",
    "assert_valid_order",
    "build_rank_orders",
    "build_timeline",
    "check_order",
    "format_order",
    "format_order_table",
    "layout_for",
    "parse_order",
    "plan_rank_swaps",
    "plan_swaps",
    "predicted_peak",
    "resident_curve",
    "send_releases",
    "step_curve",
    "torch_pipeline_order",
]

# The torch conversion imports torch.distributed.pipelining (seconds of start-up); load it
# on first use so that the CLI and pure order passes start fast.
_LAZY = {"torch_pipeline_order": ".torch_actions"}


__getattr__ = lazy_getattr(__name__, _LAZY)
