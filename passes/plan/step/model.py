"""The step model's records: what a door observed of one training step, and each region.

A training step is rarely one compiled region run once. torchtitan compiles each block
on its own and runs that one compiled graph for every layer; FSDP2, DDP and any graph
break cut a model into several regions; the eager door sees one stretch of eager code,
with compiled blocks inside it. Every door describes the step it saw with these records
and hands them to :func:`~.layout.lay_out_step`, the one layout of the step:

* :class:`StepTimeline` — the forwards and backwards of the step's *invocations*
  (``r<region>#<ordinal>``: the ordinal-th forward of a region in the step, so one compiled
  block run for N layers is N invocations), in the order they ran, with what each one
  holds that no plan moves (measured) and the device bytes of the eager code between them
  (:class:`BetweenRegions`, measured by the door's meter);
* :class:`RegionFloor` — one region as the step plan sees it: its trace (forward ops,
  then backward ops), the schedule its graphs run unless the step plan lowers it again,
  which storages a lowering of its own may move, and which the caller holds.

Invariants: a timeline holds each of its invocations' forward exactly once, and a
backward only after that invocation's forward. Pure: no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

from ...analysis.validator import check_schedule
from ...ir.schedule import ActionKind, OpLimit, ResidencySchedule, op_limit
from ...ir.trace import ActivationTrace, StorageId

__all__ = [
    "BetweenRegions", "Invocation", "RegionFloor", "SizeBucket", "Slot", "StepEvent",
    "StepEventKind", "StepTimeline",
]

SizeBucket = tuple[tuple[str, int], ...]
"""One call's sizes: ``(symbol, value)`` pairs, sorted by symbol (empty: static sizes)."""


