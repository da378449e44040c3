"""Pure analysis and rewriting: IR, trace builders, liveness, planners, the validator.

Nothing here touches a device.
"""

from .chrome_trace import chrome_trace, write_chrome_trace
from .greedy_planner import GreedyResidencyPlanner, select_greedy
from .ilp import OptimalPlannerError, OptimalResidencyPlanner, solve_optimal_choice
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
from .planner_candidates import OffloadCandidate, budget_excess, offload_candidates
from .plan_report import PlanReport, plan_by_choice
from .planning import PlannedSchedule, PlanningError, PlanningStage, backward_start, plan_residency
from .planner_lowering import lower_offload_choice
from .refine import refine_choice
from .refine_prefetch import PrefetchError, hoist_prefetches, prefetch_slots
from .segment_tree import RangeAddMaxTree
from .op_guide import OpGuide, OpGuideEntry, ReplayMismatchError
from .planner_protocol import ResidencyPlanner
from .predicted_timeline import PredictedTimeline, predict_timeline
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
    "PredictedTimeline",
    "chrome_trace",
    "predict_timeline",
    "write_chrome_trace",
    "OffloadCandidate",
    "OptimalPlannerError",
    "OptimalResidencyPlanner",
    "PrefetchError",
    "RangeAddMaxTree",
    "budget_excess",
    "hoist_prefetches",
    "lower_offload_choice",
    "offload_candidates",
    "plan_by_choice",
    "prefetch_slots",
    "refine_choice",
    "select_greedy",
    "solve_optimal_choice",
    "PlanReport",
    "PlannedSchedule",
    "PlanningError",
    "PlanningStage",
    "backward_start",
    "plan_residency",
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
