"""Chrome / Perfetto trace of a plan: compute ops and copy-stream transfers on their own
tracks, at the times :func:`~.predicted_timeline.predict_timeline` predicts.

Open the JSON in https://ui.perfetto.dev or ``chrome://tracing``. Layout (one process,
``pid`` 1)::

    tid 1  compute            one "X" slice per op (args: index, duration source,
                              resident bytes), "wait H2D sN" slices where compute stalls
    tid 2  copy stream: D2H   one "X" slice per COPY_D2H (args: storage, bytes, issue op)
    tid 3  copy stream: H2D   one "X" slice per COPY_H2D
    tid 4  releases           "i" instants for RELEASE_DEVICE / RELEASE_HOST
           resident bytes     a "C" counter: device bytes during each op (check_schedule)

D2H and H2D share *one* copy stream in the model (they never overlap each other); they
are drawn on two tracks only for reading. Times are microseconds (``ts``, ``dur``), as
the Trace Event Format wants; ``otherData`` carries the predicted totals.

:func:`chrome_trace` is pure (data in, a JSON-ready dict out); :func:`write_chrome_trace`
is the one call a front door (CLI, compile report, eager session) needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..ir.schedule import ActionKind, ResidencySchedule
from ..ir.trace import ActivationTrace
from .predicted_timeline import PredictedTimeline, predict_timeline
from .validator import check_schedule

__all__ = ["TRACK_COMPUTE", "TRACK_D2H", "TRACK_H2D", "TRACK_RELEASES", "chrome_trace",
           "write_chrome_trace"]

PID = 1
TRACK_COMPUTE, TRACK_D2H, TRACK_H2D, TRACK_RELEASES = 1, 2, 3, 4
_TRACK_NAMES = {
    TRACK_COMPUTE: "compute",
    TRACK_D2H: "copy stream: D2H",
    TRACK_H2D: "copy stream: H2D",
    TRACK_RELEASES: "releases",
}
_US = 1e6


def chrome_trace(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    *,
    title: str = "hyper-offload plan",
    default_op_duration_s: float | None = None,
) -> dict[str, Any]:
    """The plan as a Trace Event Format object (``{"traceEvents": [...], ...}``).

    ``default_op_duration_s``: see :func:`predict_timeline`. The schedule need not be
    valid (a broken plan is worth looking at), but it must fit the trace.
    """
    timeline = predict_timeline(trace, schedule, default_op_duration_s=default_op_duration_s)
    resident = check_schedule(trace, schedule).resident_bytes
    events: list[dict[str, Any]] = _metadata(title)
    events += _compute_events(timeline, resident)
    events += _transfer_events(timeline)
    events += _release_events(timeline)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "title": title,
            "budget_bytes": trace.budget_bytes,
            "d2h_bandwidth_gbps": trace.d2h_bandwidth_gbps,
            "h2d_bandwidth_gbps": trace.h2d_bandwidth_gbps,
            "default_op_duration_s": timeline.default_op_duration_s,
            **timeline.summary(),
        },
    }


def write_chrome_trace(
    path: str | Path,
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    *,
    title: str = "hyper-offload plan",
    default_op_duration_s: float | None = None,
) -> Path:
    """Write :func:`chrome_trace` of the plan to ``path`` as JSON; returns the path.

    The hook for every front door: ``write_chrome_trace("step.json", trace, schedule)``.
    """
    target = Path(path)
    document = chrome_trace(
        trace, schedule, title=title, default_op_duration_s=default_op_duration_s
    )
    target.write_text(json.dumps(document, allow_nan=False))
    return target


def _metadata(title: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": title}}
    ]
    for tid, name in _TRACK_NAMES.items():
        events.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid,
                       "args": {"name": name}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": PID, "tid": tid,
                       "args": {"sort_index": tid}})
    return events


def _slice(name: str, cat: str, tid: int, start_s: float, end_s: float,
           args: dict[str, Any]) -> dict[str, Any]:
    ts, end = _us(start_s), _us(end_s)
    return {"name": name, "cat": cat, "ph": "X", "pid": PID, "tid": tid,
            "ts": ts, "dur": round(end - ts, 3), "args": args}


def _us(seconds: float) -> float:
    """Microseconds, rounded to the nanosecond (keeps float noise out of the JSON)."""
    return round(seconds * _US, 3)


def _compute_events(timeline: PredictedTimeline, resident: tuple[int, ...]) -> list[dict[str, Any]]:
    events = []
    for op in timeline.ops:
        args = {"op_index": op.index, "duration": "default" if op.estimated else "trace",
                "resident_bytes": resident[op.index]}
        events.append(_slice(op.name, "compute", TRACK_COMPUTE, op.start_s, op.end_s, args))
        events.append({"name": "resident bytes", "ph": "C", "pid": PID, "ts": _us(op.start_s),
                       "args": {"bytes": resident[op.index]}})
    for wait in timeline.waits:
        args = {"storage": wait.storage, "before_op": wait.op_index, "slot": wait.slot}
        direction = "D2H" if wait.kind is ActionKind.COPY_D2H else "H2D"
        events.append(_slice(f"wait {direction} s{wait.storage}", "wait", TRACK_COMPUTE,
                             wait.start_s, wait.end_s, args))
    return events


def _transfer_events(timeline: PredictedTimeline) -> list[dict[str, Any]]:
    events = []
    for copy in timeline.transfers:
        d2h = copy.kind is ActionKind.COPY_D2H
        args = {"storage": copy.storage, "bytes": copy.nbytes, "issued_at_op": copy.op_index,
                "slot": copy.slot, "issue_us": _us(copy.issue_s),
                "queued_us": _us(copy.start_s - copy.issue_s)}
        events.append(_slice(f"{'D2H' if d2h else 'H2D'} s{copy.storage}", "transfer",
                             TRACK_D2H if d2h else TRACK_H2D, copy.start_s, copy.end_s, args))
    return events


def _release_events(timeline: PredictedTimeline) -> list[dict[str, Any]]:
    return [
        {"name": f"{mark.kind.value} s{mark.storage}", "cat": "release", "ph": "i", "s": "t",
         "pid": PID, "tid": TRACK_RELEASES, "ts": _us(mark.time_s),
         "args": {"op_index": mark.op_index, "slot": mark.slot}}
        for mark in timeline.releases
    ]
