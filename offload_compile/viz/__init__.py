"""Plots (matplotlib, the optional ``plot`` extra; imported only when a plot is drawn).

* :func:`plot_plan` — a residency plan: resident bytes per op against the budget
  (:mod:`.plan_plot`);
* :func:`plot_timeline` — a pipeline timeline: steps per rank, swap copies
  (:mod:`.pipeline_plot`);
* :class:`PlotDependencyError` — raised by both when matplotlib is missing.
"""

from ..errors import PlotDependencyError
from .pipeline_plot import draw_timeline, plot_timeline
from .plan_plot import draw_plan, plot_plan

__all__ = ["PlotDependencyError", "draw_plan", "draw_timeline", "plot_plan", "plot_timeline"]
