"""The step laid out as one trace, planned by the region pipeline, and cut back per region.

:mod:`.step_plan` keeps slots of the regions' *floor* lowerings, whose copies, release
points and reload points were placed before anything was known of the step. Where a
region runs once per step, nothing forces that: it can be lowered again with a schedule
made for the step (:mod:`.step_planner` decides, the backend re-lowers). This module
makes those schedules.

:func:`build_step_trace` lays every invocation's ops end to end in the order the step ran
them, as :mod:`.step_timeline` does for pricing, but without a schedule: a trace the
shared pipeline (:func:`~hyper_offload.passes.plan.planning.plan_residency`, the region
scope's planner, release holding and prefetch placement) plans like any region's:

* storage ``s`` of invocation ``i`` is ``base[i] + s`` (bases in forward order, so a step
  of one invocation *is* its region's trace, ids and all);
* an invocation whose region runs more than once per step keeps its floor lowering (one
  compiled graph serves every invocation): each storage its floor moves becomes two that
  no plan may move, one from its birth to its floor release, one from its floor reload
  on (born there), so the others are planned around the floor as it will run;
* an invocation's activation inputs are read at its forward's last op (the caller holds
  a block's input until the block returns), and so are its model outputs except those
  of the step's last forward, which stay ``retained`` as in a region's trace (the
  others are the next region's input, counted there);
* only storages its region may move (``movable``) offer gaps; each may be reloaded no
  earlier than its invocation's first backward op and released no later than its
  invocation's last forward op (:mod:`hyper_offload.passes.ir.limits`), as in a region.

:func:`cut_schedule` takes the step's schedule back to one invocation's region: its
actions on its own storages, in its own ops, minus the final release of a storage its
region's trace keeps to the end. ``check_schedule`` judges the result on the region's
own trace; a cut it rejects is not used. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hyper_offload.passes.analysis.validator import ScheduleReport, check_schedule
from hyper_offload.passes.ir.schedule import ActionKind, ResidencyAction, ResidencySchedule
from hyper_offload.passes.ir.trace import AccessKind, ActivationTrace, StorageAccess, TraceOp

from .step_model import Invocation, StepEventKind, StepTimeline
from .step_plan import held_inputs

if TYPE_CHECKING:
    from hyper_offload.passes.fx.graph_trace import FxTrace

__all__ = [
    "RegionTrace", "StepTrace", "build_step_trace", "cut_schedule", "kept_across", "region_trace",
]


@dataclass(frozen=True)
class RegionTrace:
    """What the step trace needs of one region: its floor trace and lowering.

    ``movable``: storages its lowering may move (every ``copy_d2h`` slot); ``held``: its
    activation inputs' storages; ``floor``: the schedule its graphs run where the step
    plan does not lower it again (its floor, or the lowering it is kept at)."""

    trace: ActivationTrace
    num_fw_ops: int
    movable: frozenset[int]
    held: frozenset[int]
    floor: ResidencySchedule

    @property
    def storage_count(self) -> int:
        return max(self.trace.storage_sizes, default=-1) + 1


def region_trace(fx_trace: FxTrace, floor: ResidencySchedule) -> RegionTrace:
    """The :class:`RegionTrace` of a region traced as ``fx_trace`` (its floor's
    ``plan_graphs(floor=True)``) whose floor lowering runs ``floor``."""
    return RegionTrace(
        fx_trace.trace, fx_trace.num_fw_ops, frozenset(fx_trace.movable()),
        held_inputs(fx_trace.node_storage, fx_trace.activation_inputs), floor,
    )


@dataclass(frozen=True)
class StepTrace:
    """The step as one trace (module docstring) and where each invocation sits in it."""

    trace: ActivationTrace
    movable: frozenset[int]
    earliest_reload: Mapping[int, int]
    """Per movable storage: the first op of its invocation's backward."""
    latest_release: Mapping[int, int]
    """Per movable storage: the last op of its invocation's forward."""
    forward_at: Mapping[Invocation, int]
    backward_at: Mapping[Invocation, int]
    base: Mapping[Invocation, int]
    """Storage ``s`` of invocation ``i`` is ``base[i] + s``."""
    planned: frozenset[Invocation]
    """The invocations whose storages the step plan may move (the others run their floor)."""


