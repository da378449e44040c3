"""One budget for the whole step: which invocations keep which slots on the device.

Under ``budget_scope="step"`` (the default) every region is lowered at its *floor*
(:class:`~hyper_offload.passes.plan.floor.FloorPlanner`: each movable saved activation
gets a ``copy_d2h`` whose ``slot`` is its storage id), so the first step fits before
anything is known about what else shares the device. Once
:class:`~.step_model.StepRecorder` has seen a step, :func:`plan_step` decides, per
invocation, which slots stay on the device (``TransferRuntime.keeping``): the compiled
graphs are not lowered again, the runtime makes a device copy where the floor would
have made a host copy.

The step's device bytes on one timeline: the invocations' forward and backward ops laid
end to end in the order the step ran them, and where it was measured (``hyper_offload.
estimate``'s fake steps: :class:`~.step_model.BetweenRegions`) one position per gap of
eager code between regions (an LM head and loss outside the compiled blocks). At each
position::

    bytes(t) = floor profile of the region op running at t        (its own schedule)
               or the eager code's peak in the gap at t
             + eager bytes held while the region op at t runs
             + retained bytes of every other invocation between its forward and backward
             + nbytes of every kept slot whose range covers t

A real step does not measure its eager code (that would take a dispatch mode around the
user's step): its plan counts what regions hold, and its report says so.

A slot of invocation ``i`` kept costs its bytes from just after its ``copy_d2h`` (the
device copy exists from there; the source is freed where the floor frees it) until the
op where the floor's reload would land, in ``i``'s backward. Keeping is chosen greedily,
shortest range first (a slot whose reload follows its copy soonest is the hardest to
hide and holds its bytes over the fewest positions), larger slots first on ties, while
the range's maximum plus the slot stays within the budget: each decision is one range
query and one range add on a :class:`~hyper_offload.passes.plan.segment_tree.
RangeAddMaxTree`. Everything not kept moves, exactly as the floor schedule moves it.

Invariant: at every position the plan's bytes are at most ``max(budget, floor peak)``:
within the budget wherever the floor's peak is, and below the floor (its peak over the
budget: a region's working memory is more than the budget, which only recompute could
help, and the report says so) no higher than the floor's peak, which no plan can go
under: slots that do not raise the peak stay (issue 43: moving everything movable there
only cost time). So ``peak_bytes <= budget_bytes`` whenever ``floor_peak_bytes <=
budget_bytes``, and ``peak_bytes == floor_peak_bytes`` otherwise. Pure: no torch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from hyper_offload.passes.analysis.liveness import resident_bytes_without_offload
from hyper_offload.passes.ir.host import host_bucket_bytes
from hyper_offload.passes.ir.schedule import ActionKind, ResidencySchedule
from hyper_offload.passes.ir.trace import ActivationTrace
from hyper_offload.passes.plan.segment_tree import RangeAddMaxTree

from .step_model import Invocation, StepEventKind, StepTimeline

__all__ = [
    "FloorOp", "RegionProfile", "SlotRange", "StepPlan", "held_inputs", "plan_step", "region_profile",
]


class SlotRange(NamedTuple):
    """Keeping slot ``slot`` costs ``nbytes`` over the region's ops ``start .. end - 1``
    (op indices over forward then backward; ``start`` at most the forward's length, ``end``
    in the backward) and over everything the step runs between the two graphs."""

    slot: int
    nbytes: int
    start: int
    end: int


@dataclass(frozen=True)
class RegionProfile:
    """A region's floor schedule, as the step plan needs it: device bytes during each op
    (``resident[i]``, forward ops first) and the range each slot would hold if kept."""

    region: int
    num_fw_ops: int
    resident: tuple[int, ...]
    slots: tuple[SlotRange, ...]
    unplanned: tuple[int, ...] = ()
    """Device bytes during each op with nothing moved (empty: ``resident``)."""
    op_names: tuple[str, ...] = ()
    """Each op's name (``"fw:mm"``), for the report of what sets the floor."""
    op_bytes: tuple[int, ...] = ()
    """Each op's own operands (bytes no plan moves while it runs)."""

    @property
    def num_bw_ops(self) -> int:
        return len(self.resident) - self.num_fw_ops


def held_inputs(
    node_storage: Mapping[str, int], activation_inputs: Iterable[str]
) -> frozenset[int]:
    """The storages of a region's activation inputs (``FxTrace.node_storage`` and
    ``activation_inputs``): what its caller holds through the whole forward."""
    return frozenset(
        node_storage[key] for key in (f"fw:{name}" for name in activation_inputs)
        if key in node_storage
    )


