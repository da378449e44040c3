"""The step's proposals, one planner that :func:`~..planning.plan_residency` runs.

Two ways to hold a step under one budget, which :class:`StepPlanner` offers and the one
planning pipeline prices on the one timeline model:

* **keep on the lowerings in force** (``"keep"``): every region runs its schedule
  (:attr:`~.layout.StepTrace.floor`) and, per invocation, the runtime keeps the slots
  that fit (:mod:`.keep`). Nothing is compiled again; the only way for a region invoked
  several times per step (one compiled graph serves every invocation);
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
moving what does not lower it only costs time. Pure: no torch.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from hyper_offload.errors import HyperOffloadError

from ...analysis.liveness import offload_candidates
from ...analysis.validator import check_schedule
from ...ir.schedule import ResidencySchedule
from ...ir.trace import ActivationTrace
from ..choice_lowering import lower_offload_choice
from ..greedy import GreedyResidencyPlanner
from ..planning import plan_residency
from .keep import KeepChoice, choose_keep, drop_moves
from .layout import StepTrace, fixed_split, replace_storages
from .model import Slot, slots_of

__all__ = ["StepPlanner", "StepProposal"]

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
