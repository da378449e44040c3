"""The planner protocol: anything with ``plan(trace) -> ResidencySchedule`` plugs in.

A planner may also offer ``proposals(trace) -> Sequence[ResidencySchedule]`` (optional,
so not part of the runtime-checkable protocol): several schedules, each meeting the same
contract, among which :func:`~.planning.plan_residency` keeps the one its timeline model
predicts to stall least once placed (fewest bytes breaking ties). That is how the
objective becomes step time without the planner knowing a door's placement rules.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..ir.schedule import ResidencySchedule
from ..ir.trace import ActivationTrace


@runtime_checkable
class ResidencyPlanner(Protocol):
    """Decides what to move and when; never touches a device.

    Contract: the returned schedule has one pre/post slot per op of ``trace`` and passes
    ``check_schedule(trace, schedule)`` with no violation other than those the trace's
    infeasible ops force.
    """

    def plan(self, trace: ActivationTrace) -> ResidencySchedule: ...