def region_profile(
    region: int,
    num_fw_ops: int,
    resident: tuple[int, ...],
    schedule: ResidencySchedule,
    trace: ActivationTrace,
    held: frozenset[int] = frozenset(),
) -> RegionProfile:
    """The profile of a region lowered with ``schedule`` (its floor) on ``trace``: a slot
    per storage copied to the host in the forward and reloaded in the backward.

    ``resident`` is ``check_schedule``'s, where a model output stays "retained" to the end
    of the region's backward. In a step it is the caller's from the end of the forward
    (the next block's input, dropped once that block ran; what it holds is measured as
    that block's input): so the bytes of an output the backward never reads are not
    counted over the backward's ops here.

    ``held``: storages of activation inputs (:func:`held_inputs`). The caller holds a
    block's input through the whole forward (``x = block(x)`` drops it once the block
    returned), and the model outputs from where they are made (they are returned), so the
    device bytes the floor returns at their copy come back only at the forward's end (an
    output's, at the end of the next region's forward, which counts it as its input):
    each is counted over those forward ops, whatever the schedule says (a kept one's
    device copy is its slot's, as any other).

    ``unplanned`` is the same curve with nothing moved (no schedule), counted the same
    way: what the step's peak without offload lays out (it depends on no link or plan)."""
    storage_sizes = trace.storage_sizes
    d2h: dict[int, int] = {}
    h2d: dict[int, int] = {}
    for op, _, action in schedule.actions():
        if action.kind is ActionKind.COPY_D2H and op < num_fw_ops:
            d2h.setdefault(action.storage, op)
        elif action.kind is ActionKind.COPY_H2D and op >= num_fw_ops:
            h2d.setdefault(action.storage, op)
    # A slot copied after the forward's last op and reloaded before the backward's first
    # holds nothing inside the region (start == end) but everything run between.
    slots = tuple(
        SlotRange(sid, storage_sizes[sid], d2h[sid] + 1, h2d[sid])
        for sid in sorted(d2h) if sid in h2d
    )
    nothing = ResidencySchedule(((),) * trace.num_ops, ((),) * trace.num_ops)
    unplanned = _as_in_step(
        tuple(resident_bytes_without_offload(trace)), nothing, trace, held, num_fw_ops
    )
    return RegionProfile(
        region, num_fw_ops, _as_in_step(resident, schedule, trace, held, num_fw_ops), slots,
        unplanned=unplanned, op_names=tuple(op.name for op in trace.ops),
        op_bytes=tuple(trace.operand_bytes(i) for i in range(trace.num_ops)),
    )


def _as_in_step(
    resident: tuple[int, ...], schedule: ResidencySchedule, trace: ActivationTrace,
    held: frozenset[int], num_fw_ops: int,
) -> tuple[int, ...]:
    """``resident`` (``schedule``'s curve on ``trace``) as the step counts it
    (:func:`region_profile`: held inputs and outputs over the forward, outputs not over
    the backward)."""
    storage_sizes = trace.storage_sizes
    outputs_bytes = sum(
        storage_sizes[sid] for sid in trace.retained
        if all(op < num_fw_ops for op, _ in trace.accesses_of(sid))
    )
    held = held | trace.retained
    counted = _counted_ops(schedule, trace, held, num_fw_ops)
    return tuple(
        max(value - outputs_bytes, 0) if op >= num_fw_ops
        else value + sum(storage_sizes[sid] for sid in held if op not in counted[sid])
        for op, value in enumerate(resident)
    )


def _counted_ops(
    schedule: ResidencySchedule, trace: ActivationTrace, held: frozenset[int], num_fw_ops: int
) -> dict[int, range]:
    """Forward ops at which the floor's own ``resident`` already counts each held
    storage: from its first access to where the floor releases it in the forward (a
    copy's release), or past its last forward access when the backward never reads it."""
    released = {
        action.storage: op + (when == "post")
        for op, when, action in schedule.actions()
        if action.kind is ActionKind.RELEASE_DEVICE and op < num_fw_ops and action.storage in held
    }
    counted = {}
    for sid in held:
        ops = [op for op, _ in trace.accesses_of(sid)]
        forward = [op for op in ops if op < num_fw_ops] or [num_fw_ops]
        # Unreleased, a storage the backward reads or a model output ("retained") is
        # counted to the forward's end; any other, past its last forward access.
        to_end = sid in trace.retained or max(ops, default=0) >= num_fw_ops
        end = released.get(sid, num_fw_ops if to_end else max(forward) + 1)
        counted[sid] = range(min(forward), end)
    return counted


