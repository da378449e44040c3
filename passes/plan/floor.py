"""The floor planner: offload every candidate gap.

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

from ..analysis.liveness import OffloadCandidate, offload_candidates
from ..ir.schedule import ResidencySchedule
from ..ir.trace import AccessKind, ActivationTrace, StorageId
from .choice_lowering import lower_offload_choice

__all__ = ["FloorPlanner", "boundary_gaps"]


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
