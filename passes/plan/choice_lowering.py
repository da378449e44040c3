"""Lower a choice of offloaded gaps to a :class:`ResidencySchedule`.

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
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import groupby
from operator import itemgetter

from ..analysis.liveness import OffloadCandidate, is_hold_gap
from ..ir.schedule import ActionKind, ResidencyAction, ResidencySchedule
from ..ir.trace import ActivationTrace

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
