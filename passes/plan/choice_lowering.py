"""Lowering a choice of offloaded gaps to a schedule, and the floor: the choice of every gap.

Lower a choice of offloaded gaps to a :class:`ResidencySchedule`.

Every planner here separates *which* gaps to offload (analysis, in the planner) from
*how* that choice becomes actions (this module), so the greedy planner, its refinement
and the exact ILP planner all emit schedules the same way. For a chosen set of
:class:`~..analysis.liveness.OffloadCandidate`::

    post[d2h_op]        COPY_D2H s        once per write epoch with a chosen gap
    post[start]         RELEASE_DEVICE s  for each chosen gap
    pre[end]            COPY_H2D s, WAIT_H2D s
    post[last reload]   RELEASE_HOST s    the epoch's host copy has no further use
    post[last access]   RELEASE_DEVICE s  for every storage that is not retained
                                          (post[held_until] for a held one)

A hold gap (:func:`~..analysis.liveness.is_hold_gap`: a held storage's last stretch,
no op reads it again) has no reload: its RELEASE_DEVICE follows the last access, and its
epoch's host copy is released after op ``held_until``, when the last reference is gone.

Within a slot the order is fixed so that ``check_schedule`` accepts it and two planners
that choose the same gaps emit identical schedules: ``post`` runs every RELEASE_HOST,
then every COPY_D2H, then every RELEASE_DEVICE (a write that opens a new epoch at the
op where the previous epoch's last reload lands must free the stale buffer before it
copies again); ``pre`` starts every COPY_H2D before the first WAIT_H2D so the copies
overlap. Within one kind, actions are ordered by storage id.

Cost: one sort of ``(op, phase, storage)`` integer triples per slot list, then one tuple
per non-empty slot. Integer triples are untracked by the garbage collector once it has
seen them, so the lowering leaves little more than the schedule itself for a full
collection to scan. Measured on the 100,002-op saved-stack trace of
``benchmarks/planner.py``: sorting each slot with a key function, as this
module did before, took 0.88-1.07 s and two full collections, this 0.50-0.56 s and one.

The floor planner: offload every candidate gap.

A schedule that offloads every gap of :func:`~..analysis.liveness.offload_candidates`
keeps no storage on the device across a gap, so no schedule of the same gaps has fewer
device bytes at any op: it is the trace's *floor*. A door that must fit a budget before
it knows what else shares the device plans at the floor (the compile door's first step,
when a step has several regions or invocations, :mod:`hyper_offload.passes.plan.step`)
and later keeps on the device the gaps a wider view says it can afford. Placement
(:func:`~.planning.plan_residency`) then hoists the reloads as far as the trace's budget
allows, so a floor schedule is also as early as that budget permits.

``boundary`` and ``movable``: the first op of a region's backward graph, and the
storages that may leave the device. Between a region's forward and
its backward the rest of the step runs (other regions, other invocations, the eager code
around them), which the region's own trace cannot show. So a storage whose last forward
access is the forward's last op and whose first backward access is the backward's first
op has a gap that covers no op *of this trace* and is no candidate there, yet holds its
bytes across everything that runs in between. With ``boundary`` the floor offloads those
gaps of ``movable`` storages as well: released after the forward's last op, reloaded
before the backward's first. (Only the caller knows which storages may move: a kept one
is accessed at every op of its span, and so at both ends of the boundary too.)
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import groupby
from operator import itemgetter

from ..analysis.liveness import OffloadCandidate, is_hold_gap, offload_candidates
from ..ir.schedule import ActionKind, ResidencyAction, ResidencySchedule
from ..ir.trace import AccessKind, ActivationTrace, StorageId

__all__ = [
    "FloorPlanner",
    "boundary_gaps",
    "lower_offload_choice",
]


# Kinds in slot order; a slot entry's phase is its kind's index here.
_POST_PHASES = (ActionKind.RELEASE_HOST, ActionKind.COPY_D2H, ActionKind.RELEASE_DEVICE)
_PRE_PHASES = (ActionKind.COPY_H2D, ActionKind.WAIT_H2D)
_RELEASE_HOST, _COPY_D2H, _RELEASE_DEVICE = range(3)
_COPY_H2D, _WAIT_H2D = range(2)

_Entry = tuple[int, int, int]  # (op, phase, storage)


def lower_offload_choice(
    trace: ActivationTrace, chosen: Iterable[OffloadCandidate]
) -> ResidencySchedule:
    """The schedule that offloads exactly the ``chosen`` gaps (order is irrelevant)."""
    pre: list[_Entry] = []
    post: list[_Entry] = []
    last_reload: dict[tuple[int, int], int] = {}
    held_off = set()  # storages whose hold gap is chosen: off the device when it ends
    for cand in chosen:
        storage, start, end, _, d2h_op = cand
        epoch = (storage, d2h_op)
        post.append((start, _RELEASE_DEVICE, storage))
        if is_hold_gap(trace, cand):
            held_off.add(storage)
            end -= 1  # no reload; the host copy lives to the end of op held_until
        else:
            pre.append((end, _COPY_H2D, storage))
            pre.append((end, _WAIT_H2D, storage))
        if end > last_reload.get(epoch, -1):
            last_reload[epoch] = end
    for (storage, d2h_op), end in last_reload.items():
        post.append((d2h_op, _COPY_D2H, storage))
        post.append((end, _RELEASE_HOST, storage))
    retained = trace.retained
    post.extend(
        (trace.held_end(storage), _RELEASE_DEVICE, storage)
        for storage in trace.accessed_storages()
        if storage not in retained and storage not in held_off
    )
    return ResidencySchedule(
        pre=_slots(pre, _PRE_PHASES, trace.num_ops), post=_slots(post, _POST_PHASES, trace.num_ops)
    )


def _slots(
    entries: list[_Entry], phases: tuple[ActionKind, ...], num_ops: int
) -> list[tuple[ResidencyAction, ...]]:
    """One tuple of actions per op: ``entries`` sorted by op, then phase, then storage."""
    entries.sort()
    slots: list[tuple[ResidencyAction, ...]] = [()] * num_ops
    for op, group in groupby(entries, itemgetter(0)):
        slots[op] = tuple([ResidencyAction(phases[phase], storage) for _, phase, storage in group])
    return slots


class FloorPlanner:
    """A :class:`~.report.ResidencyPlanner` whose schedule offloads every candidate gap
    (and, with ``boundary``, every gap across it; module docstring).

    Invariant: for every op, the schedule's device bytes are the least any schedule of
    the trace's gaps reaches there (over the budget only where the trace's infeasible ops
    force it)."""

    def __init__(
        self, boundary: int | None = None, movable: frozenset[StorageId] = frozenset()
    ) -> None:
        self.boundary = boundary
        self.movable = frozenset(movable)

    def __repr__(self) -> str:
        return f"FloorPlanner(boundary={self.boundary}, movable={sorted(self.movable)})"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, FloorPlanner) and other.boundary == self.boundary
                and other.movable == self.movable)

    def __hash__(self) -> int:
        return hash((FloorPlanner, self.boundary, self.movable))

    def plan(self, trace: ActivationTrace) -> ResidencySchedule:
        chosen = offload_candidates(trace)
        if self.boundary is not None:
            chosen += boundary_gaps(trace, self.boundary, self.movable)
        return lower_offload_choice(trace, chosen)


def boundary_gaps(
    trace: ActivationTrace, boundary: int, movable: frozenset[StorageId]
) -> list[OffloadCandidate]:
    """Gaps from op ``boundary - 1`` to op ``boundary`` (they cover no op, so
    :func:`offload_candidates` leaves them out) of the ``movable`` storages with bytes
    (a retained one too: it is back on the device before the backward's first op).
    ``d2h_op`` follows the candidates' rule: the last write at or before the gap, else
    the first access."""
    gaps = []
    for storage in sorted(movable):
        size = trace.storage_sizes.get(storage, 0)
        if size <= 0:
            continue
        accesses = trace.accesses_of(storage)
        ops = [op for op, _ in accesses]
        if boundary - 1 not in ops or boundary not in ops:
            continue
        writes = [op for op, kind in accesses if kind is AccessKind.WRITE and op < boundary]
        d2h_op = writes[-1] if writes else ops[0]
        gaps.append(OffloadCandidate(storage, boundary - 1, boundary, size, d2h_op))
    return gaps