class InvocationPlan(NamedTuple):
    """What one invocation keeps, moves and retains (bytes)."""

    invocation: Invocation
    keep: frozenset[int]
    kept_bytes: int
    moved_bytes: int
    retained_bytes: int


@dataclass(frozen=True)
class StepPlan:
    """:func:`plan_step`'s answer for one step timeline (see the module docstring)."""

    timeline: StepTimeline
    budget_bytes: int
    peak_without_offload_bytes: int
    floor_peak_bytes: int
    peak_bytes: int
    invocations: tuple[InvocationPlan, ...]
    over_budget: frozenset[tuple[int, int]] = frozenset()
    """``(region, op)`` pairs where the floor alone is over the budget (in some
    invocation): where only recompute, or a larger budget, could help (positions of eager
    code between regions are not listed: no region's partition changes them)."""
    schedules: Mapping[int, ResidencySchedule] = field(default_factory=dict)
    """Regions this plan lowers with a schedule made for the step (:mod:`.step_planner`),
    their schedule; every other region runs its floor lowering. ``keep_for`` names slots
    of the lowering in force."""
    schedule_budget_bytes: int = 0
    """The budget ``check_schedule`` accepted each of ``schedules`` under, on its region's
    trace (the step's budget, or the step's floor peak where that is higher)."""
    predicted_stall_s: float = 0.0
    """The timeline model's stall of this plan (:func:`.step_timeline.predicted_step_stall`),
    where :mod:`.step_planner` priced it (0 from :func:`plan_step` alone)."""
    floor_op: FloorOp | None = None
    """The op at which ``floor_peak_bytes`` is reached (what sets the floor)."""
    regions_floor_bytes: int | None = None
    """Where the timeline measured its eager code between regions: the floor without it
    (what the regions alone need; None otherwise)."""
    host_budget_bytes: int | None = None
    """The host budget the plan keeps (bucketed bytes; None: none)."""
    peak_host_bytes: int = 0
    """The most host bytes (pool buckets) the moved slots hold at once on the step."""
    kept_for_host: int = 0
    """Slots kept on the device only because the host budget had no room for them."""

    @property
    def binding(self) -> str:
        """Which budget limits the step: ``"device"`` (the floor alone is over the device
        budget: only recompute or a larger budget helps; or the device budget made it
        move bytes and the host had room), ``"host"`` (the host budget kept slots on the
        device past the device budget: more host memory, or recompute, helps),
        ``"both"`` (both at once), ``"none"`` (nothing had to move)."""
        host = self.kept_for_host > 0 and self.peak_bytes > max(self.budget_bytes,
                                                               self.floor_peak_bytes)
        device = self.floor_peak_bytes > self.budget_bytes
        if host:
            return "both" if device else "host"
        return "device" if device or self.moved_bytes else "none"

    def keep_for(self, invocation: Invocation) -> frozenset[int]:
        """The slots ``invocation`` keeps; none (the floor) for one the plan never saw."""
        return self._keep.get(invocation, frozenset())

    @functools.cached_property
    def _keep(self) -> dict[Invocation, frozenset[int]]:
        # Built once: keep_for runs at every forward of every invocation.
        return {p.invocation: p.keep for p in self.invocations}

    @property
    def fits(self) -> bool:
        """Whether the predicted peak is within the budget (never when the floor is not)."""
        return self.peak_bytes <= self.budget_bytes

    @property
    def moved_bytes(self) -> int:
        """Bytes copied to the host per step (each comes back once)."""
        return sum(p.moved_bytes for p in self.invocations)

    @property
    def kept_bytes(self) -> int:
        return sum(p.kept_bytes for p in self.invocations)

    def __repr__(self) -> str:
        return (
            f"StepPlan({len(self.invocations)} invocations, budget={self.budget_bytes}, "
            f"floor_peak={self.floor_peak_bytes}, peak={self.peak_bytes}, "
            f"moved={self.moved_bytes}, kept={self.kept_bytes})"
        )


