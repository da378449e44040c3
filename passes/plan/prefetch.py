"""Prefetch placement: each reload as late as the timeline allows without stalling, and
no earlier than the budget allows; in wait order.

The planners place ``COPY_H2D s`` right before the op that reads ``s`` again, next to
its ``WAIT_H2D`` — nothing overlaps the copy. This pass moves each COPY_H2D earlier, in
two steps (``WAIT_H2D`` stays where it was)::

    before:  post[3]: RELEASE_DEVICE 7     pre[9]: COPY_H2D 7, WAIT_H2D 7
    after:   post[3]: RELEASE_DEVICE 7     pre[6]: COPY_H2D 7      pre[9]: WAIT_H2D 7

1. **Earliest** (:func:`earliest_slots`): as far back as the budget allows, never before
   the op after the storage's release nor before ``earliest_op``. From its new slot on
   the storage is resident, so every op it passes must keep room for it, and so must
   the op before its slot: what the plan frees after that op (a storage past its last
   reader) may still be alive when the copy allocates, in eager code until Python drops
   it, in compiled code until the graph frees its buffer. Reloads are placed in the order
   they are waited for and never start before the reload placed before it: the one copy
   stream (the runtime's, and :mod:`..analysis.predicted_timeline`'s model of it) then serves them
   in deadline order, and the earliest need gets the room first.
2. **Latest without stall**: on the timeline model of that placement, each reload is
   issued as late as its copy can start and still end before its wait and before the
   next copy on the stream starts. Compute runs exactly as with the earliest placement;
   the device simply holds the bytes for less time, which leaves room for what the trace
   does not see (an op's own workspace, e.g. the flash-attention backward's).

Why not "just early enough to hide the copy", as this pass once did: on an
idle stream that is right, but a reload queued behind others is not hidden by its own
lead; on the GPU-priced LLM traces of ``benchmarks/stall.py`` that left most of the
backward's stall. Why not the earliest placement alone: it fills the budget to the byte
wherever a reload could be early, and the demo GPT's measured compile peak then went 40
KB over its budget inside an SDPA backward.

Analysis (:func:`prefetch_slots`, which op each reload starts at) and rewriting
(:func:`hoist_prefetches`) are separate. Cost: O(total lead) list work, one
``check_schedule`` and one ``predict_timeline`` run.
"""

from __future__ import annotations

from hyper_offload.errors import PrefetchError

from ..analysis.liveness import required_bytes
from ..analysis.predicted_timeline import predict_timeline
from ..analysis.validator import check_schedule
from ..ir.limits import OpLimit, op_limit
from ..ir.schedule import ActionKind, ResidencyAction, ResidencySchedule
from ..ir.trace import ActivationTrace, StorageId

__all__ = [
    "PrefetchError",
    "earliest_slots",
    "hoist_prefetches",
    "prefetch_leads",
    "prefetch_slots",
    "with_reload_starts",
]


def prefetch_slots(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    *,
    earliest_op: OpLimit = 0,
    default_op_duration_s: float | None = None,
    release_waits_for_d2h: bool = False,
    fixed: frozenset[StorageId] = frozenset(),
) -> dict[tuple[StorageId, int], int]:
    """``{(storage, wait_op): start_op}`` for every reload of ``schedule`` but those of
    ``fixed`` storages (a lowering already compiled: they stay where they are), in wait
    order.

    Two steps (module docstring): :func:`earliest_slots`, then each reload is issued as
    late as the timeline model says it can be without ending later than its wait or
    delaying the copy queued after it (:func:`_latest_without_stall`). Starts never
    decrease in wait order. ``default_op_duration_s`` / ``release_waits_for_d2h``: the
    door's timeline, as :func:`..analysis.predicted_timeline.predict_timeline` takes them.
    """
    earliest = earliest_slots(trace, schedule, earliest_op=earliest_op, fixed=fixed)
    return _latest_without_stall(
        trace, schedule, earliest, default_op_duration_s, release_waits_for_d2h
    )


