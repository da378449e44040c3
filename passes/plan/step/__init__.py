"""The step model: one training step, whatever door saw it, laid out and planned as one.

* :mod:`.model` — the records a door fills: :class:`StepTimeline` (the invocations'
  forwards and backwards, in order, and the eager code between them) and
  :class:`RegionFloor` (one region's trace and the schedule its graphs run);
* :mod:`.layout` — :func:`lay_out_step`, the one layout of a step (:class:`StepTrace`);
* :mod:`.planner` — :class:`~.planner.StepPlanner`, the step's proposals, run by
  ``plan_residency``, and which slots each keeps on the device, with the one host ledger
  (:func:`~.planner.choose_keep`);
* :mod:`.plan` — :func:`plan_step`, the entry: a :class:`StepPlan` with one summary.

Pure: no torch.
"""

from .layout import StepTrace, lay_out_step
from .model import BetweenRegions, Invocation, RegionFloor, StepEvent, StepEventKind, StepTimeline
from .plan import FloorOp, InvocationPlan, StepPlan, plan_step

__all__ = [
    "BetweenRegions", "FloorOp", "Invocation", "InvocationPlan", "RegionFloor", "StepEvent",
    "StepEventKind", "StepPlan", "StepTimeline", "StepTrace", "lay_out_step", "plan_step",
]
