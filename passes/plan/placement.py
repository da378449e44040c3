"""Placement of a plan's actions in time: releases wait for their copy, reloads start early.

Release delay: free an offloaded storage when its D2H is done, not before, within budget.

A planner releases an offloaded storage right after its last reader (``post[r]:
RELEASE_DEVICE s``). Where a release must wait for the storage's D2H (the compile
lowering's ``wait_transfer`` sits there), a release issued while that copy is still
running stalls compute until it ends; on the predicted timeline of GPU-priced LLM traces
this is most of the forward's stall. This pass walks the step on the one
timeline model (:class:`~..analysis.predicted_timeline.TimelineSimulator`) and holds back each
release whose copy is still running, freeing it at the first slot where

* its copy is done (no stall), or
* the budget needs its bytes gone before the next op: the held releases' bytes must fit
  in that op's room (``max(budget, required_bytes)`` minus the resident bytes, as
  ``check_schedule`` computes them). Then the releases whose copies end *first* are
  issued (stalling until the last of them is done), just enough to fit: the ones that
  end last keep waiting, where more compute can hide them; or
* the storage's next use or ``latest_op`` comes: never at or past its next
  ``COPY_H2D``, never past ``latest_op`` (the compile path: the forward graph's last
  op, which is where its device bytes must be gone by).

Example (the copy of storage 7 needs ops 4..6 to finish)::

    before:  post[3]: COPY_D2H 7, RELEASE_DEVICE 7
    after:   post[3]: COPY_D2H 7                  post[6]: RELEASE_DEVICE 7

Bytes moved are unchanged; only the resident curve rises, never above an op's
allowance. Analysis (:func:`release_slots`) and rewriting (:func:`delay_releases`) are
separate. Cost: one walk of the schedule, O(A log A) for A actions.

Prefetch placement: each reload as late as the timeline allows without stalling, and
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

import heapq

from hyper_offload.errors import PrefetchError, ReleaseDelayError

from ..analysis.liveness import required_bytes
from ..analysis.predicted_timeline import TimelineSimulator, predict_timeline
from ..analysis.validator import check_schedule
from ..ir.schedule import ActionKind, OpLimit, ResidencyAction, ResidencySchedule, op_limit
from ..ir.trace import ActivationTrace, StorageId

__all__ = [
    "PrefetchError",
    "ReleaseDelayError",
    "delay_releases",
    "earliest_slots",
    "hoist_prefetches",
    "prefetch_leads",
    "prefetch_slots",
    "release_slots",
    "with_reload_starts",
]


def release_slots(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    *,
    latest_op: OpLimit | None = None,
    default_op_duration_s: float | None = None,
    fixed: frozenset[StorageId] = frozenset(),
) -> dict[tuple[StorageId, int], int]:
    """``{(storage, release op): new release op}`` for every release this pass holds back,
    in the order they are issued (a release held back and freed in its own slot maps to
    its own op: it moved behind that slot's other actions). ``schedule`` must pass
    ``check_schedule``; ``default_op_duration_s``: see
    :func:`..analysis.predicted_timeline.op_durations`. ``latest_op``: one op for every
    storage or one per storage (:mod:`..ir.schedule`). ``fixed``: storages whose releases stay
    where they are (a lowering already compiled).
    """
    report = check_schedule(trace, schedule)
    if report.violations:
        raise ReleaseDelayError(
            f"release_slots: the input schedule breaks {len(report.violations)} rule(s), "
            f"first: {report.violations[0]}; delay only schedules check_schedule accepts"
        )
    room = [
        max(trace.budget_bytes, need) - resident
        for need, resident in zip(required_bytes(trace), report.resident_bytes)
    ]
    limits = _release_limits(schedule, latest_op, trace.num_ops - 1, fixed)
    simulator = TimelineSimulator(
        trace, default_op_duration_s=default_op_duration_s, release_waits_for_d2h=True
    )
    held = _HeldReleases(trace, simulator)
    for index in range(trace.num_ops):
        simulator.run_slot(schedule.pre[index], index, "pre")
        simulator.run_op(index)
        for action in schedule.post[index]:
            copy_end = simulator.pending_copy_end(action.storage)
            if (
                action.kind is ActionKind.RELEASE_DEVICE and copy_end is not None
                and copy_end > simulator.clock and limits[(action.storage, index)] > index
            ):
                held.hold(action.storage, index, copy_end, limits[(action.storage, index)])
            else:
                simulator.run_slot((action,), index, "post")
        next_room = room[index + 1] if index + 1 < trace.num_ops else None
        held.settle(index, next_room)
    return held.slots


def _release_limits(
    schedule: ResidencySchedule, latest_op: OpLimit | None, final_op: int,
    fixed: frozenset[StorageId] = frozenset(),
) -> dict[tuple[StorageId, int], int]:
    """``{(storage, release op): latest op it may move to}``: before the storage's next
    ``COPY_H2D`` (a reload needs the bytes freed first) and at most its ``latest_op``
    (``final_op``, the trace's last op, where none is given); its own op for ``fixed``."""
    limits: dict[tuple[StorageId, int], int] = {}
    open_release: dict[StorageId, int] = {}
    for op, _where, action in schedule.actions():
        storage = action.storage
        if storage in fixed:
            if action.kind is ActionKind.RELEASE_DEVICE:
                limits[(storage, op)] = op
            continue
        if action.kind is ActionKind.RELEASE_DEVICE:
            last = min(op_limit(latest_op, storage, final_op), final_op)
            limits[(storage, op)] = max(op, last)
            open_release[storage] = op
        elif action.kind is ActionKind.COPY_H2D and storage in open_release:
            released = open_release.pop(storage)
            last = min(op_limit(latest_op, storage, final_op), final_op)
            limits[(storage, released)] = max(released, min(last, op - 1))
    return limits


class _HeldReleases:
    """Releases held back while their copies run, ordered by when the copy ends."""

    def __init__(self, trace: ActivationTrace, simulator: TimelineSimulator) -> None:
        self.sizes = trace.storage_sizes
        self.simulator = simulator
        self.by_copy_end: list[tuple[float, StorageId]] = []  # heap; stale entries skipped
        self.held: dict[StorageId, tuple[int, int]] = {}  # storage -> (release op, limit)
        self.held_bytes = 0
        self.slots: dict[tuple[StorageId, int], int] = {}

    def hold(self, storage: StorageId, op: int, copy_end: float, limit: int) -> None:
        heapq.heappush(self.by_copy_end, (copy_end, storage))
        self.held[storage] = (op, limit)
        self.held_bytes += self.sizes[storage]

    def settle(self, index: int, next_room: int | None) -> None:
        """Issue, in ``post[index]``, the releases that are done, due, or needed for room."""
        for storage, (_op, limit) in list(self.held.items()):
            if limit <= index or next_room is None:
                self._release(storage, index)
        while self.by_copy_end:
            copy_end, storage = self.by_copy_end[0]
            if storage not in self.held:
                heapq.heappop(self.by_copy_end)
            elif copy_end <= self.simulator.clock or self.held_bytes > next_room:
                heapq.heappop(self.by_copy_end)
                self._release(storage, index)  # stalls until copy_end if it is later
            else:
                break

    def _release(self, storage: StorageId, index: int) -> None:
        op, _limit = self.held.pop(storage)
        self.held_bytes -= self.sizes[storage]
        self.simulator.run_slot((ResidencyAction(ActionKind.RELEASE_DEVICE, storage),), index, "post")
        self.slots[(storage, op)] = index


def delay_releases(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    *,
    latest_op: OpLimit | None = None,
    default_op_duration_s: float | None = None,
    fixed: frozenset[StorageId] = frozenset(),
) -> ResidencySchedule:
    """``schedule`` with every :func:`release_slots` release moved to its new op.

    The result passes ``check_schedule`` whenever the input does, moves the same bytes,
    and never raises the resident bytes of an op above its allowance. Moved releases go
    last in their new ``post`` slot (after that slot's other actions), in the order
    :func:`release_slots` issued them: the order the timeline model ran them in.
    ``fixed``: storages whose releases stay (with nothing else to hold, nothing runs).
    """
    if fixed and all(a.storage in fixed for _, _, a in schedule.actions()
                     if a.kind is ActionKind.RELEASE_DEVICE):
        return schedule  # nothing to place
    slots = release_slots(
        trace, schedule, latest_op=latest_op, default_op_duration_s=default_op_duration_s,
        fixed=fixed,
    )
    post = [list(actions) for actions in schedule.post]
    for (storage, op), _target in slots.items():
        post[op].remove(ResidencyAction(ActionKind.RELEASE_DEVICE, storage))
    for (storage, _op), target in slots.items():
        post[target].append(ResidencyAction(ActionKind.RELEASE_DEVICE, storage))
    return ResidencySchedule(pre=schedule.pre, post=post)


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
    :mod:`~hyper_offload.passes.ir.schedule`), nor before its wait if that is earlier, nor
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
        # Copies started at the same op run before that op's waits (see report.lower_offload_choice).
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
