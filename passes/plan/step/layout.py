"""The one layout of a training step: every invocation's ops end to end, as one trace.

:func:`lay_out_step` is where a step gets its position axis; everything the step plan
decides or reports is read off the :class:`StepTrace` it returns:

* ops: each event's ops in the order the step ran them (an invocation's forward ops, its
  backward ops later), and where the door measured the eager code between regions
  (:class:`~.model.BetweenRegions`) one op per gap of eager code, holding its peak;
* storages: storage ``s`` of invocation ``i`` is ``base[i] + s`` (bases in forward order,
  so a step of one invocation *is* its region's trace, ids and all); the eager code's
  bytes held across a region's event, and the bytes an invocation of a region the door
  has no trace of holds from its forward to its backward (measured), are storages of
  their own that no plan moves;
* what the caller holds: a block's activation inputs, and its model outputs except the
  step's last forward's (each the next region's input), are read at its forward's last op
  (``x = block(x)`` drops them only once the block returned); the last forward's outputs
  stay ``retained`` as in a region's trace;
* :attr:`StepTrace.floor`: every region's own schedule (``RegionFloor.schedule``: its
  floor, or the lowering in force) laid out: its copies, releases before a reload and
  reloads where its graphs run them (a held storage's release no earlier than its
  forward's last op, where its caller drops it), and each storage released after its
  last access on the step. ``check_schedule`` judges it on :attr:`StepTrace.trace` like any
  schedule; its resident curve is the step's floor (where the regions move what their
  lowering in force moves).

Tailored invocations (each invocation of a region that runs once per step and may be
lowered again, :func:`tailorable`) may move their storages as a plan of the whole step
likes: :attr:`StepTrace.movable`, within their invocation (no reload before its backward's
first op, no release after its forward's last op). Every other invocation runs its
region's schedule: its storages are *fixed*, and only keeping a slot on the device
(:func:`~.planner.choose_keep`) changes them. :func:`fixed_split` turns the fixed moves into storages of
their own, so that the shared pipeline plans the tailored storages around them.

Pure: no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from ...ir.schedule import ActionKind, ResidencyAction, ResidencySchedule
from ...ir.trace import AccessKind, ActivationTrace, StorageAccess, StorageId, TraceOp
from .model import Invocation, RegionFloor, StepEventKind, StepTimeline

__all__ = [
    "EAGER_OP", "OpOwner", "StepTrace", "fixed_split", "lay_out_step", "replace_storages",
    "tailorable",
]

EAGER_OP = "eager"
"""The name of an op standing for a gap of eager code between regions."""

_MOVES = frozenset({ActionKind.COPY_D2H, ActionKind.COPY_H2D, ActionKind.WAIT_H2D,
                    ActionKind.RELEASE_HOST})


class OpOwner(NamedTuple):
    """Who runs a step op: ``op`` of ``invocation``'s region trace, or (``invocation``
    None) the eager code of gap ``op`` (before event ``op``)."""

    invocation: Invocation | None
    op: int


@dataclass(frozen=True)
class StepTrace:
    """The step as one trace (module docstring) and where each invocation sits in it."""

    trace: ActivationTrace
    floor: ResidencySchedule
    owners: tuple[OpOwner, ...]
    forward_at: Mapping[Invocation, int]
    backward_at: Mapping[Invocation, int]
    base: Mapping[Invocation, int]
    """Storage ``s`` of invocation ``i`` is ``base[i] + s``."""
    regions: Mapping[int, RegionFloor]
    tailored: frozenset[Invocation]
    movable: frozenset[StorageId]
    earliest_reload: Mapping[StorageId, int]
    """Per storage of an invocation with a backward: the first op of that backward."""
    latest_release: Mapping[StorageId, int]
    """Per storage of an invocation with a backward: the last op of its forward."""

    def __repr__(self) -> str:
        return (f"StepTrace({len(self.base)} invocations, {self.trace.num_ops} ops, "
                f"{len(self.tailored)} tailored)")

    def storages_of(self, invocation: Invocation) -> range:
        region = self.regions.get(invocation.region)
        base = self.base[invocation]
        return range(base, base + (region.storage_count if region is not None else 0))

    def ops_of(self, invocation: Invocation) -> list[int]:
        """``invocation``'s step ops, forward then backward (its region's op order)."""
        region = self.regions[invocation.region]
        ops = list(range(self.forward_at[invocation],
                         self.forward_at[invocation] + region.num_fw_ops))
        if invocation in self.backward_at:
            start = self.backward_at[invocation]
            ops += range(start, start + region.num_bw_ops)
        return ops


def tailorable(timeline: StepTimeline, regions: Mapping[int, RegionFloor]) -> frozenset[Invocation]:
    """The invocations a plan of the step may move freely: each of a lowerable region that
    runs once in ``timeline``, forward and backward."""
    counts: dict[int, int] = {}
    for invocation in timeline.invocations:
        counts[invocation.region] = counts.get(invocation.region, 0) + 1
    backward = {e.invocation for e in timeline.events if e.kind is StepEventKind.BACKWARD}
    return frozenset(
        i for i in timeline.invocations
        if i.region in regions and regions[i.region].lowerable and counts[i.region] == 1
        and i in backward
    )


def lay_out_step(
    timeline: StepTimeline,
    regions: Mapping[int, RegionFloor],
    *,
    tailored: frozenset[Invocation] = frozenset(),
    budget_bytes: int = 0,
) -> StepTrace:
    """The step of ``timeline`` as one trace under ``budget_bytes`` (module docstring).
    ``regions`` holds every region of ``timeline`` the door has a trace of; an invocation
    of any other region is laid out from its measured ``retained_bytes`` alone."""
    invocations = timeline.invocations
    base, offset = {}, 0
    for invocation in invocations:
        base[invocation] = offset
        region = regions.get(invocation.region)
        offset += region.storage_count if region is not None else 0
    builder = _Builder(offset)
    last_forward = invocations[-1] if invocations else None
    forward_at: dict[Invocation, int] = {}
    backward_at: dict[Invocation, int] = {}
    between = timeline.between
    for k, (kind, invocation) in enumerate(timeline.events):
        if between is not None:
            builder.eager_gap(between.gap(k), k)
        forward = kind is StepEventKind.FORWARD
        (forward_at if forward else backward_at)[invocation] = len(builder.ops)
        region = regions.get(invocation.region)
        first = len(builder.ops)
        if region is None:
            builder.opaque(invocation, forward, timeline.retained_bytes.get(invocation, 0))
        else:
            span = range(region.num_fw_ops) if forward else range(region.num_fw_ops,
                                                                  region.trace.num_ops)
            builder.region_ops(invocation, region, span, base[invocation])
            if forward:
                outputs = region.trace.retained if invocation != last_forward else frozenset()
                builder.hold(region, base[invocation], region.held | outputs)
        if between is not None:
            builder.eager_during(between.during(k), first)
    if between is not None:
        builder.eager_gap(between.gap(len(timeline.events)), len(timeline.events))
    retained = _retained(invocations, regions, base, last_forward)
    first_trace = next((regions[i.region].trace for i in invocations if i.region in regions), None)
    trace = ActivationTrace(
        tuple(builder.trace_ops()), builder.sizes(regions, base, invocations),
        budget_bytes=budget_bytes, retained=retained,
        d2h_bandwidth_gbps=first_trace.d2h_bandwidth_gbps if first_trace else 16.0,
        h2d_bandwidth_gbps=first_trace.h2d_bandwidth_gbps if first_trace else 16.0,
    )
    earliest, latest = _limits(regions, base, forward_at, backward_at)
    tailored = frozenset(i for i in tailored if i in backward_at and i.region in regions)
    movable = frozenset(base[i] + s for i in tailored for s in regions[i.region].movable)
    step = StepTrace(trace, ResidencySchedule.empty(trace.num_ops), tuple(builder.owners),
                     forward_at, backward_at, base, dict(regions), tailored, movable,
                     earliest, latest)
    return _with_floor(step, builder.held_until)


def _retained(
    invocations: tuple[Invocation, ...], regions: Mapping[int, RegionFloor],
    base: Mapping[Invocation, int], last_forward: Invocation | None,
) -> frozenset[StorageId]:
    """Storages alive at the step's end: the last forward's model outputs, and what a
    region's backward returns (gradients, 0 bytes: the optimizer's memory)."""
    return frozenset(
        base[i] + s for i in invocations if i.region in regions
        for s in regions[i.region].trace.retained
        if i == last_forward or not regions[i.region].in_forward(s)
    )


def _limits(
    regions: Mapping[int, RegionFloor], base: Mapping[Invocation, int],
    forward_at: Mapping[Invocation, int], backward_at: Mapping[Invocation, int],
) -> tuple[dict[StorageId, int], dict[StorageId, int]]:
    """Per storage of an invocation with a backward: its backward's first op (no reload
    before it) and its forward's last op (no release after it)."""
    earliest: dict[StorageId, int] = {}
    latest: dict[StorageId, int] = {}
    for invocation, backward in backward_at.items():
        region = regions.get(invocation.region)
        if region is None:
            continue
        end = forward_at[invocation] + region.num_fw_ops - 1
        for storage in range(base[invocation], base[invocation] + region.storage_count):
            earliest[storage] = backward
            latest[storage] = end
    return earliest, latest


