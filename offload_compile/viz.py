"""Plots (matplotlib, the optional ``plot`` extra; imported only when a plot is drawn).

* :func:`plot_plan` — a residency plan: resident bytes per op against the budget;
* :func:`plot_timeline` — a pipeline timeline: steps per rank, swap copies;
* :class:`PlotDependencyError` — raised by both when matplotlib is missing.

matplotlib, imported on first use: the one place the optional dependency is resolved.

Draw a plan: device-resident bytes per op before and after it, the budget, the copies.

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

Draw a pipeline :class:`~hyper_offload.passes.pipeline.timeline.Timeline` as a picture.

The layout follows the design document's schedule figures (section 6.8): one band per
rank, top to bottom; in each band a row of compute slots (``F3`` forward, ``B3`` backward,
``I3`` / ``W3`` the input / weight halves under dx/dw split, ``B1+F3`` an overlapped
composite), grey hatching where the rank idles (pipeline bubbles), and under it one lane of
offload windows and one of load windows (sub-lanes where windows of one rank overlap).
``C·F3`` marks a forward whose activations are collected for swap; ``W·B3`` a consumer
preceded by its ``SWAP_WAIT_LOAD`` (``W·W3``: a BWD_WEIGHT preceded by its
``DW_WAIT_LOAD``). The dW state's windows get lanes of their own ("dW offload",
"dW load"). The x axis counts logical compute slots, not seconds.

matplotlib is an optional dependency (``pip install hyper-offload[plot]``); it is imported
only when a picture is drawn, and only its object-oriented API is used (no pyplot state).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TYPE_CHECKING

from hyper_offload.errors import PlotDependencyError
from hyper_offload.passes import (
    ActionKind, ActivationTrace, ResidencySchedule, check_schedule,
    resident_bytes_without_offload,
)
from hyper_offload.passes.pipeline.meta_step import StepKind
from hyper_offload.passes.pipeline.timeline import (
    COMPUTE_LETTER, ComputeSlot, SwapWindow, Timeline, WindowKind,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "GIDS",
    "PlotDependencyError",
    "draw_plan",
    "draw_timeline",
    "plot_plan",
    "plot_timeline",
    "require_matplotlib",
]


def require_matplotlib(what: str) -> ModuleType:
    """The ``matplotlib`` package (with ``figure`` and ``patches`` loaded) for drawing ``what``.

    Raises :class:`PlotDependencyError` naming the extra to install when it is missing.
    """
    try:
        import matplotlib
        import matplotlib.figure
        import matplotlib.patches
    except ImportError as error:
        raise PlotDependencyError(
            f"drawing {what} needs matplotlib, which is not installed; install it with "
            "`pip install hyper-offload[plot]` (or `pip install matplotlib`)"
        ) from error
    return matplotlib


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


#: Artist group ids, so that callers and tests can find what was drawn.
GID_COMPUTE, GID_BUBBLE = "compute", "bubble"
GID_WINDOW = {
    WindowKind.OFFLOAD: "offload", WindowKind.LOAD: "load",
    WindowKind.WEIGHT_OFFLOAD: "dw_offload", WindowKind.WEIGHT_LOAD: "dw_load",
}

_KIND_COLOUR = {
    StepKind.FWD: "#4c72b0",
    StepKind.BWD: "#55a868",
    StepKind.BWD_INPUT: "#64b5cd",
    StepKind.BWD_WEIGHT: "#ccb974",
    StepKind.OVERLAP_B_F: "#8172b2",
    StepKind.OVERLAP_F_B: "#8172b2",
}
_WINDOW_COLOUR = {
    WindowKind.OFFLOAD: "#dd8452", WindowKind.LOAD: "#c44e52",
    WindowKind.WEIGHT_OFFLOAD: "#8172b3", WindowKind.WEIGHT_LOAD: "#64b5cd",
}
_KIND_NAME = {
    StepKind.FWD: "forward (F)",
    StepKind.BWD: "backward (B)",
    StepKind.BWD_INPUT: "backward dx (I)",
    StepKind.BWD_WEIGHT: "backward dw (W)",
    StepKind.OVERLAP_B_F: "overlapped B+F",
    StepKind.OVERLAP_F_B: "overlapped F+B",
}
_COMPUTE_H, _LANE_H, _GAP = 0.9, 0.42, 0.35
_MIN_WINDOW_W = 0.15  # a launch and its wait at the same time still get a visible tick


def plot_timeline(timeline: Timeline, path: str | Path, *, title: str | None = None, dpi: int = 120) -> Path:
    """Draw ``timeline`` and write it to ``path`` (format from the suffix, e.g. ``.png``)."""
    figure = draw_timeline(timeline, title=title)
    target = Path(path)
    figure.savefig(target, dpi=dpi, bbox_inches="tight")
    return target


def draw_timeline(timeline: Timeline, *, title: str | None = None) -> Figure:
    """Build the figure; one ``Rectangle`` per compute slot (gid ``compute``), per bubble
    (gid ``bubble``) and per copy window (gid ``offload`` / ``load``)."""
    mpl = require_matplotlib("a pipeline timeline")
    Figure, Patch, Rectangle = mpl.figure.Figure, mpl.patches.Patch, mpl.patches.Rectangle
    lanes = {rank: _pack_lanes(timeline, rank) for rank in timeline.ranks}
    layout = _band_layout(timeline.ranks, lanes)
    height = layout[-1][1]
    figure = Figure(figsize=(max(6.0, 1.6 + 0.36 * timeline.num_slots), 1.2 + 0.55 * height))
    ax = figure.add_subplot()
    virtual = _virtual_index(timeline)
    multi_stage = max(virtual.values(), default=0) > 0
    swapped_fwd = {(w.rank, w.stage, w.micro) for w in timeline.windows if w.kind is WindowKind.OFFLOAD}
    loaded = {(w.rank, w.stage, w.micro) for w in timeline.windows if w.kind is WindowKind.LOAD}
    weight_loaded = {(w.rank, w.stage, w.micro) for w in timeline.windows if w.kind is WindowKind.WEIGHT_LOAD}
    ticks: list[tuple[float, str]] = []
    for rank, top in layout[:-1]:
        for slot in timeline.slots_of(rank):
            _draw_slot(ax, Rectangle, slot, top, virtual, swapped_fwd, loaded, weight_loaded)
        for bubble in timeline.bubbles_of(rank):
            ax.add_patch(Rectangle((bubble.start, top), bubble.end - bubble.start, _COMPUTE_H,
                                   facecolor="#eeeeee", edgecolor="#999999", hatch="///",
                                   linewidth=0.5, gid=GID_BUBBLE))
        ticks.append((top + _COMPUTE_H / 2, f"rank {rank}"))
        lane_top = top + _COMPUTE_H + 0.08
        for kind in WindowKind:
            rows = lanes[rank][kind]
            for row, windows in enumerate(rows):
                y = lane_top + row * _LANE_H
                for window in windows:
                    _draw_window(ax, Rectangle, window, y, multi_stage)
            if rows:
                ticks.append((lane_top + len(rows) * _LANE_H / 2, kind.value))
            lane_top += len(rows) * _LANE_H
    _finish_axes(ax, timeline, ticks, height, title)
    _legend(ax, Patch, timeline)
    return figure


def _virtual_index(timeline: Timeline) -> dict[tuple[int, int], int]:
    """``(rank, stage) -> i``: the rank's i-th virtual stage (stages sorted on each rank)."""
    stages: dict[int, set[int]] = {}
    for slot in timeline.slots:
        for leaf in slot.leaves:
            stages.setdefault(slot.rank, set()).add(leaf.stage)  # type: ignore[arg-type]
    return {(rank, stage): i for rank, held in stages.items() for i, stage in enumerate(sorted(held))}


