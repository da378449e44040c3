"""Pure analysis and rewriting: IR, trace builders, liveness, planners, the validator.

Nothing here touches a device; nothing here imports the runtime except the transfer-op
declarations (:mod:`hyper_offload.runtime.op_declarations`, for the FX passes).

Public here is what users and the doors build with: the trace and schedule IR, the one
validator, the planners, the one planning pipeline (:func:`plan_residency`), the
liveness figures users read, the predicted timeline and its Chrome-trace export.
The building blocks stay in their modules (``liveness``, ``planner_candidates``,
``refine``, ``refine_prefetch``, ``segment_tree``, ``op_guide``, ``fx_trace``,
``fx_lowering``, ``fx_schedule``, ``cost_model``, ...) and are imported from there.
"""

from .chrome_trace import chrome_trace, write_chrome_trace
from .greedy_planner import GreedyResidencyPlanner
from .ilp import OptimalPlannerError, OptimalResidencyPlanner
from .liveness import InfeasibleOp, required_bytes, resident_bytes_without_offload
from .planner_protocol import ResidencyPlanner
from .planning import PlannedSchedule, PlanningError, PlanningStage, plan_residency
from .predicted_timeline import PredictedTimeline, predict_timeline
from .schedule import ActionKind, ResidencyAction, ResidencySchedule
from .trace import AccessKind, ActivationTrace, StorageAccess, TraceFormatError, TraceOp
from .validator import Rule, ScheduleError, ScheduleReport, Violation, check_schedule

__all__ = [
    # IR
    "AccessKind",
    "ActionKind",
    "ActivationTrace",
    "ResidencyAction",
    "ResidencySchedule",
    "StorageAccess",
    "TraceFormatError",
    "TraceOp",
    # the one validator
    "Rule",
    "ScheduleError",
    "ScheduleReport",
    "Violation",
    "check_schedule",
    # planners and the one planning pipeline
    "GreedyResidencyPlanner",
    "OptimalPlannerError",
    "OptimalResidencyPlanner",
    "PlannedSchedule",
    "PlanningError",
    "PlanningStage",
    "ResidencyPlanner",
    "plan_residency",
    # figures
    "InfeasibleOp",
    "PredictedTimeline",
    "chrome_trace",
    "predict_timeline",
    "required_bytes",
    "resident_bytes_without_offload",
    "write_chrome_trace",
]