def build_step_trace(
    timeline: StepTimeline,
    regions: Mapping[int, RegionTrace],
    planned: frozenset[Invocation],
    budget_bytes: int,
) -> StepTrace:
    """The step of ``timeline`` as one trace under ``budget_bytes`` (module docstring);
    ``planned``: invocations whose movable storages may move as the plan likes (each
    other one keeps its region's floor)."""
    invocations = timeline.invocations
    base, offset = {}, 0
    for invocation in invocations:
        base[invocation] = offset
        offset += regions[invocation.region].storage_count
    builder = _StepBuilder(offset)
    last_forward = invocations[-1] if invocations else None
    forward_at: dict[Invocation, int] = {}
    backward_at: dict[Invocation, int] = {}
    between = timeline.between
    for k, (kind, invocation) in enumerate(timeline.events):
        if between is not None:
            builder.eager(between.gap(k))
        region = regions[invocation.region]
        forward = kind is StepEventKind.FORWARD
        (forward_at if forward else backward_at)[invocation] = len(builder.ops)
        span = (range(region.num_fw_ops) if forward
                else range(region.num_fw_ops, region.trace.num_ops))
        fixed = invocation not in planned
        first = len(builder.ops)
        builder.add_ops(region, span, base[invocation], fixed)
        if between is not None:
            builder.eager(between.during(k), first)
        if forward:
            held = region.held | (region.trace.retained if invocation != last_forward else set())
            builder.hold(region, base[invocation], held)
    if between is not None:
        builder.eager(between.gap(len(timeline.events)))
    movable: set[int] = set()
    earliest: dict[int, int] = {}
    latest: dict[int, int] = {}
    for invocation in planned:
        if invocation not in backward_at:
            continue
        region = regions[invocation.region]
        for storage in region.movable:
            sid = base[invocation] + storage
            movable.add(sid)
            earliest[sid] = backward_at[invocation]
            latest[sid] = forward_at[invocation] + region.num_fw_ops - 1
    retained = {
        base[i] + s for i in invocations for s in regions[i.region].trace.retained
        if i == last_forward or not _in_forward(regions[i.region], s)
    }
    first = regions[invocations[0].region].trace if invocations else None
    trace = ActivationTrace(
        tuple(builder.trace_ops()), builder.sizes_of(regions, base, invocations),
        budget_bytes=budget_bytes, retained=frozenset(retained),
        d2h_bandwidth_gbps=first.d2h_bandwidth_gbps if first else 16.0,
        h2d_bandwidth_gbps=first.h2d_bandwidth_gbps if first else 16.0,
    )
    return StepTrace(trace, frozenset(movable), earliest, latest, forward_at, backward_at,
                     base, frozenset(planned))


def kept_across(region: RegionTrace, schedule: ResidencySchedule) -> int:
    """Bytes of ``region``'s movable storages that ``schedule`` keeps on the device from
    its forward to its backward (no copy): what its autograd graph holds beyond the
    floor's, between the two (:attr:`~.step_model.StepTimeline.retained_bytes` counts
    the floor's)."""
    copied = {a.storage for _, _, a in schedule.actions() if a.kind is ActionKind.COPY_D2H}
    num_fw = region.num_fw_ops
    total = 0
    for storage in region.movable - copied:
        ops = [op for op, _ in region.trace.accesses_of(storage)]
        if ops and ops[0] < num_fw <= ops[-1]:
            total += region.trace.storage_sizes[storage]
    return total


def _in_forward(region: RegionTrace, storage: int) -> bool:
    accesses = region.trace.accesses_of(storage)
    return bool(accesses) and accesses[0][0] < region.num_fw_ops


