"""Release delay: free an offloaded storage when its D2H is done, not before, within budget.

A planner releases an offloaded storage right after its last reader (``post[r]:
RELEASE_DEVICE s``). Where a release must wait for the storage's D2H (the compile
lowering's ``wait_transfer`` sits there), a release issued while that copy is still
running stalls compute until it ends; on the predicted timeline of GPU-priced LLM traces
this is most of the forward's stall (issue 16). This pass moves each such release later,
to the first op by whose end the copy is predicted to be done, but only as far as

* the budget allows: the storage stays resident over every op it passes, so each of them
  must keep room for its bytes (``max(budget, required_bytes)`` minus the resident bytes,
  as ``check_schedule`` computes them), and
* the storage's next use allows: never at or past its next ``COPY_H2D``, and never past
  ``latest_op`` (the compile path: the forward graph's last op, which is where its
  device bytes must be gone by).

Example (the copy of storage 7 needs ops 4..6 to finish)::

    before:  post[3]: COPY_D2H 7, RELEASE_DEVICE 7
    after:   post[3]: COPY_D2H 7                  post[6]: RELEASE_DEVICE 7

Bytes moved are unchanged; only the resident curve rises, never above an op's
allowance. Analysis (:func:`release_slots`) and rewriting (:func:`delay_releases`) are
separate; the copy end times come from the one timeline model
(:func:`~.predicted_timeline.predict_timeline`), computed once on the input schedule.
"""

from __future__ import annotations

from .liveness import required_bytes
from .predicted_timeline import predict_timeline
from .schedule import ActionKind, ResidencyAction, ResidencySchedule
from .trace import ActivationTrace, StorageId
from .validator import check_schedule

__all__ = ["ReleaseDelayError", "delay_releases", "release_slots"]


class ReleaseDelayError(ValueError):
    """The input schedule is not one this pass can rewrite (it names the rule)."""


def release_slots(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    *,
    latest_op: int | None = None,
    default_op_duration_s: float | None = None,
) -> dict[tuple[StorageId, int], int]:
    """``{(storage, release op): new release op}`` for every release this pass delays.

    A release is delayed when the storage had a ``COPY_D2H`` before it whose predicted
    end lies after the releasing op's end. ``schedule`` must pass ``check_schedule``.
    """
    report = check_schedule(trace, schedule)
    if report.violations:
        raise ReleaseDelayError(
            f"release_slots: the input schedule breaks {len(report.violations)} rule(s), "
            f"first: {report.violations[0]}; delay only schedules check_schedule accepts"
        )
    last = trace.num_ops - 1 if latest_op is None else min(latest_op, trace.num_ops - 1)
    room = [
        max(trace.budget_bytes, need) - resident
        for need, resident in zip(required_bytes(trace), report.resident_bytes)
    ]
    timeline = predict_timeline(trace, schedule, default_op_duration_s=default_op_duration_s)
    op_end = [span.end_s for span in timeline.ops]
    d2h_ends = iter(t.end_s for t in timeline.transfers if t.kind is ActionKind.COPY_D2H)
    copy_end: dict[StorageId, float] = {}  # storage -> end of its latest D2H
    released: dict[StorageId, int] = {}  # storage -> its release still awaiting a reload
    releases: list[tuple[int, StorageId, float]] = []
    next_reload: dict[tuple[StorageId, int], int] = {}
    for op, _where, action in schedule.actions():
        if action.kind is ActionKind.COPY_D2H:
            copy_end[action.storage] = next(d2h_ends)  # transfers are in issue order
        elif action.kind is ActionKind.RELEASE_DEVICE and action.storage in copy_end:
            releases.append((op, action.storage, copy_end.pop(action.storage)))
            released[action.storage] = op
        elif action.kind is ActionKind.COPY_H2D and action.storage in released:
            next_reload[(action.storage, released.pop(action.storage))] = op
    slots: dict[tuple[StorageId, int], int] = {}
    for op, storage, done in releases:
        if op_end[op] >= done:
            continue
        limit = min(last, next_reload.get((storage, op), trace.num_ops) - 1)
        size = trace.storage_sizes[storage]
        target = op
        while target < limit and op_end[target] < done and room[target + 1] >= size:
            target += 1
        if target > op:
            for passed in range(op + 1, target + 1):
                room[passed] -= size
            slots[(storage, op)] = target
    return slots


def delay_releases(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    *,
    latest_op: int | None = None,
    default_op_duration_s: float | None = None,
) -> ResidencySchedule:
    """``schedule`` with every :func:`release_slots` release moved to its new op.

    The result passes ``check_schedule`` whenever the input does, moves the same bytes,
    and never raises the resident bytes of an op above its allowance. A moved release
    goes last in its new ``post`` slot (after that slot's copies).
    """
    slots = release_slots(
        trace, schedule, latest_op=latest_op, default_op_duration_s=default_op_duration_s
    )
    post = [list(actions) for actions in schedule.post]
    for (storage, op), target in slots.items():
        release = ResidencyAction(ActionKind.RELEASE_DEVICE, storage)
        post[op].remove(release)
        post[target].append(release)
    return ResidencySchedule(pre=schedule.pre, post=post)
