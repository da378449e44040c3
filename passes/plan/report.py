"""What planners give, and how a choice of gaps becomes a plan: the planner protocol, a
plan's summary, and the pipeline every gap-choosing planner shares, with the lowering of
its choice to a schedule and the floor (the choice of every gap).

**The planner protocol**: anything with ``plan(trace) -> ResidencySchedule`` plugs in.

A planner may also offer ``proposals(trace) -> Sequence[ResidencySchedule]`` (optional,
so not part of the runtime-checkable protocol): several schedules, each meeting the same
contract, among which :func:`~.planning.plan_residency` keeps the one its timeline model
predicts to stall least once placed (fewest bytes breaking ties). That is how the
objective becomes step time without the planner knowing a door's placement rules.

**One summary of a plan**, whatever made it: the figures every report and CLI prints. A
region's plan (the compile door's region scope), the eager session's plan, a step's plan
(the compile door's step scope, ``estimate``) and ``hyper-offload plan`` all answer the
same questions: how high the device bytes go against the budget, how low they could go
(the floor: everything movable moved), how high without offload, how many bytes move and
stay, how many host bytes that takes against the host budget, which budget binds, and what
it costs in time. :class:`PlanSummary` holds those figures and derives ``binding`` and
``fits`` in one place. Pure: no torch.

**The report** (:class:`PlanReport`) and the one pipeline every gap-choosing planner
shares. A planner that offloads whole gaps differs from another only in *which* gaps it
picks: candidates and per-op excess come from :mod:`..analysis.liveness`, the pick from
the planner, and the schedule from :func:`lower_offload_choice`.

**Lowering a choice** of offloaded gaps to a :class:`ResidencySchedule`. Every planner
here separates *which* gaps to offload (analysis, in the planner) from *how* that choice
becomes actions (here), so the greedy planner, its refinement and the exact ILP planner
all emit schedules the same way. For a chosen set of
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

**The floor planner** (:class:`FloorPlanner`): offload every candidate gap. A schedule
that offloads every gap of :func:`~..analysis.liveness.offload_candidates` keeps no
storage on the device across a gap, so no schedule of the same gaps has fewer device bytes
at any op: it is the trace's *floor*. A door that must fit a budget before it knows what
else shares the device plans at the floor (the compile door's first step, when a step has
several regions or invocations, :mod:`hyper_offload.passes.plan.step`) and later keeps on
the device the gaps a wider view says it can afford. Placement
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

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter
from typing import Protocol, runtime_checkable

from ..analysis.liveness import (
    InfeasibleOp, OffloadCandidate, budget_excess, is_hold_gap, offload_candidates,
)
from ..ir.schedule import ActionKind, ResidencyAction, ResidencySchedule
from ..ir.trace import AccessKind, ActivationTrace, StorageId

__all__ = [
    "Binding",
    "ChooseGaps",
    "FloorPlanner",
    "PlanReport",
    "PlanSummary",
    "ResidencyPlanner",
    "binding",
    "boundary_gaps",
    "lower_offload_choice",
    "plan_by_choice",
]


@runtime_checkable
class ResidencyPlanner(Protocol):
    """Decides what to move and when; never touches a device.

    Contract: the returned schedule has one pre/post slot per op of ``trace`` and passes
    ``check_schedule(trace, schedule)`` with no violation other than those the trace's
    infeasible ops force.
    """

    def plan(self, trace: ActivationTrace) -> ResidencySchedule: ...


Binding = str
"""``"device"``, ``"host"``, ``"both"`` or ``"none"`` (see :func:`binding`)."""


def binding(*, budget_bytes: int, floor_peak_bytes: int, peak_bytes: int, moved_bytes: int,
            host_forced: bool) -> Binding:
    """Which budget limits a plan.

    ``"host"``: the host budget kept bytes on the device past the device budget (more
    host memory, or recompute, helps); ``"device"``: the floor alone is over the device
    budget (only recompute or a larger budget helps), or the device budget made the plan
    move bytes and the host had room; ``"both"``: both at once; ``"none"``: nothing had
    to move. ``host_forced``: whether the host budget made the plan keep anything."""
    host = host_forced and peak_bytes > max(budget_bytes, floor_peak_bytes)
    device = floor_peak_bytes > budget_bytes
    if host:
        return "both" if device else "host"
    return "device" if device or moved_bytes else "none"


@dataclass(frozen=True)
class PlanSummary:
    """A plan's figures (bytes; *predicted*, except where a door says it measured them).

    ``moved_bytes`` is what goes to the host per step (each byte also comes back once);
    ``kept_bytes`` what a plan could have moved and keeps on the device; ``floor_peak_bytes``
    the least peak any plan of the same lowering reaches; ``peak_host_bytes`` counts host
    buffers as the pool holds them (power-of-two buckets)."""

    budget_bytes: int
    peak_bytes: int
    floor_peak_bytes: int
    peak_without_offload_bytes: int
    moved_bytes: int
    kept_bytes: int = 0
    peak_host_bytes: int = 0
    host_budget_bytes: int | None = None
    host_forced: bool = False
    """Whether the host budget made the plan keep bytes it would have moved."""
    predicted_stall_s: float = 0.0

    @property
    def fits(self) -> bool:
        """Whether the peak is within the budget (never when the floor is not)."""
        return self.peak_bytes <= self.budget_bytes

    @property
    def binding(self) -> Binding:
        return binding(budget_bytes=self.budget_bytes, floor_peak_bytes=self.floor_peak_bytes,
                       peak_bytes=self.peak_bytes, moved_bytes=self.moved_bytes,
                       host_forced=self.host_forced)


#: Picks the gaps to offload from all candidates and the per-op bytes over budget.
ChooseGaps = Callable[[Sequence[OffloadCandidate], Sequence[int]], Sequence[OffloadCandidate]]


@dataclass(frozen=True)
class PlanReport:
    """What a planner decided, and why it could not do better where it could not.

    ``chosen`` are the offloaded gaps in acceptance order; ``infeasible_ops`` the ops
    whose own operands exceed the budget (with the excess bytes); ``plan_seconds`` the
    wall time of the analysis and lowering.
    """

    schedule: ResidencySchedule
    chosen: tuple[OffloadCandidate, ...]
    infeasible_ops: tuple[InfeasibleOp, ...]
    num_candidates: int
    planner: str
    plan_seconds: float

    @property
    def feasible(self) -> bool:
        return not self.infeasible_ops

    def __repr__(self) -> str:
        return (
            f"PlanReport({self.planner}: {len(self.chosen)}/{self.num_candidates} gaps offloaded, "
            f"{len(self.infeasible_ops)} infeasible ops, {self.plan_seconds * 1e3:.1f} ms)"
        )


def plan_by_choice(
    trace: ActivationTrace,
    choose: ChooseGaps,
    *,
    planner: str,
    movable: frozenset[StorageId] | None = None,
) -> PlanReport:
    """Analyse ``trace``, let ``choose`` pick gaps (of ``movable`` storages only, when
    given), lower the pick; time the whole."""
    started = time.perf_counter()
    candidates = offload_candidates(trace, movable)
    excess, infeasible = budget_excess(trace)
    chosen = choose(candidates, excess)
    return PlanReport(
        schedule=lower_offload_choice(trace, chosen),
        chosen=tuple(chosen),
        infeasible_ops=tuple(infeasible),
        num_candidates=len(candidates),
        planner=planner,
        plan_seconds=time.perf_counter() - started,
    )


# ---------------------------------------------------------------- lowering a choice; the floor

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
    """A :class:`ResidencyPlanner` whose schedule offloads every candidate gap
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
