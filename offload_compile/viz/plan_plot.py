"""Draw a plan: device-resident bytes per op before and after it, the budget, the copies.

One axes, x = op index (execution order), y = resident bytes (MiB, KiB or B, whichever
reads best):

* a grey step line: resident bytes with no offload (``resident_bytes_without_offload``),
* a blue step line: resident bytes under the schedule (``check_schedule``'s curve),
* a red dashed line: the budget,
* downward orange triangles at ops whose slots issue a ``COPY_D2H`` and upward green
  triangles where a ``COPY_H2D`` is issued, on the planned curve (several copies in one
  op's slots are one marker; its size grows with their count).

matplotlib is an optional dependency (``pip install hyper-offload[plot]``), imported only
when a picture is drawn; only its object-oriented API is used (no pyplot state).
Artists carry gids (``before``, ``after``, ``budget``, ``d2h``, ``h2d``) for tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hyper_offload.passes import (
    ActionKind,
    ActivationTrace,
    ResidencySchedule,
    check_schedule,
    resident_bytes_without_offload,
)

from ._matplotlib import PlotDependencyError, require_matplotlib

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["GIDS", "PlotDependencyError", "draw_plan", "plot_plan"]

GIDS = ("before", "after", "budget", "d2h", "h2d")
_MIB, _KIB = 1 << 20, 1 << 10


def plot_plan(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    path: str | Path,
    *,
    title: str | None = None,
    dpi: int = 120,
) -> Path:
    """Draw the plan and write it to ``path`` (format from the suffix, e.g. ``.png``)."""
    figure = draw_plan(trace, schedule, title=title)
    target = Path(path)
    figure.savefig(target, dpi=dpi, bbox_inches="tight")
    return target


def draw_plan(
    trace: ActivationTrace, schedule: ResidencySchedule, *, title: str | None = None
) -> Figure:
    """Build the figure described in the module docstring."""
    Figure = require_matplotlib("a plan").figure.Figure
    before = resident_bytes_without_offload(trace)
    after = check_schedule(trace, schedule).resident_bytes
    scale, unit = _unit(max([*before, *after, trace.budget_bytes, 1]))
    figure = Figure(figsize=(min(16.0, max(6.0, 0.12 * trace.num_ops + 4)), 4.2))
    ax = figure.add_subplot()
    xs = list(range(trace.num_ops))
    ax.step(xs, [b / scale for b in before], where="mid", color="#999999", linewidth=1.2,
            label="without offload", gid="before")
    ax.step(xs, [b / scale for b in after], where="mid", color="#4c72b0", linewidth=1.6,
            label="with the plan", gid="after")
    ax.axhline(trace.budget_bytes / scale, color="#c44e52", linestyle="--", linewidth=1.0,
               label="budget", gid="budget")
    for kind, marker, colour, gid, label in (
        (ActionKind.COPY_D2H, "v", "#dd8452", "d2h", "D2H issued"),
        (ActionKind.COPY_H2D, "^", "#55a868", "h2d", "H2D issued"),
    ):
        counts = _copies_per_op(schedule, kind)
        if counts:
            ops = sorted(counts)
            ax.scatter(ops, [after[i] / scale for i in ops], marker=marker, color=colour,
                       s=[30 + 12 * (counts[i] - 1) for i in ops], zorder=3, label=label,
                       gid=gid)
    ax.set_xlabel("op (execution order)")
    ax.set_ylabel(f"device-resident bytes ({unit})")
    ax.set_xlim(-0.5, max(trace.num_ops - 0.5, 0.5))
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", linewidth=0.4, alpha=0.5)
    ax.legend(loc="upper right", fontsize="small", framealpha=0.9)
    ax.set_title(title or f"resident bytes per op, budget {trace.budget_bytes / scale:g} {unit}")
    return figure


def _copies_per_op(schedule: ResidencySchedule, kind: ActionKind) -> dict[int, int]:
    counts: dict[int, int] = {}
    for index in range(schedule.num_ops):
        n = sum(a.kind is kind for a in (*schedule.pre[index], *schedule.post[index]))
        if n:
            counts[index] = n
    return counts


def _unit(peak: int) -> tuple[float, str]:
    if peak >= _MIB:
        return _MIB, "MiB"
    return (_KIB, "KiB") if peak >= _KIB else (1, "B")
