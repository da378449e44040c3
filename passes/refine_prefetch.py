"""Prefetch hoisting: start each reload early enough to hide its copy, within budget.

The planners place ``COPY_H2D s`` right before the op that reads ``s`` again, next to
its ``WAIT_H2D`` — nothing overlaps the copy. This pass moves each COPY_H2D earlier,
never before the op after the storage's release, far enough that the ops in between
take at least the copy's estimated time (``size / h2d_bandwidth``), and only as far as
the budget allows: from its new slot on the storage is resident, so every op it passes
must keep room for it. WAIT_H2D stays where it was. Example::

    before:  post[3]: RELEASE_DEVICE 7     pre[9]: COPY_H2D 7, WAIT_H2D 7
    after:   post[3]: RELEASE_DEVICE 7     pre[6]: COPY_H2D 7      pre[9]: WAIT_H2D 7

Analysis (:func:`prefetch_slots`, which op each reload starts at) and rewriting
(:func:`hoist_prefetches`) are separate. Reloads are placed in the order they are
waited for, so an earlier need gets the room first. Cost: O(total lead) list work plus
one ``check_schedule`` run; the lead of one reload is capped by ``max_lead_ops``.
"""

from __future__ import annotations

from .liveness import required_bytes
from .schedule import ActionKind, ResidencyAction, ResidencySchedule
from .trace import ActivationTrace, StorageId
from .validator import check_schedule

DEFAULT_MAX_LEAD_OPS = 64


class PrefetchError(ValueError):
    """The input schedule is not one this pass can rewrite (it names the rule)."""


def prefetch_slots(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    *,
    default_op_duration_s: float | None = None,
    max_lead_ops: int = DEFAULT_MAX_LEAD_OPS,
    earliest_op: int = 0,
) -> dict[tuple[StorageId, int], int]:
    """``{(storage, wait_op): start_op}`` for every reload of ``schedule``.

    Ops without ``duration_s`` count ``default_op_duration_s``; when that is ``None``
    too, the lead is one op (the copy overlaps the op before its wait). No reload
    starts before ``earliest_op`` (the compile path cannot start a backward reload in
    the forward graph), nor before its wait if that is earlier. ``schedule`` must pass
    ``check_schedule`` without violations.
    """
    report = check_schedule(trace, schedule)
    if report.violations:
        raise PrefetchError(
            f"prefetch_slots: the input schedule breaks {len(report.violations)} rule(s), "
            f"first: {report.violations[0]}; hoist only schedules check_schedule accepts"
        )
    allowance = [max(trace.budget_bytes, need) for need in required_bytes(trace)]
    room = [a - r for a, r in zip(allowance, report.resident_bytes)]
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
    for wait_op, storage, release_op in sorted(reloads):
        start = _earliest_start(
            trace, room, storage, wait_op, max(release_op, earliest_op - 1),
            default_op_duration_s, max_lead_ops,
        )
        for op in range(start, wait_op):
            room[op] -= trace.storage_sizes[storage]
        slots[(storage, wait_op)] = start
    return slots


def _earliest_start(
    trace: ActivationTrace,
    room: list[int],
    storage: StorageId,
    wait_op: int,
    release_op: int,
    default_op_duration_s: float | None,
    max_lead_ops: int,
) -> int:
    """Walk back from the wait while the copy is not hidden yet and the op has room."""
    size = trace.storage_sizes[storage]
    copy_s = size / (trace.h2d_bandwidth_gbps * 1e9)
    hidden_s = 0.0
    start = wait_op
    floor = max(release_op + 1, wait_op - max_lead_ops)
    while start > floor and room[start - 1] >= size:
        start -= 1
        duration = trace.ops[start].duration_s
        if duration is None:
            duration = default_op_duration_s
        if duration is None:
            break  # no timing known: one op of lead
        hidden_s += duration
        if hidden_s >= copy_s:
            break
    return start


def hoist_prefetches(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    *,
    default_op_duration_s: float | None = None,
    max_lead_ops: int = DEFAULT_MAX_LEAD_OPS,
    earliest_op: int = 0,
) -> ResidencySchedule:
    """``schedule`` with every COPY_H2D moved to its :func:`prefetch_slots` start.

    The result passes ``check_schedule`` whenever the input does, moves the same bytes,
    and never raises the resident bytes of an op above its allowance.
    """
    slots = prefetch_slots(
        trace, schedule, default_op_duration_s=default_op_duration_s,
        max_lead_ops=max_lead_ops, earliest_op=earliest_op,
    )
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
