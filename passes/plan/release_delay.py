"""Release delay: free an offloaded storage when its D2H is done, not before, within budget.

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
"""

from __future__ import annotations

import heapq

from hyper_offload.errors import ReleaseDelayError

from ..analysis.liveness import required_bytes
from ..analysis.predicted_timeline import TimelineSimulator
from ..analysis.validator import check_schedule
from ..ir.limits import OpLimit, op_limit
from ..ir.schedule import ActionKind, ResidencyAction, ResidencySchedule
from ..ir.trace import ActivationTrace, StorageId

__all__ = ["ReleaseDelayError", "delay_releases", "release_slots"]


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
    storage or one per storage (:mod:`..ir.limits`). ``fixed``: storages whose releases stay
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
