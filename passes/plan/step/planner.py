"""The step's proposals, one planner that :func:`~..planning.plan_residency` runs, and
which slots each proposal keeps on the device.

Two ways to hold a step under one budget, which :class:`StepPlanner` offers and the one
planning pipeline prices on the one timeline model:

* **keep on the lowerings in force** (``"keep"``): every region runs its schedule
  (:attr:`~.layout.StepTrace.floor`) and, per invocation, the runtime keeps the slots
  that fit (:func:`choose_keep`, below). Nothing is compiled again; the only way for a
  region invoked several times per step (one compiled graph serves every invocation);
* **a schedule made for the step** (``"step schedule"``): the tailored invocations'
  storages planned on the whole step by the shared pipeline (the time-aware greedy,
  release holding, prefetch placement) around the fixed moves
  (:func:`~.layout.fixed_split`), then their slots and every other slot kept where they
  fit (and once with only the slots that cost nothing kept: ``"step schedule, nothing
  kept"``). A tailored region is then lowered again with its cut of the schedule.

Every proposal is a schedule of the step trace: ``check_schedule`` judges it and
``predict_timeline`` prices it like any other; the pipeline keeps the least predicted
stall, then the fewest bytes moved, then the first. Below the floor (the budget is
under the floor's peak: no plan meets it) every proposal is made at the floor's peak:
moving what does not lower it only costs time.

**Which slots stay on the device** (the keep-set choice of a step's schedule).

A region's graphs are compiled once for every invocation, so an invocation cannot move
less than its lowering moves by another schedule; it can *keep* a slot instead: its
``copy_d2h`` makes a device copy where it would have made a host copy
(``TransferRuntime.keeping``), the source is freed where the lowering frees it, and the
reload hands the device copy back. So keeping slot ``s`` costs its bytes on the device
from just after its copy until its reload starts (``Slot.copy + 1 .. Slot.reload - 1``):
one window more (copy to release) than the same schedule without its moves shows.

:func:`choose_keep` keeps slots greedily, those holding the device over the fewest ops
first (a slot whose reload follows its copy soonest is the hardest to hide), larger first
on ties, while every op stays within ``cap`` (the budget, or the floor's peak where the
floor alone is over it: moving what stays under the floor's peak only costs time); each
decision is one range query and one range add on a
:class:`~..segment_tree.RangeAddMaxTree`. The host budget is the planners' one ledger
(:class:`~..host_budget.HostLedger`): the slots left to move claim host room in the
order they are worth moving (the longest first); one the ledger has no room for stays on
the device too, past ``cap`` if need be (the plan's ``binding`` then says so).

Invariant: at every op the bytes are at most ``cap`` plus what the host budget forced
to stay; with no host budget, ``peak <= cap``. Pure: no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from hyper_offload.errors import HyperOffloadError

from ...analysis.liveness import OffloadCandidate, offload_candidates
from ...analysis.validator import check_schedule
from ...ir.schedule import ActionKind, ResidencyAction, ResidencySchedule, host_bucket_bytes
from ...ir.trace import ActivationTrace, StorageId
from ..report import lower_offload_choice
from ..greedy import GreedyResidencyPlanner
from ..host_budget import HostLedger
from ..planning import plan_residency
from ..segment_tree import RangeAddMaxTree
from .layout import StepTrace, fixed_split, replace_storages
from .model import Slot, slots_of

__all__ = ["KeepChoice", "StepPlanner", "StepProposal", "choose_keep", "drop_moves",
           "kept_bytes_curve"]

LOGGER = logging.getLogger("hyper_offload")


class StepProposal(NamedTuple):
    """One proposal: its name, its schedule of the step trace, the keep choice it holds,
    and the schedule made for the tailored invocations it builds on (None: keep only)
    with the budget it was planned under."""

    name: str
    schedule: ResidencySchedule
    keep: KeepChoice
    slots: tuple[Slot, ...]
    """Every slot of the schedule this proposal keeps slots of (kept or not)."""
    tailored: ResidencySchedule | None
    tailored_budget_bytes: int


class StepPlanner:
    """A :class:`~..report.ResidencyPlanner` of one :class:`~.layout.StepTrace` (module
    docstring). ``cap``: the bytes no op may exceed (the budget, or the floor's peak where
    that is higher); ``host_budget_bytes``: the host budget every proposal keeps.
    :attr:`made` holds the proposals of the last :meth:`proposals` call, in order."""

    def __init__(self, step: StepTrace, cap: int, host_budget_bytes: int | None = None,
                 *, where: str = "hyper_offload step plan") -> None:
        self.step = step
        self.cap = cap
        self.host_budget_bytes = host_budget_bytes
        self.where = where
        self.made: list[StepProposal] = []

    def __repr__(self) -> str:
        return f"StepPlanner({self.step!r}, cap={self.cap}, host={self.host_budget_bytes})"

    def plan(self, trace: ActivationTrace) -> ResidencySchedule:
        return self.proposals(trace)[0]

    def proposals(self, trace: ActivationTrace) -> list[ResidencySchedule]:
        step = self.step
        self.made = [self._kept("keep", step.floor, True, None, 0)]
        tailored = self._tailored()
        if tailored is not None:
            schedule, at = tailored
            base = replace_storages(
                step.floor, frozenset(s for i in step.tailored for s in step.storages_of(i)),
                schedule)
            self.made += [
                self._kept("step schedule", base, True, schedule, at),
                self._kept("step schedule, nothing kept", base, False, schedule, at),
            ]
        return [p.schedule for p in self.made]

    def _kept(self, name: str, base: ResidencySchedule, keep: bool,
              tailored: ResidencySchedule | None, at: int) -> StepProposal:
        step = self.step
        slots = slots_of(base, step.trace.storage_sizes, step.earliest_reload)
        floor = check_schedule(step.trace, base).resident_bytes
        choice = choose_keep(floor, slots, self.cap, host_budget_bytes=self.host_budget_bytes,
                             keep=keep)
        kept = [s for s in slots if s.storage in choice.kept]
        return StepProposal(name, drop_moves(base, kept), choice, slots, tailored, at)

    def _tailored(self) -> tuple[ResidencySchedule, int] | None:
        """The tailored invocations' schedule, planned by the shared pipeline on the step
        with the fixed moves split out, under the budget or the floor's peak there; None
        when there is none or planning it failed (the lowerings in force still hold the
        step exactly)."""
        step = self.step
        if not step.movable:
            return None
        split = fixed_split(step)
        floor = lower_offload_choice(split, offload_candidates(split, step.movable))
        at = max(self.cap, check_schedule(split, floor).peak_resident_bytes)
        planner = GreedyResidencyPlanner(movable=step.movable,
                                         earliest_prefetch_op=step.earliest_reload)
        try:
            made = plan_residency(
                split.with_budget(at), planner, earliest_prefetch_op=step.earliest_reload,
                release_waits_for_d2h=True, latest_release_op=step.latest_release,
                where=self.where,
            )
        except HyperOffloadError as error:  # a bug: the lowerings in force hold the step
            LOGGER.warning("%s: planning the step as one trace failed (%s); every region "
                           "keeps the lowering it runs", self.where, error)
            return None
        return made.schedule, at


class KeepChoice(NamedTuple):
    """The slots kept, the device peak and the host peak they leave, and how many slots
    stay only because the host budget had no room for them."""

    kept: frozenset[StorageId]
    peak_bytes: int
    peak_host_bytes: int
    kept_for_host: int


def _span(slot: Slot) -> int:
    """Ops over which keeping ``slot`` holds its bytes."""
    return max(slot.reload - slot.copy - 1, 0)


def choose_keep(
    floor: Sequence[int],
    slots: Sequence[Slot],
    cap: int,
    *,
    host_budget_bytes: int | None = None,
    keep: bool = True,
) -> KeepChoice:
    """Keep slots of a schedule whose device bytes per op are ``floor`` (module
    docstring). ``keep=False`` keeps only the slots that cost nothing (no op runs while
    they would be away); ``host_budget_bytes`` is the host budget (None: none)."""
    positions = max(len(floor), 1)
    room = RangeAddMaxTree([min(value - cap, 0) for value in floor] or [0])
    kept: list[Slot] = []
    for slot in sorted(slots, key=lambda s: (_span(s), -s.nbytes, s.storage)):
        lo, hi = slot.copy + 1, slot.reload
        if lo >= hi:  # nothing runs while it would be away: keeping it is free
            kept.append(slot)
            continue
        if not keep or room.max(lo, hi) + slot.nbytes > 0:
            continue
        room.add(lo, hi, slot.nbytes)
        kept.append(slot)
    chosen = {s.storage for s in kept}
    moved = sorted((s for s in slots if s.storage not in chosen),
                   key=lambda s: (-_span(s), -s.nbytes, s.storage))
    ledger = HostLedger(positions, host_budget_bytes)
    forced = {s.storage for s in moved if not ledger.take(_as_candidate(s))}
    kept += [s for s in moved if s.storage in forced]
    return KeepChoice(
        frozenset(s.storage for s in kept), kept_bytes_curve(floor, kept).max_all(),
        _host_peak([s for s in moved if s.storage not in forced], positions), len(forced),
    )


def _as_candidate(slot: Slot) -> OffloadCandidate:
    """``slot`` as the offload gap whose host interval the ledger counts (its copy to its
    reload, inclusive)."""
    return OffloadCandidate(slot.storage, slot.release, max(slot.reload, slot.release + 1),
                            slot.nbytes, slot.copy)


def _host_peak(moved: Sequence[Slot], positions: int) -> int:
    """The bucketed host bytes the moved slots hold at once, over the ops the ledger
    counts for each (never fewer than the pool holds)."""
    tree = RangeAddMaxTree([0] * positions)
    for slot in moved:
        candidate = _as_candidate(slot)
        tree.add(candidate.d2h_op, min(candidate.end + 1, positions),
                 host_bucket_bytes(slot.nbytes))
    return max(tree.max_all(), 0)


def kept_bytes_curve(floor: Sequence[int], kept: Sequence[Slot]) -> RangeAddMaxTree:
    """Device bytes per op of the schedule whose curve is ``floor`` with ``kept`` slots
    kept (each adds its bytes from just after its copy to just before its reload)."""
    tree = RangeAddMaxTree(list(floor) or [0])
    for slot in kept:
        if slot.copy + 1 < slot.reload:
            tree.add(slot.copy + 1, slot.reload, slot.nbytes)
    return tree


def drop_moves(schedule: ResidencySchedule, kept: Sequence[Slot]) -> ResidencySchedule:
    """``schedule`` without the moves of ``kept`` slots: their copy, their release before
    the reload, their reload, its wait and the host release (their final release after
    their last access stays)."""
    dropped: set[tuple[int, str, ResidencyAction]] = set()
    for slot in kept:
        sid = slot.storage
        dropped.add((slot.copy, "post", ResidencyAction(ActionKind.COPY_D2H, sid)))
        dropped.add((slot.release, "post", ResidencyAction(ActionKind.RELEASE_DEVICE, sid)))
    storages = {slot.storage for slot in kept}
    moves_after = (ActionKind.COPY_H2D, ActionKind.WAIT_H2D, ActionKind.RELEASE_HOST)

    def keep_action(op: int, where: str, action: ResidencyAction) -> bool:
        if action.storage not in storages:
            return True
        if (op, where, action) in dropped:
            return False
        return action.kind not in moves_after

    return ResidencySchedule(
        pre=tuple(tuple(a for a in acts if keep_action(op, "pre", a))
                  for op, acts in enumerate(schedule.pre)),
        post=tuple(tuple(a for a in acts if keep_action(op, "post", a))
                   for op, acts in enumerate(schedule.post)),
    )