def _pack_lanes(timeline: Timeline, rank: int) -> dict[WindowKind, list[list[SwapWindow]]]:
    """Interval-graph colouring: each window goes into the first sub-lane where it does not
    overlap a window already there (windows are placed in order of start)."""
    packed: dict[WindowKind, list[list[SwapWindow]]] = {}
    for kind in WindowKind:
        rows: list[list[SwapWindow]] = []
        for window in sorted(timeline.windows_of(rank, kind), key=lambda w: (w.start, w.end)):
            for row in rows:
                last = row[-1]
                if max(last.end, last.start + _MIN_WINDOW_W) <= window.start:
                    row.append(window)
                    break
            else:
                rows.append([window])
        packed[kind] = rows
    return packed


def _band_layout(
    ranks: Sequence[int], lanes: dict[int, dict[WindowKind, list[list[SwapWindow]]]]
) -> list[tuple[int, float]]:
    """``(rank, top y)`` of each band, plus a final ``(-1, total height)`` sentinel."""
    layout, y = [], 0.0
    for rank in ranks:
        layout.append((rank, y))
        rows = sum(len(r) for r in lanes[rank].values())
        y += _COMPUTE_H + (0.08 + rows * _LANE_H if rows else 0.0) + _GAP
    layout.append((-1, y))
    return layout


