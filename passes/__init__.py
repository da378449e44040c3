"""Pure analysis and rewriting: IR, trace builders, liveness, planners, the validator.

Nothing here touches a device or imports the runtime. Four subpackages, each importing
only the ones before it, and the pipeline passes beside them:

* :mod:`.ir` — the trace and schedule records, and the ``hyper_offload::`` op declarations;
* :mod:`.analysis` — liveness, offload gaps, the one validator, the one timeline model,
  the stall bound, the Chrome-trace export;
* :mod:`.plan` — planners, refinement, release and prefetch placement, and
  :func:`plan_residency`, the one planning pipeline every door runs;
* :mod:`.fx` — the compile path's FX passes (trace builder, saved tensors, lowering, its check);
* :mod:`.pipeline` — pipeline-parallel orders and their passes.

Public here is what users and the doors build with: the trace and schedule IR, the one
validator, the planners, the one planning pipeline, the liveness figures users read, the
predicted timeline and its Chrome-trace export. The building blocks stay in their
modules and are imported from there.
"""

from .analysis.chrome_trace import chrome_trace, write_chrome_trace
from .analysis.liveness import InfeasibleOp, required_bytes, resident_bytes_without_offload
from .analysis.predicted_timeline import PredictedTimeline, predict_timeline
from .analysis.validator import Rule, ScheduleError, ScheduleReport, Violation, check_schedule
from .ir.schedule import ActionKind, ResidencyAction, ResidencySchedule
from .ir.trace import AccessKind, ActivationTrace, StorageAccess, TraceFormatError, TraceOp
from .plan.greedy import GreedyResidencyPlanner, OptimalPlannerError, OptimalResidencyPlanner
from .plan.planning import PlannedSchedule, PlanningError, PlanningStage, plan_residency
from .plan.report import ResidencyPlanner

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