class _StepBuilder:
    """Ops of the step trace as they are laid out (accesses per op, by step storage)."""

    def __init__(self, first_free: int) -> None:
        self.ops: list[tuple[str, dict[int, AccessKind], float | None]] = []
        self.next_id = first_free
        self.split_sizes: dict[int, int] = {}
        self._reloaded_as: dict[tuple[int, int], int] = {}

    def add_ops(self, region: RegionTrace, span: range, base: int, fixed: bool) -> None:
        """``span`` of ``region``'s ops; with ``fixed``, each storage its floor moves is
        split at the floor's release and reload (module docstring)."""
        moves = _floor_moves(region) if fixed else {}
        for index in span:
            op = region.trace.ops[index]
            accesses = {}
            for access in op.accesses:
                move = moves.get(access.storage)
                sid = (self._reloaded(base, access.storage, region)
                       if move is not None and index >= move[1] else base + access.storage)
                accesses[sid] = access.kind
            for storage, (release, reload) in moves.items():
                if index == release:
                    accesses.setdefault(base + storage, AccessKind.READ)
                elif index == reload:
                    sid = self._reloaded(base, storage, region)
                    accesses.setdefault(sid, AccessKind.READ)
            self.ops.append((op.name, accesses, op.duration_s))

    def eager(self, nbytes: int, since: int | None = None) -> None:
        """The eager code's bytes between regions (:class:`~.step_model.BetweenRegions`),
        a storage no plan moves: held from op ``since`` to the last op laid out so far, or
        (``since`` None) one op of its own (a gap's eager code)."""
        if not nbytes or (since is not None and since >= len(self.ops)):
            return
        sid = self.next_id
        self.next_id += 1
        self.split_sizes[sid] = nbytes
        if since is None:
            self.ops.append(("eager", {sid: AccessKind.WRITE}, 0.0))
            return
        for at, kind in ((since, AccessKind.WRITE), (len(self.ops) - 1, AccessKind.READ)):
            name, accesses, duration = self.ops[at]
            accesses.setdefault(sid, kind)
            self.ops[at] = (name, accesses, duration)

    def _reloaded(self, base: int, storage: int, region: RegionTrace) -> int:
        key = (base, storage)
        if key not in self._reloaded_as:
            self._reloaded_as[key] = self.next_id
            self.split_sizes[self.next_id] = region.trace.storage_sizes[storage]
            self.next_id += 1
        return self._reloaded_as[key]

    def hold(self, region: RegionTrace, base: int, storages: frozenset[int] | set[int]) -> None:
        """Read ``storages`` (those the forward touched) at the forward's last op."""
        if not self.ops:
            return
        name, accesses, duration = self.ops[-1]
        for storage in storages:
            if _in_forward(region, storage) or storage in region.held:
                accesses.setdefault(base + storage, AccessKind.READ)
        self.ops[-1] = (name, accesses, duration)

    def trace_ops(self) -> list[TraceOp]:
        return [
            TraceOp(name, tuple(StorageAccess(s, k) for s, k in accesses.items()),
                    duration_s=duration)
            for name, accesses, duration in self.ops
        ]

    def sizes_of(self, regions: Mapping[int, RegionTrace], base: Mapping[Invocation, int],
                 invocations: tuple[Invocation, ...]) -> dict[int, int]:
        sizes = dict(self.split_sizes)
        for invocation in invocations:
            for storage, size in regions[invocation.region].trace.storage_sizes.items():
                sizes[base[invocation] + storage] = size
        return sizes


def _floor_moves(region: RegionTrace) -> dict[int, tuple[int, int]]:
    """``{storage: (release op, reload op)}`` of the storages ``region``'s floor moves."""
    released: dict[int, int] = {}
    moves: dict[int, tuple[int, int]] = {}
    for op, _where, action in region.floor.actions():
        if action.kind is ActionKind.RELEASE_DEVICE and op < region.num_fw_ops:
            released[action.storage] = op
        elif action.kind is ActionKind.COPY_H2D and action.storage in released:
            moves.setdefault(action.storage, (released[action.storage], op))
    return moves


def cut_schedule(
    step: StepTrace,
    schedule: ResidencySchedule,
    invocation: Invocation,
    region: RegionTrace,
    budget_bytes: int,
) -> tuple[ResidencySchedule, ScheduleReport] | None:
    """``invocation``'s part of the step's ``schedule`` as a schedule of its region's
    trace (module docstring) and ``check_schedule``'s report of it there under
    ``budget_bytes``; None when the check rejects it (or an action on its storages lies
    outside its ops)."""
    lo = step.base[invocation]
    hi = lo + region.storage_count
    fw, bw, num_fw = step.forward_at[invocation], step.backward_at[invocation], region.num_fw_ops
    reloaded = {a.storage for _, _, a in schedule.actions() if a.kind is ActionKind.COPY_H2D}
    kept = region.trace.retained

    def local(actions: tuple[ResidencyAction, ...]) -> tuple[ResidencyAction, ...]:
        return tuple(
            ResidencyAction(a.kind, a.storage - lo) for a in actions
            if lo <= a.storage < hi and not (
                a.kind is ActionKind.RELEASE_DEVICE and a.storage - lo in kept
                and a.storage not in reloaded
            )
        )

    ops = [*range(fw, fw + num_fw), *range(bw, bw + region.trace.num_ops - num_fw)]
    inside = set(ops)
    for op, _where, action in schedule.actions():
        if lo <= action.storage < hi and op not in inside:
            return None
    cut = ResidencySchedule(
        tuple(local(schedule.pre[op]) for op in ops), tuple(local(schedule.post[op]) for op in ops)
    )
    report = check_schedule(region.trace.with_budget(budget_bytes), cut)
    if report.violations:
        return None
    return cut, report
