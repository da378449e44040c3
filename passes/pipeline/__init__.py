"""Pipeline-parallel activation swap: MetaStep order IR and rank-local order passes.

Pass order (see :func:`build_rank_orders`): build compute + P2P order → inject FSDP
actions → rewrite P2P transport → inject swap steps. Every pass is a pure
``list[MetaStep] -> list[MetaStep]``; nothing here touches a device or a process group.
"""

from .build import build_rank_orders
from .check_order import (
    OrderError,
    OrderRule,
    OrderViolation,
    assert_valid_order,
    check_order,
    format_order_table,
)
from .execution import check_execution
from .fsdp import UNSHARD_LOOKAHEAD, inject_fsdp_steps
from .meta_step import (
    SWAP_SEQUENCE,
    MetaStep,
    StepFormatError,
    StepKind,
    composite,
    format_order,
    leaf,
    parse_order,
    validate_step,
)
from .orders import (
    SCHEDULES,
    PipelineLayout,
    Placement,
    add_p2p,
    compute_orders,
    fuse_overlap_b_f,
    gpipe_compute_order,
    layout_for,
    one_f_one_b_compute_order,
    split_dx_dw,
)
from .swap import (
    MIN_SWAP_GAP,
    SwapAnchor,
    SwapChunk,
    apply_swap_anchors,
    find_swap_chunks,
    inject_swap_steps,
    strip_swap_steps,
    swap_anchors,
)
from .swap_cost import (
    ActivationSizes,
    ChunkWindow,
    RejectedChunk,
    RejectReason,
    SwapCostModel,
    SwapCostReport,
    choose_swaps,
    peak_bytes,
    plan_rank_swaps,
    plan_swaps,
    resident_curve,
)
from .timeline import (
    Bubble,
    ComputeSlot,
    SwapWindow,
    Timeline,
    TimelineError,
    WindowKind,
    build_timeline,
)
from .transport import TRANSPORTS, rewrite_transport

# The torch conversion imports torch.distributed.pipelining (seconds of start-up); load it
# on first use so that the CLI and pure order passes start fast.
_TORCH_ACTION_EXPORTS = frozenset(
    {
        "from_torch_action",
        "from_torch_actions",
        "to_torch_action",
        "to_torch_actions",
        "torch_compute_orders",
        "torch_pipeline_order",
    }
)


def __getattr__(name: str) -> object:
    if name in _TORCH_ACTION_EXPORTS:
        from . import torch_actions

        return getattr(torch_actions, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "ActivationSizes",
    "Bubble",
    "ChunkWindow",
    "ComputeSlot",
    "RejectReason",
    "RejectedChunk",
    "SwapCostModel",
    "SwapCostReport",
    "SwapWindow",
    "Timeline",
    "TimelineError",
    "WindowKind",
    "build_timeline",
    "choose_swaps",
    "peak_bytes",
    "plan_rank_swaps",
    "plan_swaps",
    "resident_curve",
    "MIN_SWAP_GAP",
    "SCHEDULES",
    "SWAP_SEQUENCE",
    "TRANSPORTS",
    "UNSHARD_LOOKAHEAD",
    "MetaStep",
    "OrderError",
    "OrderRule",
    "OrderViolation",
    "PipelineLayout",
    "Placement",
    "StepFormatError",
    "StepKind",
    "SwapAnchor",
    "SwapChunk",
    "add_p2p",
    "apply_swap_anchors",
    "assert_valid_order",
    "build_rank_orders",
    "check_execution",
    "check_order",
    "composite",
    "compute_orders",
    "find_swap_chunks",
    "format_order",
    "format_order_table",
    "from_torch_action",
    "from_torch_actions",
    "fuse_overlap_b_f",
    "gpipe_compute_order",
    "inject_fsdp_steps",
    "inject_swap_steps",
    "layout_for",
    "leaf",
    "one_f_one_b_compute_order",
    "parse_order",
    "rewrite_transport",
    "split_dx_dw",
    "strip_swap_steps",
    "swap_anchors",
    "to_torch_action",
    "to_torch_actions",
    "torch_compute_orders",
    "torch_pipeline_order",
    "validate_step",
]