class _Builder:
    """The step trace's ops as they are laid out: accesses per op, by step storage."""

    def __init__(self, first_free: int) -> None:
        self.ops: list[tuple[str, dict[StorageId, AccessKind], tuple[StorageId, ...],
                             float | None]] = []
        self.owners: list[OpOwner] = []
        self.next_id = first_free
        self.extra_sizes: dict[StorageId, int] = {}
        self.held_until: dict[StorageId, int] = {}
        """Held storage -> the op where its caller drops it (its forward's last op)."""
        self._opaque: dict[Invocation, StorageId] = {}

    def region_ops(self, invocation: Invocation, region: RegionFloor, span: range,
                   base: int) -> None:
        for index in span:
            op = region.trace.ops[index]
            accesses = {base + a.storage: a.kind for a in op.accesses}
            outputs = tuple(base + s for s in op.outputs)
            self.ops.append((op.name, accesses, outputs, op.duration_s))
            self.owners.append(OpOwner(invocation, index))

    def hold(self, region: RegionFloor, base: int, storages: Iterable[StorageId]) -> None:
        """Read ``storages`` (those the forward touched, or its inputs) at the op just laid
        out: the forward's last op, where the caller drops them."""
        if not self.ops:
            return
        at = len(self.ops) - 1
        accesses = self.ops[at][1]
        for storage in storages:
            if region.in_forward(storage) or storage in region.held:
                accesses.setdefault(base + storage, AccessKind.READ)
                self.held_until[base + storage] = at

    def _new_storage(self, nbytes: int) -> StorageId:
        sid = self.next_id
        self.next_id += 1
        self.extra_sizes[sid] = nbytes
        return sid

    def eager_gap(self, nbytes: int, gap: int) -> None:
        """One op for gap ``gap`` of eager code, holding ``nbytes`` (its peak)."""
        if nbytes:
            sid = self._new_storage(nbytes)
            self.ops.append((EAGER_OP, {sid: AccessKind.WRITE}, (sid,), 0.0))
            self.owners.append(OpOwner(None, gap))

    def eager_during(self, nbytes: int, first: int) -> None:
        """Eager bytes held from op ``first`` to the last op laid out (across one event)."""
        if not nbytes or first >= len(self.ops):
            return
        sid = self._new_storage(nbytes)
        self.ops[first][1].setdefault(sid, AccessKind.WRITE)
        self.ops[-1][1].setdefault(sid, AccessKind.READ)

    def opaque(self, invocation: Invocation, forward: bool, nbytes: int) -> None:
        """An invocation of a region without a trace: one op per event, holding its
        measured retained bytes from its forward to its backward."""
        if not nbytes:
            return
        if forward:
            sid = self._opaque[invocation] = self._new_storage(nbytes)
            kind = AccessKind.WRITE
        else:
            sid, kind = self._opaque[invocation], AccessKind.READ
        name = f"r{invocation.region}:{'fw' if forward else 'bw'}"
        self.ops.append((name, {sid: kind}, (sid,) if forward else (), 0.0))
        self.owners.append(OpOwner(invocation, -1))

    def trace_ops(self) -> list[TraceOp]:
        return [
            TraceOp(name, tuple(StorageAccess(s, k) for s, k in accesses.items()),
                    tuple(o for o in outputs if o in accesses), duration)
            for name, accesses, outputs, duration in self.ops
        ]

    def sizes(self, regions: Mapping[int, RegionFloor], base: Mapping[Invocation, int],
              invocations: tuple[Invocation, ...]) -> dict[StorageId, int]:
        sizes = dict(self.extra_sizes)
        for invocation in invocations:
            region = regions.get(invocation.region)
            if region is not None:
                for storage, size in region.trace.storage_sizes.items():
                    sizes[base[invocation] + storage] = size
        return sizes