class FloorOp(NamedTuple):
    """The op at which the step's floor (everything movable moved) peaks: where it runs
    (``region`` index, or None for eager code between regions), its name, its own
    operands' bytes (what no plan moves while it runs) and the floor's bytes there;
    ``operands``: those operands by name and bytes, largest first, where known (a region
    op: :meth:`~hyper_offload.passes.fx.graph_trace.FxTrace.operands`)."""

    region: int | None
    op: str
    op_bytes: int
    floor_bytes: int
    operands: tuple[tuple[str, int], ...] = ()

    def describe(self) -> str:
        where = ("eager code between compiled regions" if self.region is None
                 else f"region {self.region}")
        text = (f"{self.op} ({where}): its own inputs and outputs {_size(self.op_bytes)} of "
                f"the floor's {_size(self.floor_bytes)}")
        if self.operands:
            shown = ", ".join(f"{name} {_size(nbytes)}" for name, nbytes in self.operands[:6])
            more = len(self.operands) - 6
            text += f" ({shown}{f', {more} more' if more > 0 else ''})"
        return text


def _size(nbytes: int) -> str:
    """MiB with one decimal from 1 MiB on (``192,384.5 MiB``), KiB or bytes below: a
    tiny model's floor reads ``160.0 KiB``, not ``0.2 MiB``."""
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):,.1f} MiB"
    return f"{nbytes / 1024:,.1f} KiB" if nbytes >= 1024 else f"{nbytes} B"


class _Layout(NamedTuple):
    """Where each invocation's forward and backward ops start on the step timeline, which
    region op runs at each position (``(-1, k)``: the eager code of gap ``k``, measured:
    :class:`~.step_model.BetweenRegions`), and the bytes there at the floor and with
    nothing moved."""

    values: list[int]
    forward_at: dict[Invocation, int]
    backward_at: dict[Invocation, int]
    ops: list[tuple[int, int]]
    plain: list[int]


def _lay_out(timeline: StepTimeline, profiles: Mapping[int, RegionProfile]) -> _Layout:
    values: list[int] = []
    plain: list[int] = []
    forward_at: dict[Invocation, int] = {}
    backward_at: dict[Invocation, int] = {}
    ops: list[tuple[int, int]] = []
    between = timeline.between

    def gap(k: int) -> None:
        if between is not None and between.gap(k):
            values.append(between.gap(k))
            plain.append(between.gap(k))
            ops.append((-1, k))

    for k, (kind, invocation) in enumerate(timeline.events):
        gap(k)
        profile = profiles[invocation.region]
        span = (range(profile.num_fw_ops) if kind is StepEventKind.FORWARD
                else range(profile.num_fw_ops, len(profile.resident)))
        (forward_at if kind is StepEventKind.FORWARD else backward_at)[invocation] = len(values)
        eager = between.during(k) if between is not None else 0
        unplanned = profile.unplanned or _with_slots(profile)
        values.extend(profile.resident[op] + eager for op in span)
        plain.extend(unplanned[op] + eager for op in span)
        ops.extend((invocation.region, op) for op in span)
    gap(len(timeline.events))
    return _Layout(values, forward_at, backward_at, ops, plain)


def _with_slots(profile: RegionProfile) -> tuple[int, ...]:
    """A profile's curve with every slot kept over its range (a hand-built profile that
    gives no ``unplanned`` curve: its slots are the only bytes a plan moves)."""
    values = list(profile.resident)
    for slot in profile.slots:
        for op in range(slot.start, min(slot.end, len(values))):
            values[op] += slot.nbytes
    return tuple(values)


def _floor_op(
    layout: _Layout, floor: list[int], timeline: StepTimeline,
    profiles: Mapping[int, RegionProfile],
) -> FloorOp | None:
    """The op at the floor's peak (the first such position)."""
    if not layout.ops:
        return None
    at = max(range(len(layout.ops)), key=lambda i: (floor[i], -i))
    region, op = layout.ops[at]
    if region < 0:
        between = timeline.between
        assert between is not None
        return FloorOp(None, between.gap_ops[op], between.gap_op_bytes[op], floor[at])
    profile = profiles[region]
    name = profile.op_names[op] if op < len(profile.op_names) else f"op {op}"
    own = profile.op_bytes[op] if op < len(profile.op_bytes) else 0
    return FloorOp(region, name, own, floor[at])


