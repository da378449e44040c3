"""The design's greedy residency planner written the straightforward way: the oracle.

O(M·S): a plain list of resident bytes per op, scanned and updated op by op for every
candidate, exactly as section 4.4 of the design describes. It shares no code with
``hyper_offload.passes.plan.greedy`` beyond the IR types, so agreeing with it means
the fast planner implements the design, not merely itself.

Conventions both must share (they are part of the design as the issue pins it down):
ties in the ranking are broken by storage id ascending; zero-byte storages and gaps that
cover no op are not candidates; within a slot, ``post`` runs RELEASE_HOST, COPY_D2H,
RELEASE_DEVICE and ``pre`` runs COPY_H2D before WAIT_H2D, each kind by storage id.
"""

from __future__ import annotations

from hyper_offload.passes.ir.schedule import ActionKind, ResidencyAction, ResidencySchedule
from hyper_offload.passes.ir.trace import AccessKind, ActivationTrace

_POST_ORDER = [ActionKind.RELEASE_HOST, ActionKind.COPY_D2H, ActionKind.RELEASE_DEVICE]
_PRE_ORDER = [ActionKind.COPY_H2D, ActionKind.WAIT_H2D]


def reference_choice(trace: ActivationTrace) -> list[tuple[int, int, int, int, int]]:
    """Accepted gaps as ``(storage, start, end, size, d2h_op)``, in acceptance order."""
    n = trace.num_ops
    budget = trace.budget_bytes
    # Resident bytes per op with no offload, storage by storage.
    resident = [0] * n
    for storage in trace.accessed_storages():
        ops = [op for op, _ in trace.accesses_of(storage)]
        end = n if storage in trace.retained else ops[-1] + 1
        for op in range(ops[0], end):
            resident[op] += trace.storage_sizes[storage]
    # One candidate per gap covering >= 1 op; its D2H goes after the last write at or
    # before the gap start (or the first access, which creates the storage).
    candidates = []
    for storage in trace.accessed_storages():
        size = trace.storage_sizes[storage]
        accesses = trace.accesses_of(storage)
        for k in range(1, len(accesses)):
            start, end = accesses[k - 1][0], accesses[k][0]
            if end - start < 2 or size == 0:
                continue
            d2h_op = accesses[0][0]
            for op, kind in accesses[:k]:
                if kind is AccessKind.WRITE:
                    d2h_op = op
            candidates.append((storage, start, end, size, d2h_op))
    candidates.sort(key=lambda c: (-(c[2] - c[1]), -c[3], c[1], c[0]))
    chosen = []
    for cand in candidates:
        storage, start, end, size, _ = cand
        if any(resident[op] > budget for op in range(start + 1, end)):
            for op in range(start + 1, end):
                resident[op] -= size
            chosen.append(cand)
    return chosen


def plan(trace: ActivationTrace) -> ResidencySchedule:
    """The design's schedule for ``trace``."""
    chosen = reference_choice(trace)
    pre: list[list[ResidencyAction]] = [[] for _ in range(trace.num_ops)]
    post: list[list[ResidencyAction]] = [[] for _ in range(trace.num_ops)]
    for storage, start, end, _, _ in chosen:
        post[start].append(ResidencyAction(ActionKind.RELEASE_DEVICE, storage))
        pre[end].append(ResidencyAction(ActionKind.COPY_H2D, storage))
        pre[end].append(ResidencyAction(ActionKind.WAIT_H2D, storage))
    epochs = sorted({(c[0], c[4]) for c in chosen})
    for storage, d2h_op in epochs:
        last_reload = max(c[2] for c in chosen if (c[0], c[4]) == (storage, d2h_op))
        post[d2h_op].append(ResidencyAction(ActionKind.COPY_D2H, storage))
        post[last_reload].append(ResidencyAction(ActionKind.RELEASE_HOST, storage))
    for storage in trace.accessed_storages():
        if storage not in trace.retained:
            last = trace.accesses_of(storage)[-1][0]
            post[last].append(ResidencyAction(ActionKind.RELEASE_DEVICE, storage))

    def ordered(actions: list[ResidencyAction], order: list[ActionKind]) -> list[ResidencyAction]:
        return sorted(actions, key=lambda a: (order.index(a.kind), a.storage))

    return ResidencySchedule(
        pre=[ordered(a, _PRE_ORDER) for a in pre],
        post=[ordered(a, _POST_ORDER) for a in post],
    )
