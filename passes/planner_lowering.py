"""Lower a choice of offloaded gaps to a :class:`ResidencySchedule`.

Every planner here separates *which* gaps to offload (analysis, in the planner) from
*how* that choice becomes actions (this module), so the greedy planner, its refinement
and the exact ILP planner all emit schedules the same way. For a chosen set of
:class:`~hyper_offload.passes.planner_candidates.OffloadCandidate`::

    post[d2h_op]        COPY_D2H s        once per write epoch with a chosen gap
    post[start]         RELEASE_DEVICE s  for each chosen gap
    pre[end]            COPY_H2D s, WAIT_H2D s
    post[last reload]   RELEASE_HOST s    the epoch's host copy has no further use
    post[last access]   RELEASE_DEVICE s  for every storage that is not retained

Within a slot the order is fixed so that ``check_schedule`` accepts it and two planners
that choose the same gaps emit identical schedules: ``post`` runs every RELEASE_HOST,
then every COPY_D2H, then every RELEASE_DEVICE (a write that opens a new epoch at the
op where the previous epoch's last reload lands must free the stale buffer before it
copies again); ``pre`` starts every COPY_H2D before the first WAIT_H2D so the copies
overlap. Within one kind, actions are ordered by storage id.
"""

from __future__ import annotations

from collections.abc import Iterable

from .planner_candidates import OffloadCandidate
from .schedule import ActionKind, ResidencyAction, ResidencySchedule
from .trace import ActivationTrace, StorageId

_POST_PHASE = {ActionKind.RELEASE_HOST: 0, ActionKind.COPY_D2H: 1, ActionKind.RELEASE_DEVICE: 2}
_PRE_PHASE = {ActionKind.COPY_H2D: 0, ActionKind.WAIT_H2D: 1}


def lower_offload_choice(
    trace: ActivationTrace, chosen: Iterable[OffloadCandidate]
) -> ResidencySchedule:
    """The schedule that offloads exactly the ``chosen`` gaps (order is irrelevant)."""
    # Sparse slots: most ops get no action. Actions are created once, here; a slot
    # with several of them is sorted into the documented order at the end.
    pre: dict[int, list[ResidencyAction]] = {}
    post: dict[int, list[ResidencyAction]] = {}
    release_device, copy_d2h, release_host = (
        ActionKind.RELEASE_DEVICE, ActionKind.COPY_D2H, ActionKind.RELEASE_HOST
    )
    copy_h2d, wait_h2d = ActionKind.COPY_H2D, ActionKind.WAIT_H2D
    last_reload: dict[tuple[StorageId, int], int] = {}
    for storage, start, end, _, d2h_op in chosen:
        epoch = (storage, d2h_op)
        if end > last_reload.get(epoch, -1):
            last_reload[epoch] = end
        post.setdefault(start, []).append(ResidencyAction(release_device, storage))
        pre.setdefault(end, []).extend(
            (ResidencyAction(copy_h2d, storage), ResidencyAction(wait_h2d, storage))
        )
    for (storage, d2h_op), end in last_reload.items():
        post.setdefault(d2h_op, []).append(ResidencyAction(copy_d2h, storage))
        post.setdefault(end, []).append(ResidencyAction(release_host, storage))
    retained = trace.retained
    for storage in trace.accessed_storages():
        if storage not in retained:
            last = trace.accesses_of(storage)[-1][0]
            post.setdefault(last, []).append(ResidencyAction(release_device, storage))
    return ResidencySchedule(
        pre=_slots(pre, _PRE_PHASE, trace.num_ops), post=_slots(post, _POST_PHASE, trace.num_ops)
    )


def _slots(
    sparse: dict[int, list[ResidencyAction]], phase: dict[ActionKind, int], num_ops: int
) -> list[tuple[ResidencyAction, ...]]:
    def order(action: ResidencyAction) -> tuple[int, StorageId]:
        return (phase[action.kind], action.storage)

    empty: tuple[ResidencyAction, ...] = ()
    slots = [empty] * num_ops
    for op, actions in sparse.items():
        if len(actions) > 1:
            actions.sort(key=order)
        slots[op] = tuple(actions)
    return slots