def plan_step(
    timeline: StepTimeline,
    profiles: Mapping[int, RegionProfile],
    budget_bytes: int | None,
    *,
    budget_fraction: float | None = None,
    shared: bool = False,
    keep: bool = True,
    host_budget_bytes: int | None = None,
) -> StepPlan:
    """Choose the kept slots of every invocation of ``timeline`` under one budget.

    ``profiles`` maps each region of the timeline to the profile of its lowering (its
    floor, or the schedule :mod:`.step_planner` made for it). The budget is
    ``budget_bytes``, or ``budget_fraction`` of the step's peak without offload.
    ``shared``: decide per region and slot for all its invocations at once, as a graph
    that cannot tell its invocations apart would have to (the alternative the backend
    does not take: ``benchmarks/step_budget.py`` measures what it costs). ``keep=False``
    keeps only the slots that cost nothing (nothing runs while they would be away).
    ``host_budget_bytes``: the moved slots never hold more host bytes (pool buckets) at
    once; where the device's choice would, more slots stay on the device, past its budget
    if need be (:func:`_keep_for_host`; ``StepPlan.binding`` says so)."""
    layout = _lay_out(timeline, profiles)
    floor = _floor(layout, timeline, profiles)
    regions_only = dataclasses.replace(timeline, between=None)
    ranges = [
        _SlotOnStep(invocation, slot, layout.forward_at[invocation] + slot.start,
                    backward + slot.end - profiles[invocation.region].num_fw_ops)
        for invocation, backward in layout.backward_at.items()
        for slot in profiles[invocation.region].slots
    ]
    peak_without = _peak_without_offload(layout, timeline, profiles)
    if budget_bytes is None:
        budget_bytes = int((budget_fraction or 1.0) * peak_without)
    groups = (
        [[r for r in ranges if (r.invocation.region, r.slot.slot) == key]
         for key in dict.fromkeys((r.invocation.region, r.slot.slot) for r in ranges)]
        if shared else [[r] for r in ranges]
    )
    every_group = groups  # what is not kept moves, and holds host memory
    if not keep:
        groups = [g for g in groups if all(r.lo >= r.hi for r in g)]
    # Below the floor (its peak over the budget) the floor's peak is the least any plan
    # reaches: keep what stays under it.
    kept, peak = _keep_greedily(groups, floor, max(budget_bytes, max(floor, default=0)))
    host_peak = forced = 0
    if host_budget_bytes is not None:
        kept, peak, host_peak, forced = _keep_for_host(every_group, kept, floor,
                                                       host_budget_bytes)
    keep: dict[Invocation, set[int]] = {i: set() for i in timeline.invocations}
    for r in kept:
        keep[r.invocation].add(r.slot.slot)
    plans = []
    for invocation in timeline.invocations:
        slots = profiles[invocation.region].slots
        kept_bytes = sum(s.nbytes for s in slots if s.slot in keep[invocation])
        plans.append(InvocationPlan(
            invocation, frozenset(keep[invocation]), kept_bytes,
            sum(s.nbytes for s in slots) - kept_bytes,
            timeline.retained_bytes.get(invocation, 0),
        ))
    # Eager code between regions is over the budget on its own: no region's plan helps.
    over = frozenset(op for op, value in zip(layout.ops, floor)
                     if value > budget_bytes and op[0] >= 0)
    if forced and peak > budget_bytes:  # where the host budget kept the step over it
        device = _device_bytes(floor, kept).values()
        over |= frozenset(op for op, value in zip(layout.ops, device)
                          if value > budget_bytes and op[0] >= 0)
    return StepPlan(
        timeline, budget_bytes, peak_without, max(floor, default=0), peak, tuple(plans), over,
        floor_op=_floor_op(layout, floor, timeline, profiles),
        regions_floor_bytes=None if timeline.between is None else max(_floor(
            _lay_out(regions_only, profiles), regions_only, profiles), default=0),
        host_budget_bytes=host_budget_bytes, peak_host_bytes=host_peak, kept_for_host=forced,
    )


def _peak_without_offload(
    layout: _Layout, timeline: StepTimeline, profiles: Mapping[int, RegionProfile]
) -> int:
    """The step's peak with nothing moved: each region's curve without a schedule, and
    between an invocation's forward and backward what it retains and every slot it would
    move (no link or plan in it: a floor placed for another link gives the same)."""
    tree = RangeAddMaxTree(layout.plain or [0])
    for invocation, backward in layout.backward_at.items():
        profile = profiles[invocation.region]
        lo = layout.forward_at[invocation] + profile.num_fw_ops
        held = timeline.retained_bytes.get(invocation, 0) + sum(s.nbytes for s in profile.slots)
        if lo < backward and held:
            tree.add(lo, backward, held)
    return tree.max_all()