_POST_ORDER = {ActionKind.RELEASE_HOST: 0, ActionKind.COPY_D2H: 1, ActionKind.RELEASE_DEVICE: 2}
_PRE_ORDER = {ActionKind.COPY_H2D: 0, ActionKind.WAIT_H2D: 1}


def _with_floor(step: StepTrace, held_until: Mapping[StorageId, int]) -> StepTrace:
    """``step`` with :attr:`StepTrace.floor` (module docstring)."""
    num_ops = step.trace.num_ops
    pre: list[list[ResidencyAction]] = [[] for _ in range(num_ops)]
    post: list[list[ResidencyAction]] = [[] for _ in range(num_ops)]
    for invocation, base in step.base.items():
        region = step.regions.get(invocation.region)
        if region is None:
            continue
        positions = step.ops_of(invocation)
        reloaded = _reloaded_after(region.schedule)
        for op, position in enumerate(positions):
            for action in region.schedule.pre[op]:
                if action.kind in _MOVES:
                    pre[position].append(ResidencyAction(action.kind, base + action.storage))
            for action in region.schedule.post[op]:
                sid = base + action.storage
                if action.kind in _MOVES:
                    post[position].append(ResidencyAction(action.kind, sid))
                elif action.kind is ActionKind.RELEASE_DEVICE and reloaded.get(
                        action.storage, -1) > op:
                    at = max(position, held_until.get(sid, position))
                    post[at].append(ResidencyAction(action.kind, sid))
    for storage, last in _last_accesses(step.trace).items():
        if storage not in step.trace.retained:
            post[last].append(ResidencyAction(ActionKind.RELEASE_DEVICE, storage))
    floor = ResidencySchedule(
        pre=tuple(tuple(sorted(a, key=lambda x: _PRE_ORDER[x.kind])) for a in pre),
        post=tuple(tuple(sorted(a, key=lambda x: _POST_ORDER[x.kind])) for a in post),
    )
    return dataclasses.replace(step, floor=floor)


