"""Prefetch placement: start each reload as early as the budget allows, in wait order.

The planners place ``COPY_H2D s`` right before the op that reads ``s`` again, next to
its ``WAIT_H2D`` — nothing overlaps the copy. This pass moves each COPY_H2D earlier,
never before the op after the storage's release (nor before ``earliest_op``), and only
as far as the budget allows: from its new slot on the storage is resident, so every op
it passes must keep room for it, and so must the op before its slot: what the plan frees
after that op (a storage past its last reader) may still be alive when the copy
allocates, in eager code until Python drops it, in compiled code until the graph frees
its buffer. WAIT_H2D stays where it was. Example::

    before:  post[3]: RELEASE_DEVICE 7     pre[9]: COPY_H2D 7, WAIT_H2D 7
    after:   post[3]: RELEASE_DEVICE 7     pre[5]: COPY_H2D 7      pre[9]: WAIT_H2D 7

Why as early as possible, not "just early enough": reloads share one serial copy stream
(the runtime's, and :mod:`.predicted_timeline`'s model of it), so a lead that would hide
a copy on an idle stream does not hide it behind the copies queued before it; on the
GPU-priced LLM traces of ``benchmarks/stall.py`` leads sized for an idle stream left most
of the backward's stall (issue 16). A reload issued earlier never ends later, as long as
reloads are issued in the order they are waited for: so a reload never starts before the
reload placed before it, and the earliest need gets the room first. Op durations do not
move a reload; the budget alone bounds its lead, and the timeline model judges the result.

Analysis (:func:`prefetch_slots`, which op each reload starts at) and rewriting
(:func:`hoist_prefetches`) are separate. Cost: O(total lead) list work plus one
``check_schedule`` run.
"""

from __future__ import annotations

from .liveness import required_bytes
from .schedule import ActionKind, ResidencyAction, ResidencySchedule
from .trace import ActivationTrace, StorageId
from .validator import check_schedule

__all__ = ["PrefetchError", "hoist_prefetches", "prefetch_slots"]


class PrefetchError(ValueError):
    """The input schedule is not one this pass can rewrite (it names the rule)."""


def prefetch_slots(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    *,
    earliest_op: int = 0,
) -> dict[tuple[StorageId, int], int]:
    """``{(storage, wait_op): start_op}`` for every reload of ``schedule``, in wait order.

    No reload starts before ``earliest_op`` (the compile path cannot start a backward
    reload in the forward graph), nor before its wait if that is earlier, nor before the
    start of the reload waited for before it. ``schedule`` must pass ``check_schedule``
    without violations.
    """
    report = check_schedule(trace, schedule)
    if report.violations:
        raise PrefetchError(
            f"prefetch_slots: the input schedule breaks {len(report.violations)} rule(s), "
            f"first: {report.violations[0]}; hoist only schedules check_schedule accepts"
        )
    room = [
        max(trace.budget_bytes, need) - resident
        for need, resident in zip(required_bytes(trace), report.resident_bytes)
    ]
    released_after: dict[StorageId, int] = {}
    reloads: list[tuple[int, StorageId, int]] = []  # (wait op, storage, release op)
    for op, where, action in schedule.actions():
        if action.kind is ActionKind.RELEASE_DEVICE:
            released_after[action.storage] = op
        elif action.kind is ActionKind.COPY_H2D:
            if where != "pre" or action.storage not in released_after:
                raise PrefetchError(
                    f"prefetch_slots: op {op}, storage {action.storage}: COPY_H2D must sit in "
                    "a pre slot after the storage's RELEASE_DEVICE; pass a planner's schedule"
                )
            reloads.append((op, action.storage, released_after[action.storage]))
    slots = {}
    previous_start = 0
    for wait_op, storage, release_op in sorted(reloads):
        size = trace.storage_sizes[storage]
        floor = min(wait_op, max(release_op + 1, earliest_op, previous_start))
        start = wait_op
        while start > floor and room[start - 1] >= size:
            start -= 1
        if start < wait_op and start - 1 > release_op and room[start - 1] < size:
            start += 1  # the previous op's dead storages may still be alive at the copy
        for op in range(start, wait_op):
            room[op] -= size
        slots[(storage, wait_op)] = start
        previous_start = start
    return slots


def hoist_prefetches(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    *,
    earliest_op: int = 0,
) -> ResidencySchedule:
    """``schedule`` with every COPY_H2D moved to its :func:`prefetch_slots` start.

    The result passes ``check_schedule`` whenever the input does, moves the same bytes,
    and never raises the resident bytes of an op above its allowance.
    """
    slots = prefetch_slots(trace, schedule, earliest_op=earliest_op)
    pre = [list(actions) for actions in schedule.pre]
    for (storage, wait_op), start in slots.items():
        if start == wait_op:
            continue
        copy = ResidencyAction(ActionKind.COPY_H2D, storage)
        pre[wait_op].remove(copy)
        # Copies started at the same op run before that op's waits (see planner_lowering).
        waits = [i for i, a in enumerate(pre[start]) if a.kind is ActionKind.WAIT_H2D]
        pre[start].insert(waits[0] if waits else len(pre[start]), copy)
    return ResidencySchedule(pre=pre, post=schedule.post)