class StepEventKind(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"

    def __repr__(self) -> str:
        return self.value


class Invocation(NamedTuple):
    """The ``ordinal``-th forward of compiled region ``region`` in a step."""

    region: int
    ordinal: int

    def __repr__(self) -> str:
        return f"r{self.region}#{self.ordinal}"


class StepEvent(NamedTuple):
    kind: StepEventKind
    invocation: Invocation

    def __repr__(self) -> str:
        return f"{'F' if self.kind is StepEventKind.FORWARD else 'B'}({self.invocation!r})"


@dataclass(frozen=True)
class BetweenRegions:
    """Device bytes of the eager code between a step's compiled regions, against its events.

    ``gap_bytes[k]``: the most bytes eager code held at any moment of the gap before event
    ``k`` (``k == len(events)``: after the last event), its operands included;
    ``gap_ops[k]`` the op at that moment ("" for none) and ``gap_op_bytes[k]`` its own
    operands' bytes. ``during_bytes[k]``: bytes eager code holds while event ``k`` runs
    (made before it, alive after it). Invariant: ``len(gap_bytes) == len(during_bytes) + 1``.
    """

    gap_bytes: tuple[int, ...]
    gap_ops: tuple[str, ...]
    gap_op_bytes: tuple[int, ...]
    during_bytes: tuple[int, ...]

    def gap(self, k: int) -> int:
        return self.gap_bytes[k] if k < len(self.gap_bytes) else 0

    def during(self, k: int) -> int:
        return self.during_bytes[k] if k < len(self.during_bytes) else 0


@dataclass(frozen=True)
class StepTimeline:
    """One observed step: forwards and backwards of its invocations, in the order they ran.

    ``retained_bytes[i]``: device bytes invocation ``i``'s backward held at the end of its
    forward that no plan can move (saved activations its lowering keeps, a block's saved
    input), measured on the autograd graph; not parameters, leaf inputs, host copies or
    slots a step plan kept. Only invocations whose backward ran are listed. A region the
    door has no trace of (a cached graph without a stored plan) is laid out from it alone.
    """

    events: tuple[StepEvent, ...]
    retained_bytes: Mapping[Invocation, int] = field(default_factory=dict)
    sizes: Mapping[Invocation, SizeBucket] = field(default_factory=dict)
    """Each invocation's sizes where its region has symbolic ones (absent for static
    sizes). Two steps of other sizes are two timelines: each has its own plan."""
    between: BetweenRegions | None = None
    """The eager code between regions, where the door measured it; None: not measured."""

    def __repr__(self) -> str:
        return f"StepTimeline({' '.join(map(repr, self.events))})"

    @property
    def shape_key(self) -> tuple[Any, ...]:
        """The step's events and sizes (not its bytes)."""
        return (self.events, tuple(sorted(self.sizes.items())))

    @property
    def plan_key(self) -> tuple[Any, ...]:
        """What a plan of this step depends on: its events, sizes and eager bytes (regions
        are planned from their traces; the measured retained bytes stand in only for a
        region without one, and a change in them alone plans nothing again)."""
        return (self.events, tuple(sorted(self.sizes.items())), self.between)

    @property
    def invocations(self) -> tuple[Invocation, ...]:
        """Every invocation, in forward order."""
        return tuple(e.invocation for e in self.events if e.kind is StepEventKind.FORWARD)

    @property
    def regions(self) -> frozenset[int]:
        return frozenset(i.region for i in self.invocations)


class Slot(NamedTuple):
    """A storage a region's schedule copies out in its forward and reloads in its
    backward: ``copy`` (the op whose ``post`` copies it), ``release`` (whose ``post``
    frees its device bytes) and ``reload`` (whose ``pre`` starts the reload). Kept on the
    device instead, it holds ``nbytes`` over ops ``release + 1 .. reload - 1``."""

    storage: StorageId
    nbytes: int
    copy: int
    release: int
    reload: int


@dataclass(frozen=True)
class RegionFloor:
    """One compiled region as the step plan sees it.

    ``trace``: its forward ops then its backward ops, at the step's sizes; ``schedule``:
    what its graphs run unless the step plan lowers it again (its floor, or the lowering
    in force); ``movable``: storages a lowering of its own may move; ``held``: its
    activation inputs' storages (the caller holds a block's input through its forward);
    ``lowerable``: whether the step plan may lower it again with a schedule of its own
    (its partition is torch's and its sizes are numbers). Invariant: ``check_schedule(
    trace, schedule)`` accepts ``schedule`` (the door checked it when it lowered it).
    """

    trace: ActivationTrace
    num_fw_ops: int
    schedule: ResidencySchedule
    movable: frozenset[StorageId] = frozenset()
    held: frozenset[StorageId] = frozenset()
    lowerable: bool = False

    def __repr__(self) -> str:
        return (f"RegionFloor({self.num_fw_ops}+{self.num_bw_ops} ops, "
                f"{len(self.slots)} slots, lowerable={self.lowerable})")

    @property
    def num_bw_ops(self) -> int:
        return self.trace.num_ops - self.num_fw_ops

    @property
    def storage_count(self) -> int:
        """One more than the largest storage id (a step gives each invocation this many)."""
        return max(self.trace.storage_sizes, default=-1) + 1

    @functools.cached_property
    def slots(self) -> tuple[Slot, ...]:
        """Storages ``schedule`` copies in the forward and reloads in the backward."""
        return slots_of(self.schedule, self.trace.storage_sizes, self.num_fw_ops)

    @functools.cached_property
    def resident(self) -> tuple[int, ...]:
        """``check_schedule``'s device bytes during each op of ``schedule``."""
        return check_schedule(self.trace, self.schedule).resident_bytes

    def in_forward(self, storage: StorageId) -> bool:
        """Whether the forward touches ``storage`` (it is born there)."""
        accesses = self.trace.accesses_of(storage)
        return bool(accesses) and accesses[0][0] < self.num_fw_ops


def slots_of(
    schedule: ResidencySchedule, sizes: Mapping[StorageId, int], boundary: OpLimit,
) -> tuple[Slot, ...]:
    """The slots of ``schedule``: storages copied before op ``boundary`` (their backward's
    first op: one for every storage, or one per storage, :mod:`...ir.schedule`; a storage a
    mapping does not name has none) and reloaded at or after it, in storage order."""
    copy: dict[StorageId, int] = {}
    release: dict[StorageId, int] = {}
    reload: dict[StorageId, int] = {}
    for op, _where, action in schedule.actions():
        edge = op_limit(boundary, action.storage, -1)
        if edge < 0:
            continue
        if action.kind is ActionKind.COPY_D2H and op < edge:
            copy.setdefault(action.storage, op)
        elif action.kind is ActionKind.RELEASE_DEVICE and op < edge and action.storage in copy:
            release[action.storage] = op
        elif action.kind is ActionKind.COPY_H2D and op >= edge:
            reload.setdefault(action.storage, op)
    return tuple(
        Slot(sid, sizes[sid], copy[sid], release.get(sid, copy[sid]), reload[sid])
        for sid in sorted(copy) if sid in reload
    )
