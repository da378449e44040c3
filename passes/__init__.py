"""Pure analysis and rewriting: IR, trace builders, liveness, planners, the validator.

Nothing here touches a device.
"""

from .greedy_planner import GreedyResidencyPlanner, PlanReport
from .ilp import OptimalResidencyPlanner
from .liveness import (
    Gap,
    InfeasibleOp,
    StorageLiveness,
    access_gaps,
    infeasible_ops,
    required_bytes,
    resident_bytes_without_offload,
    storage_liveness,
)
from .op_guide import OpGuide, OpGuideEntry, ReplayMismatchError
from .planner_protocol import ResidencyPlanner
from .schedule import ActionKind, ResidencyAction, ResidencySchedule
from .trace import (
    AccessKind,
    ActivationTrace,
    StorageAccess,
    TraceFormatError,
    TraceOp,
)
from .validator import Rule, ScheduleError, ScheduleReport, Violation, check_schedule

__all__ = [
    "GreedyResidencyPlanner",
    "OptimalResidencyPlanner",
    "PlanReport",
    "AccessKind",
    "ActionKind",
    "ActivationTrace",
    "Gap",
    "InfeasibleOp",
    "OpGuide",
    "OpGuideEntry",
    "ReplayMismatchError",
    "ResidencyAction",
    "ResidencyPlanner",
    "ResidencySchedule",
    "Rule",
    "ScheduleError",
    "ScheduleReport",
    "StorageAccess",
    "StorageLiveness",
    "TraceFormatError",
    "TraceOp",
    "Violation",
    "access_gaps",
    "check_schedule",
    "infeasible_ops",
    "required_bytes",
    "resident_bytes_without_offload",
    "storage_liveness",
]