class _SlotOnStep(NamedTuple):
    """A slot of one invocation and the positions ``lo .. hi - 1`` keeping it costs."""

    invocation: Invocation
    slot: SlotRange
    lo: int
    hi: int


def _floor(
    layout: _Layout, timeline: StepTimeline, profiles: Mapping[int, RegionProfile]
) -> list[int]:
    """Bytes at each position with every slot moved: the regions' floors plus what each
    invocation retains between its forward and its backward."""
    tree = RangeAddMaxTree(layout.values or [0])
    for invocation, backward in layout.backward_at.items():
        lo = layout.forward_at[invocation] + profiles[invocation.region].num_fw_ops
        held = timeline.retained_bytes.get(invocation, 0)
        if lo < backward and held:
            tree.add(lo, backward, held)
    return tree.values()[: max(len(layout.values), 1)]


def _keep_greedily(
    groups: list[list[_SlotOnStep]], floor: list[int], budget_bytes: int
) -> tuple[list[_SlotOnStep], int]:
    """Keep whole groups, those holding the fewest positions first (larger first on
    ties), while every position stays within ``budget_bytes`` (or the floor where the
    floor alone is over it); the kept slots and the resulting peak."""
    room = RangeAddMaxTree([min(value - budget_bytes, 0) for value in floor])
    bytes_now = RangeAddMaxTree(floor)
    kept: list[_SlotOnStep] = []

    def span(group: list[_SlotOnStep]) -> tuple[int, int]:
        return (sum(max(r.hi - r.lo, 0) for r in group), -sum(r.slot.nbytes for r in group))

    for group in sorted(groups, key=span):
        added: list[_SlotOnStep] = []
        for r in group:
            if r.lo >= r.hi:  # nothing runs while it would be away: keeping it is free
                continue
            if room.max(r.lo, r.hi) + r.slot.nbytes > 0:
                break
            room.add(r.lo, r.hi, r.slot.nbytes)
            added.append(r)
        else:
            for r in added:
                bytes_now.add(r.lo, r.hi, r.slot.nbytes)
            kept += group
            continue
        for r in added:  # the group does not fit whole: undo its part
            room.add(r.lo, r.hi, -r.slot.nbytes)
    return kept, bytes_now.max_all()


def _host_span(r: _SlotOnStep, positions: int) -> tuple[int, int]:
    """Positions (half-open) a moved slot holds its host buffer: from its ``copy_d2h``
    (the position before ``lo``) through its reload (``hi``), one more each side than
    the device saves, so the count is never below what the pool holds."""
    return max(r.lo - 1, 0), min(r.hi + 1, positions)


def _device_bytes(floor: list[int], kept: list[_SlotOnStep]) -> RangeAddMaxTree:
    tree = RangeAddMaxTree(floor or [0])
    for r in kept:
        if r.lo < r.hi:
            tree.add(r.lo, r.hi, r.slot.nbytes)
    return tree


def _keep_for_host(
    groups: list[list[_SlotOnStep]], kept: list[_SlotOnStep], floor: list[int],
    host_budget_bytes: int,
) -> tuple[list[_SlotOnStep], int, int, int]:
    """``kept`` plus the groups the host budget cannot take: while the moved slots hold
    more host bytes than the budget at some position, the group covering it that holds
    the device over the fewest positions is kept too. Returns the kept slots, the device
    peak, the host peak and how many slots were kept for the host."""
    positions = max(len(floor), 1)
    chosen = {id(r) for r in kept}
    moved = [g for g in groups if not any(id(r) in chosen for r in g)]
    host = RangeAddMaxTree([0] * positions)
    for group in moved:
        for r in group:
            host.add(*_host_span(r, positions), host_bucket_bytes(r.slot.nbytes))
    moved.sort(key=lambda g: sum(max(r.hi - r.lo, 0) for r in g))
    forced = 0
    while moved and host.max_all() > host_budget_bytes:
        at = host.argmax_all()
        index = next((i for i, g in enumerate(moved)
                      if any(_host_span(r, positions)[0] <= at < _host_span(r, positions)[1]
                             for r in g)), None)
        if index is None:
            break  # nothing moved holds that position (cannot happen: the tree is theirs)
        group = moved.pop(index)
        for r in group:
            host.add(*_host_span(r, positions), -host_bucket_bytes(r.slot.nbytes))
        kept = kept + group
        forced += len(group)
    peak = _device_bytes(floor, kept).max_all()
    return kept, peak, max(host.max_all(), 0), forced