def earliest_slots(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    *,
    earliest_op: OpLimit = 0,
    fixed: frozenset[StorageId] = frozenset(),
) -> dict[tuple[StorageId, int], int]:
    """The earliest op each reload (but those of ``fixed`` storages) may start at, in wait
    order: as far back as the budget
    allows, never before ``earliest_op`` (the compile path cannot start a backward reload
    in the forward graph; per storage for a step of several regions,
    :mod:`~hyper_offload.passes.ir.limits`), nor before its wait if that is earlier, nor
    before the start of the reload waited for before it. ``schedule`` must pass
    ``check_schedule``.
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
    slots = {}
    previous_start = 0
    for wait_op, storage, release_op in _reloads(schedule):
        if storage in fixed:  # resident from where it is: the curve counts it already
            continue
        size = trace.storage_sizes[storage]
        floor = min(wait_op, max(release_op + 1, op_limit(earliest_op, storage, 0), previous_start))
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


def _reloads(schedule: ResidencySchedule) -> list[tuple[int, StorageId, int]]:
    """``(wait op, storage, release op)`` of every reload, sorted."""
    released_after: dict[StorageId, int] = {}
    reloads: list[tuple[int, StorageId, int]] = []
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
    return sorted(reloads)


def _latest_without_stall(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    earliest: dict[tuple[StorageId, int], int],
    default_op_duration_s: float | None,
    release_waits_for_d2h: bool,
) -> dict[tuple[StorageId, int], int]:
    """Each reload issued as late as it can be on the timeline of ``earliest``'s schedule.

    Walking the copy stream backwards from its last copy: a reload whose copy ends
    ``slack`` before both its wait and the start of the next copy on the stream moves to
    the latest op that starts no later than its copy start plus that slack (and no later
    than the reload after it, so the stream keeps serving them in wait order). Its copy
    still ends in time and the next copy still starts when it did, so no wait stalls
    more: compute runs exactly as on the earliest placement, with fewer bytes resident.
    """
    placed = with_reload_starts(schedule, earliest)
    timeline = predict_timeline(
        trace, placed, default_op_duration_s=default_op_duration_s,
        release_waits_for_d2h=release_waits_for_d2h,
    )
    op_start = [span.start_s for span in timeline.ops]
    stalled = {(w.storage, w.op_index) for w in timeline.waits if w.kind is ActionKind.COPY_H2D}
    wait_of = {(storage, copy): wait for storage, copy, wait in prefetch_leads(placed)}
    slots = dict(earliest)
    next_start = float("inf")  # start of the next copy on the stream
    latest_issue = trace.num_ops  # the reload after this one is issued at or before it
    for span in reversed(timeline.transfers):
        key = (span.storage, wait_of.get((span.storage, span.op_index), -1))
        if span.kind is not ActionKind.COPY_H2D or key not in earliest:
            next_start = min(next_start, span.start_s)  # a D2H, or a fixed reload
            continue
        wait_op = key[1]
        start = span.start_s
        if key not in stalled:
            deadline = min(op_start[wait_op], next_start)
            latest = start + max(0.0, deadline - span.end_s)
            issue = min(wait_op, latest_issue)
            while issue > earliest[key] and op_start[issue] > latest:
                issue -= 1
            if issue > earliest[key]:
                slots[key] = issue
                start = max(start, op_start[issue])
        latest_issue = slots[key]
        next_start = min(next_start, start)
    return {key: slots[key] for key in earliest}


def prefetch_leads(schedule: ResidencySchedule) -> list[tuple[StorageId, int, int]]:
    """``(storage, copy op, wait op)`` of every ``COPY_H2D`` / ``WAIT_H2D`` pair, in wait
    order; ``wait op - copy op`` is the number of ops the copy overlaps."""
    started: dict[StorageId, int] = {}
    pairs = []
    for op, _where, action in schedule.actions():
        if action.kind is ActionKind.COPY_H2D:
            started[action.storage] = op
        elif action.kind is ActionKind.WAIT_H2D and action.storage in started:
            pairs.append((action.storage, started.pop(action.storage), op))
    return pairs


def with_reload_starts(
    schedule: ResidencySchedule, slots: dict[tuple[StorageId, int], int]
) -> ResidencySchedule:
    """``schedule`` with the COPY_H2D of each ``(storage, wait op)`` of ``slots`` moved
    to its start op (before that op's waits); every other action stays."""
    pre = [list(actions) for actions in schedule.pre]
    for (storage, wait_op), start in slots.items():
        if start == wait_op:
            continue
        copy = ResidencyAction(ActionKind.COPY_H2D, storage)
        pre[wait_op].remove(copy)
        # Copies started at the same op run before that op's waits (see choice_lowering).
        waits = [i for i, a in enumerate(pre[start]) if a.kind is ActionKind.WAIT_H2D]
        pre[start].insert(waits[0] if waits else len(pre[start]), copy)
    return ResidencySchedule(pre=pre, post=schedule.post)


def hoist_prefetches(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    *,
    earliest_op: OpLimit = 0,
    default_op_duration_s: float | None = None,
    release_waits_for_d2h: bool = False,
    fixed: frozenset[StorageId] = frozenset(),
) -> ResidencySchedule:
    """``schedule`` with every COPY_H2D but those of ``fixed`` storages moved to its
    :func:`prefetch_slots` start.

    The result passes ``check_schedule`` whenever the input does, moves the same bytes,
    and never raises the resident bytes of an op above its allowance.
    """
    if fixed and all(a.storage in fixed for _, _, a in schedule.actions()
                     if a.kind is ActionKind.COPY_H2D):
        return schedule  # nothing to place
    slots = prefetch_slots(
        trace, schedule, earliest_op=earliest_op, default_op_duration_s=default_op_duration_s,
        release_waits_for_d2h=release_waits_for_d2h, fixed=fixed,
    )
    return with_reload_starts(schedule, slots)