def _reloaded_after(schedule: ResidencySchedule) -> dict[StorageId, int]:
    """Each storage's last ``COPY_H2D`` op in ``schedule``."""
    last: dict[StorageId, int] = {}
    for op, _where, action in schedule.actions():
        if action.kind is ActionKind.COPY_H2D:
            last[action.storage] = op
    return last


def _last_accesses(trace: ActivationTrace) -> dict[StorageId, int]:
    return {sid: trace.accesses_of(sid)[-1][0] for sid in trace.accessed_storages()}


def replace_storages(
    base: ResidencySchedule, storages: frozenset[StorageId], source: ResidencySchedule
) -> ResidencySchedule:
    """``base`` with every action on ``storages`` taken from ``source`` instead (both on
    one trace); each slot keeps the action order ``check_schedule`` expects."""
    def merged(ours: tuple[ResidencyAction, ...], theirs: tuple[ResidencyAction, ...],
               order: Mapping[ActionKind, int]) -> tuple[ResidencyAction, ...]:
        kept = [a for a in ours if a.storage not in storages]
        taken = [a for a in theirs if a.storage in storages]
        return tuple(sorted(kept + taken, key=lambda a: order.get(a.kind, 0)))

    return ResidencySchedule(
        pre=tuple(merged(a, b, _PRE_ORDER) for a, b in zip(base.pre, source.pre)),
        post=tuple(merged(a, b, _POST_ORDER) for a, b in zip(base.post, source.post)),
    )


def fixed_split(step: StepTrace) -> ActivationTrace:
    """:attr:`StepTrace.trace` with every storage a fixed invocation's schedule moves split
    in two that no plan may move: the first from its birth to its release, the second
    from its reload on (born there). Tailored storages keep their ids, so a schedule of
    the tailored storages planned on this trace applies to the step trace as it is
    (:func:`replace_storages`)."""
    moves: dict[StorageId, tuple[int, int]] = {}
    released: dict[StorageId, int] = {}
    tailored = {s for i in step.tailored for s in step.storages_of(i)}
    for op, where, action in step.floor.actions():
        if action.storage in tailored:
            continue
        if action.kind is ActionKind.RELEASE_DEVICE and where == "post" and (
                action.storage not in moves):
            released[action.storage] = op
        elif action.kind is ActionKind.COPY_H2D and action.storage in released:
            moves.setdefault(action.storage, (released[action.storage], op))
    sizes = dict(step.trace.storage_sizes)
    second: dict[StorageId, StorageId] = {}
    for storage in sorted(moves):
        second[storage] = max(sizes, default=-1) + 1
        sizes[second[storage]] = sizes[storage]
    ops = []
    for index, op in enumerate(step.trace.ops):
        accesses: dict[StorageId, AccessKind] = {}
        for access in op.accesses:
            move = moves.get(access.storage)
            sid = second[access.storage] if move is not None and index >= move[1] else access.storage
            accesses[sid] = access.kind
        for storage, (release, reload) in moves.items():
            if index == release:
                accesses.setdefault(storage, AccessKind.READ)
            elif index == reload:
                accesses.setdefault(second[storage], AccessKind.READ)
        ops.append(TraceOp(op.name, tuple(StorageAccess(s, k) for s, k in accesses.items()),
                           duration_s=op.duration_s))
    retained = frozenset(second.get(s, s) for s in step.trace.retained)
    return ActivationTrace(
        tuple(ops), sizes, budget_bytes=step.trace.budget_bytes, retained=retained,
        d2h_bandwidth_gbps=step.trace.d2h_bandwidth_gbps,
        h2d_bandwidth_gbps=step.trace.h2d_bandwidth_gbps,
    )
