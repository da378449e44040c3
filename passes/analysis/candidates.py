"""Offload candidates: the analysis every residency planner starts from.

A *candidate* is a gap between two consecutive accesses of one storage (see
:class:`~.liveness.Gap`) together with where its host copy would be
made. Offloading gap ``(storage, start, end)`` means::

    post[d2h_op]:  COPY_D2H storage        (once per write epoch, shared by its gaps)
    post[start]:   RELEASE_DEVICE storage
    pre[end]:      COPY_H2D storage, WAIT_H2D storage

so the storage is off the device for ops ``start + 1 .. end - 1`` and nowhere else.

``d2h_op`` is the last WRITE of the storage at or before ``start`` (a D2H placed there
can never be made stale by a later write before the release), or the storage's first
access when it is never written before the gap (the first access creates it).

A *held* storage (``trace.held_until``) has one more gap, from its last access to the
end of its hold: ``(storage, last, held_until + 1)``, a *hold gap*. Nothing reads it
again, so its lowering has no reload: the host copy only keeps the bytes a reference
can still reach, and is released after op ``held_until`` (:func:`is_hold_gap`). All gaps
with the same ``(storage, d2h_op)`` form one *write epoch*: they share one host copy,
so the D2H is paid once however many of them are offloaded.

Cost model shared by every planner here: offloading a set of gaps moves the size of
each gap once (its H2D) plus the size of each epoch with an offloaded gap once (its
D2H) — exactly ``bytes_d2h + bytes_h2d`` as ``check_schedule`` counts them.
"""

from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple

from ..ir.trace import AccessKind, ActivationTrace, StorageId
from .liveness import Gap, InfeasibleOp


class OffloadCandidate(NamedTuple):
    """One offloadable gap. Invariant: ``d2h_op <= start < end - 1`` and ``size > 0``."""

    storage: StorageId
    start: int
    end: int
    size: int
    d2h_op: int

    def __repr__(self) -> str:
        return f"cand(s{self.storage}: {self.start}->{self.end}, {self.size}B, d2h@{self.d2h_op})"

    @property
    def gap(self) -> Gap:
        return Gap(self.storage, self.start, self.end)

    @property
    def distance(self) -> int:
        return self.end - self.start

    @property
    def epoch(self) -> tuple[StorageId, int]:
        """The write epoch whose host copy this gap reloads from."""
        return (self.storage, self.d2h_op)


def offload_candidates(
    trace: ActivationTrace, movable: frozenset[StorageId] | None = None
) -> list[OffloadCandidate]:
    """Every gap worth considering, ordered by storage then position.

    Gaps that cover no op relieve nothing and gaps of zero-byte storages save nothing,
    so neither is a candidate. ``movable``: only those storages' gaps (None: every
    storage's); a step laid out as one trace has storages that must stay where they are
    between two accesses (a region's saved tensor that may not move).
    """
    candidates = []
    write = AccessKind.WRITE
    sizes = trace.storage_sizes
    for storage in trace.accessed_storages():
        size = sizes[storage]
        if size <= 0 or (movable is not None and storage not in movable):
            continue
        accesses = trace.accesses_of(storage)
        d2h_op = accesses[0][0]
        previous = d2h_op
        for index, (op, kind) in enumerate(accesses):
            if index and op - previous >= 2:
                candidates.append(OffloadCandidate(storage, previous, op, size, d2h_op))
            if kind is write:
                d2h_op = op
            previous = op
        held = trace.held_until.get(storage)
        if held is not None:  # the hold gap: previous is the last access, held > previous
            candidates.append(OffloadCandidate(storage, previous, held + 1, size, d2h_op))
    return candidates


def is_hold_gap(trace: ActivationTrace, candidate: OffloadCandidate) -> bool:
    """Whether ``candidate`` is its storage's hold gap (it ends past the last access, at
    the end of the hold: no op reads the storage there, so no reload)."""
    return candidate.end == trace.held_until.get(candidate.storage, -2) + 1


def design_rank_key(candidate: OffloadCandidate) -> tuple[int, int, int, int]:
    """Sort key (ascending) for the design's order: (distance, size, -start) descending.

    The design leaves ties between storages open; we break them by storage id,
    ascending, so every implementation of the design picks the same gaps.
    """
    return (-candidate.distance, -candidate.size, candidate.start, candidate.storage)


def op_byte_profile(trace: ActivationTrace) -> tuple[list[int], list[int]]:
    """``(resident, required)`` per op, in one pass over the accesses.

    Identical to ``liveness.resident_bytes_without_offload`` and
    ``liveness.required_bytes`` (the tests check it); computed here without building a
    ``StorageLiveness`` per storage, which dominates planning time on 10^5-op traces.
    """
    num_ops = trace.num_ops
    resident_delta = [0] * (num_ops + 1)
    held_delta = [0] * (num_ops + 1)
    operands = [0] * num_ops
    retained = trace.retained
    sizes = trace.storage_sizes
    for storage in trace.accessed_storages():
        accesses = trace.accesses_of(storage)
        size = sizes[storage]
        for op, _ in accesses:
            operands[op] += size
        first, last = accesses[0][0], accesses[-1][0]
        resident_delta[first] += size
        if storage in retained:
            resident_delta[num_ops] -= size
            held_delta[last + 1] += size  # past its last access it is held until the end
        else:
            resident_delta[trace.held_end(storage) + 1] -= size
    resident = list(accumulate(resident_delta))[:num_ops]
    held = accumulate(held_delta)
    return resident, [own + h for own, h in zip(operands, held)]


def budget_excess(trace: ActivationTrace) -> tuple[list[int], list[InfeasibleOp]]:
    """Per-op excess over the allowance with no offload, and the infeasible ops.

    The allowance is ``max(budget, required_bytes)``: an op whose own operands exceed
    the budget (infeasible) is satisfied once everything else around it is offloaded,
    which is exactly what ``check_schedule`` accepts. Positive excess means "over".
    The infeasible ops equal ``liveness.infeasible_ops(trace)``.
    """
    budget = trace.budget_bytes
    resident, required = op_byte_profile(trace)
    excess = [r - (need if need > budget else budget) for r, need in zip(resident, required)]
    infeasible = [
        InfeasibleOp(i, need, need - budget) for i, need in enumerate(required) if need > budget
    ]
    return excess, infeasible


def excess_over_allowed(trace: ActivationTrace) -> list[int]:
    """The first half of :func:`budget_excess`."""
    return budget_excess(trace)[0]