def _draw_slot(
    ax: Axes, Rectangle: Any, slot: ComputeSlot, top: float, virtual: dict[tuple[int, int], int],
    swapped_fwd: set[tuple[int, int, int]], loaded: set[tuple[int, int, int]],
    weight_loaded: set[tuple[int, int, int]] = frozenset(),  # type: ignore[assignment]
) -> None:
    multi_stage = max(virtual.values(), default=0) > 0
    colour = _shade(_KIND_COLOUR[slot.step.kind], virtual[(slot.rank, slot.leaves[0].stage)])  # type: ignore[index]
    ax.add_patch(Rectangle((slot.start, top), 1, _COMPUTE_H, facecolor=colour,
                           edgecolor="white", linewidth=1.0, gid=GID_COMPUTE))
    parts = []
    for leaf in slot.leaves:
        key = (slot.rank, leaf.stage, leaf.micro)
        letter = COMPUTE_LETTER[leaf.kind]
        mark = "C·" if leaf.kind is StepKind.FWD and key in swapped_fwd else ""
        mark = "W·" if leaf.kind in (StepKind.BWD, StepKind.BWD_INPUT) and key in loaded else mark
        mark = "W·" if leaf.kind is StepKind.BWD_WEIGHT and key in weight_loaded else mark
        parts.append(f"{mark}{letter}{leaf.micro}")
    text = "\n".join(parts)
    if multi_stage:
        text += "\n" + "/".join(f"s{leaf.stage}" for leaf in slot.leaves)
    size = 6.5 if len(parts) == 1 and not multi_stage else 5.0
    ax.text(slot.start + 0.5, top + _COMPUTE_H / 2, text, ha="center", va="center",
            fontsize=size, color="white", fontweight="bold")


def _shade(colour: str, virtual_index: int) -> str:
    """Alternate full / lighter colour across a rank's virtual stages, so that they read apart."""
    level = 0.0 if virtual_index % 2 == 0 else 0.35
    red, green, blue = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    mix = [round(c + (255 - c) * level) for c in (red, green, blue)]
    return "#" + "".join(f"{c:02x}" for c in mix)


def _draw_window(ax: Axes, Rectangle: Any, window: SwapWindow, y: float, multi_stage: bool) -> None:
    width = max(window.end - window.start, _MIN_WINDOW_W)
    ax.add_patch(Rectangle((window.start, y + 0.04), width, _LANE_H - 0.08,
                           facecolor=_WINDOW_COLOUR[window.kind], edgecolor="white",
                           linewidth=0.5, alpha=0.9, gid=GID_WINDOW[window.kind]))
    if width >= 0.6:
        label = f"s{window.stage}m{window.micro}" if multi_stage else f"m{window.micro}"
        ax.text(window.start + width / 2, y + _LANE_H / 2, label, ha="center", va="center",
                fontsize=5.5, color="white")


def _finish_axes(ax: Axes, timeline: Timeline, ticks: Iterable[tuple[float, str]], height: float,
                 title: str | None) -> None:
    ticks = list(ticks)
    ax.set_xlim(0, max(timeline.num_slots, 1))
    ax.set_ylim(height, -0.1)
    ax.set_yticks([y for y, _ in ticks], [label for _, label in ticks], fontsize=7)
    ax.set_xlabel("logical compute slot (not wall-clock)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xticks(range(0, timeline.num_slots + 1, max(1, timeline.num_slots // 20)))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if title:
        ax.set_title(title, fontsize=9)


def _legend(ax: Axes, Patch: Any, timeline: Timeline) -> None:
    kinds = {slot.step.kind for slot in timeline.slots}
    handles = [Patch(facecolor=_KIND_COLOUR[k], label=_KIND_NAME[k]) for k in _KIND_COLOUR if k in kinds
               and not (k is StepKind.OVERLAP_F_B and StepKind.OVERLAP_B_F in kinds)]
    if len({v for v in _virtual_index(timeline).values()}) > 1:
        handles.append(Patch(facecolor=_shade(_KIND_COLOUR[StepKind.FWD], 1), label="odd virtual stage (lighter)"))
    if timeline.bubbles:
        handles.append(Patch(facecolor="#eeeeee", edgecolor="#999999", hatch="///", label="bubble"))
    for kind in WindowKind:
        if any(w.kind is kind for w in timeline.windows):
            handles.append(Patch(facecolor=_WINDOW_COLOUR[kind], label=f"{kind.value} window (launch→wait)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
