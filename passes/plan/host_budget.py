"""Host memory of a plan: the host budget and the disk tier below it.

The host budget: how many bytes a plan keeps alive in host buffers at once.

Offloaded bytes live somewhere: each write epoch with an offloaded gap holds one host
buffer from its ``COPY_D2H`` (``post[d2h_op]``) until its ``RELEASE_HOST`` (``post`` of
its last reload, :mod:`.report`). The buffer is a pool bucket
(:func:`~..ir.schedule.host_bucket_bytes`), not the storage's raw size. Local ranks share one
machine's memory, so a rank's share of it (``OffloadConfig.max_host_activation_mb``) is a
budget like the device's, and a planner must never exceed it: a node that runs out of
host memory dies, where one that keeps a few more bytes on the device (or recomputes
them) only runs slower.

Two pieces, both pure:

* :func:`host_curve`: the independent measure. It simulates ``COPY_D2H`` /
  ``RELEASE_HOST`` of any schedule and returns the bucketed host bytes held at every op
  (and inside every slot): what a plan asks of the host pool.
* :class:`HostLedger`: the planners' bookkeeping. Candidates are offered in the
  planner's order; one is accepted only if its epoch's host interval (extended to its
  reload) stays within the budget at every op it covers. Intervals are counted over ops
  ``d2h_op .. end`` inclusive, one op more than the buffer really lives (it is acquired
  in ``post[d2h_op]``), so the ledger never under-counts :func:`host_curve`.

Invariant (tested with hypothesis): a choice filtered by :func:`fit_host_budget` lowers
to a schedule whose :func:`host_curve` never exceeds the budget.

The disk tier: host copies that stay longest on the host go to files instead.

When the host budget binds (``OffloadConfig.max_host_activation_mb``: the planner left
bytes on the device because the host had no room for them), a disk tier below host
memory (``max_disk_activation_mb``, a directory) can hold what waits longest. This pass
takes a schedule and moves the longest host residencies to disk until the host curve
(:func:`~.host_budget.host_curve`) is within the host budget. For one host copy of
storage ``s``::

    before:  post[d]: COPY_D2H s            pre[h]: COPY_H2D s  ...  post[r]: RELEASE_HOST s
    after:   post[d]: COPY_D2H s, SPILL_TO_DISK s
             pre[l]:  LOAD_FROM_DISK s, RELEASE_DISK s
                                            pre[h]: COPY_H2D s  ...  post[r]: RELEASE_HOST s

The spill follows its D2H in the same slot (the runtime writes once the D2H is done, then
gives the host buffer back). The load goes as late as the timeline model says its read
still ends before the first ``COPY_H2D`` of the copy (which waits for it: the rule of
:mod:`..ir.schedule`), never before ``earliest_load_op`` (the compile door's first backward
op) and never where the host has no room for it again; its file is released right after
it (the runtime removes it once the read completed). Between ``d`` and ``l`` the host holds
nothing of ``s``: that is the room the pass makes.

Choice: host copies are taken longest stretch first (the time from the D2H to the first
reload, then size), each only if it frees a slot where the host is over its budget and its
file fits the disk budget (``trace.disk_budget_bytes``, raw bytes, files counted from the
spill's slot to the load's, both included); the walk stops once no slot is over. A load
goes where its read would end in time, or later where the host is over its budget
between there and the reload (the device bytes come first: a stall costs time, bytes
over the device budget cost the step). Then, on the timeline model, a load that still
stalls its reload starts earlier by that stall, where the host has room (a few rounds).

Accounting is by *slot* (``pre[i]`` is slot ``2i``, ``post[i]`` slot ``2i + 1``): a buffer
counts in the slot that acquires it and the one that gives it back, so the ledger never
under-counts :func:`~.host_budget.host_curve`. Pure: no torch, no device.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import NamedTuple

from hyper_offload.errors import ConfigurationError

from ..analysis.liveness import OffloadCandidate
from ..analysis.predicted_timeline import op_start_times, predict_timeline
from ..ir.schedule import (
    ActionKind, DISK_ACTIONS, OpLimit, ResidencyAction, ResidencySchedule, host_bucket_bytes,
    op_limit,
)
from ..ir.trace import ActivationTrace, StorageId
from .segment_tree import RangeAddMaxTree

__all__ = [
    "HostCopy",
    "HostCurve",
    "HostLedger",
    "Spill",
    "fit_host_budget",
    "host_copies",
    "host_curve",
    "spill_to_disk",
]


class HostCurve(NamedTuple):
    """Bucketed host bytes held during each op (after its ``pre`` actions); ``peak`` is
    the highest point anywhere, inside ``post`` slots included."""

    values: tuple[int, ...]
    peak: int


_ACQUIRE = (ActionKind.COPY_D2H, ActionKind.LOAD_FROM_DISK)
_GIVE_BACK = (ActionKind.RELEASE_HOST, ActionKind.SPILL_TO_DISK)


def host_curve(trace: ActivationTrace, schedule: ResidencySchedule) -> HostCurve:
    """Simulate the host side of ``schedule``: a ``COPY_D2H`` (or ``LOAD_FROM_DISK``) of
    a storage with no host buffer acquires one bucket, ``RELEASE_HOST`` (or
    ``SPILL_TO_DISK``) gives it back: a buffer counts only while it holds bytes (the rules
    of ``check_schedule``, which judges everything else). The runtime returns a spilled
    buffer once its write completes and waits for pending writes before it takes the pool
    past its cap (:mod:`hyper_offload.runtime.disk_store`), so this curve bounds the
    pool's high-water."""
    held: dict[StorageId, int] = {}
    total = peak = 0
    values = []

    def run(actions: Sequence) -> None:
        nonlocal total, peak
        for action in actions:
            if action.kind in _ACQUIRE and action.storage not in held:
                size = host_bucket_bytes(trace.storage_sizes.get(action.storage, 0))
                held[action.storage] = size
                total += size
                peak = max(peak, total)
            elif action.kind in _GIVE_BACK and action.storage in held:
                total -= held.pop(action.storage)

    for op in range(schedule.num_ops):
        run(schedule.pre[op])
        values.append(total)
        run(schedule.post[op])
    return HostCurve(tuple(values), peak)


class HostLedger:
    """Host bytes per op of the candidates accepted so far (module docstring).

    ``budget_bytes=None`` accepts everything (no host budget) and keeps no tree.
    """

    def __init__(self, num_ops: int, budget_bytes: int | None) -> None:
        if budget_bytes is not None and (
            isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0
        ):
            raise ConfigurationError(
                f"HostLedger: host budget must be None or an int of bytes >= 0, got "
                f"{budget_bytes!r}"
            )
        self.budget_bytes = budget_bytes
        self._tree = None if budget_bytes is None or num_ops == 0 else RangeAddMaxTree(
            [0] * num_ops)
        self._ends: dict[tuple[StorageId, int], int] = {}
        self.rejected = 0
        """How many candidates :meth:`take` refused for want of host room."""

    def _extension(self, cand: OffloadCandidate) -> tuple[int, int] | None:
        """The ops (half-open) ``cand`` adds to its epoch's host interval, if any."""
        end = self._ends.get(cand.epoch)
        if end is None:
            return cand.d2h_op, cand.end + 1
        return (end + 1, cand.end + 1) if cand.end > end else None

    def fits(self, cand: OffloadCandidate) -> bool:
        """Whether accepting ``cand`` keeps every op within the host budget."""
        if self._tree is None:
            return True
        extension = self._extension(cand)
        if extension is None:
            return True
        size = host_bucket_bytes(cand.size)
        return self._tree.max(*extension) + size <= self.budget_bytes

    def take(self, cand: OffloadCandidate) -> bool:
        """Accept ``cand`` if it fits (recording its host interval); False, and counted in
        :attr:`rejected`, if it does not."""
        if not self.fits(cand):
            self.rejected += 1
            return False
        extension = self._extension(cand)
        if extension is not None:
            if self._tree is not None:
                self._tree.add(*extension, host_bucket_bytes(cand.size))
            self._ends[cand.epoch] = cand.end
        return True


def fit_host_budget(
    num_ops: int, chosen: Sequence[OffloadCandidate], budget_bytes: int | None
) -> tuple[list[OffloadCandidate], int]:
    """``chosen`` without the candidates that would break the host budget, taken in the
    given order (the planner's priority): ``(kept, how many were dropped)``."""
    if budget_bytes is None:
        return list(chosen), 0
    ledger = HostLedger(num_ops, budget_bytes)
    kept = [cand for cand in chosen if ledger.take(cand)]
    return kept, ledger.rejected


_ROUNDS = 3
"""Rounds of moving stalled loads earlier on the timeline model."""


class HostCopy(NamedTuple):
    """One host buffer of a schedule: acquired by the ``COPY_D2H`` in slot ``acquire``,
    given back by the ``RELEASE_HOST`` in slot ``release``; ``first_h2d`` is the slot of
    its first reload (None: never reloaded). Slots as in the module docstring."""

    storage: StorageId
    size: int
    acquire: int
    first_h2d: int | None
    release: int

    def __repr__(self) -> str:
        return f"host(s{self.storage}: {self.acquire}->{self.first_h2d}->{self.release})"


class Spill(NamedTuple):
    """A host copy the pass sends to disk, read back in slot ``load`` (never before slot
    ``floor``)."""

    copy: HostCopy
    load: int
    floor: int


def host_copies(trace: ActivationTrace, schedule: ResidencySchedule) -> list[HostCopy]:
    """Every host buffer ``schedule`` holds, in acquisition order (analysis only).
    Raises ``ConfigurationError`` if the schedule already uses the disk tier."""
    open_: dict[StorageId, list[int | None]] = {}
    found: list[HostCopy] = []
    for op, slot, action in schedule.actions():
        position, sid, kind = 2 * op + (slot == "post"), action.storage, action.kind
        if kind in DISK_ACTIONS:
            raise ConfigurationError(
                f"spill_to_disk: {slot}[{op}] {action!r}: the schedule already uses the disk "
                "tier; pass the schedule made before it"
            )
        if kind is ActionKind.COPY_D2H and sid not in open_:
            open_[sid] = [position, None]
        elif kind is ActionKind.COPY_H2D and sid in open_ and open_[sid][1] is None:
            open_[sid][1] = position
        elif kind is ActionKind.RELEASE_HOST and sid in open_:
            acquire, first = open_.pop(sid)
            assert acquire is not None
            found.append(HostCopy(sid, trace.storage_sizes[sid], acquire, first, position))
    end = 2 * trace.num_ops - 1
    found += [HostCopy(s, trace.storage_sizes[s], a, f, end)  # type: ignore[arg-type]
              for s, (a, f) in open_.items()]
    return sorted(found, key=lambda c: (c.acquire, c.storage))


def spill_to_disk(
    trace: ActivationTrace,
    schedule: ResidencySchedule,
    *,
    host_budget_bytes: int,
    earliest_load_op: OpLimit = 0,
    default_op_duration_s: float | None = None,
    release_waits_for_d2h: bool = False,
) -> ResidencySchedule:
    """``schedule`` with host copies moved to the disk tier until it holds at most
    ``host_budget_bytes`` (pool buckets) in host buffers at once, or as close as the
    disk budget allows (module docstring).

    Contract, for a caller such as the compile door's step plan: ``schedule`` is one
    ``check_schedule(trace, schedule)`` accepts, without disk actions; ``trace`` carries
    the disk tier (``disk_budget_bytes``, ``disk_bandwidth_gbps``: ``trace.with_disk``).
    The result adds only ``SPILL_TO_DISK`` / ``LOAD_FROM_DISK`` / ``RELEASE_DISK``
    actions (the device actions, hence the device curve, are unchanged), is accepted by
    ``check_schedule`` (disk bytes never above ``trace.disk_budget_bytes``), never holds
    more host bytes at any op than ``schedule`` (``host_curve``), and is ``schedule``
    itself when nothing needs to move or the trace has no disk tier. Whether the host
    budget is met is the caller's to test: ``host_curve(trace, result).peak``; a slot
    where a copy's D2H and its spill both run still holds that copy for a moment.
    ``earliest_load_op`` (one op or one per storage, :mod:`..ir.schedule`): no load
    before it. ``default_op_duration_s`` and ``release_waits_for_d2h``: as for
    :func:`~..analysis.predicted_timeline.predict_timeline`, which prices the loads.
    """
    if isinstance(host_budget_bytes, bool) or not isinstance(host_budget_bytes, int) or (
        host_budget_bytes < 0
    ):
        raise ConfigurationError(
            f"spill_to_disk: host_budget_bytes must be an int >= 0, got {host_budget_bytes!r}"
        )
    copies = host_copies(trace, schedule)
    if trace.disk_budget_bytes <= 0 or not copies:
        return schedule
    host = _host_tree(trace, copies)
    if host.max_all() <= host_budget_bytes:
        return schedule
    times = _slot_times(trace, default_op_duration_s)
    spills = _choose(trace, copies, host, times, host_budget_bytes, earliest_load_op)
    if not spills:
        return schedule
    for _ in range(_ROUNDS):
        timeline = predict_timeline(trace, _rewrite(schedule, spills),
                                    default_op_duration_s=default_op_duration_s,
                                    release_waits_for_d2h=release_waits_for_d2h)
        stalls = {w.storage: w.end_s - w.start_s for w in timeline.waits
                  if w.kind is ActionKind.LOAD_FROM_DISK}
        moved = [_earlier(spill, stalls.get(spill.copy.storage, 0.0), host, times,
                          host_budget_bytes, trace.disk_bandwidth_gbps)
                 for spill in spills]
        if moved == spills:
            break
        spills = moved
    return _rewrite(schedule, spills)


def _slot_times(trace: ActivationTrace, default_op_duration_s: float | None) -> list[float]:
    """Stall-free time of every slot: ``pre[i]`` when op ``i`` starts, ``post[i]`` when
    it ends."""
    starts = op_start_times(trace, default_op_duration_s)
    return [starts[p // 2 + p % 2] for p in range(2 * trace.num_ops)]


def _host_tree(trace: ActivationTrace, copies: Sequence[HostCopy]) -> RangeAddMaxTree:
    """Bucketed host bytes per slot, each copy counted over its slots inclusively."""
    delta = [0] * (2 * trace.num_ops + 1)
    for copy in copies:
        size = host_bucket_bytes(copy.size)
        delta[copy.acquire] += size
        delta[copy.release + 1] -= size
    values, running = [], 0
    for step in delta[:-1]:
        running += step
        values.append(running)
    return RangeAddMaxTree(values)


def _latest_load(copy: HostCopy, lead_s: float, times: Sequence[float], floor: int) -> int:
    """The latest slot in ``[floor, first_h2d]`` at least ``lead_s`` before the reload's
    slot on the stall-free timeline (``floor`` if none is that early)."""
    assert copy.first_h2d is not None
    latest = bisect_right(times, times[copy.first_h2d] - lead_s, 0, copy.first_h2d + 1) - 1
    return max(floor, min(latest, copy.first_h2d))


def _covering_load(copy: HostCopy, load: int, host: RangeAddMaxTree, budget: int) -> int:
    """``load``, or a later slot where that leaves no slot between it and the reload over
    the host budget (the earliest such: a later load stalls its reload more, which the
    timeline rounds then shorten where the host has room; device bytes come first)."""
    first_h2d = copy.first_h2d
    assert first_h2d is not None
    low, high = load, first_h2d  # the answer lies in [low, high]; high always qualifies
    while low < high:
        middle = (low + high) // 2
        if host.max(middle, first_h2d) <= budget:
            high = middle
        else:
            low = middle + 1
    return low


def _choose(
    trace: ActivationTrace,
    copies: Sequence[HostCopy],
    host: RangeAddMaxTree,
    times: Sequence[float],
    budget: int,
    earliest_load_op: OpLimit,
) -> list[Spill]:
    """The spills, longest host stretch first (module docstring); updates ``host``."""
    disk = RangeAddMaxTree([0] * (2 * trace.num_ops))
    rate = trace.disk_bandwidth_gbps * 1e9
    order = sorted(
        (c for c in copies if c.first_h2d is not None),
        key=lambda c: (-(times[c.first_h2d] - times[c.acquire]), -c.size, c.storage),  # type: ignore[index]
    )
    spills: list[Spill] = []
    for copy in order:
        floor = max(copy.acquire + 1, 2 * op_limit(earliest_load_op, copy.storage, 0))
        if floor > copy.first_h2d:  # type: ignore[operator]
            continue
        load = _covering_load(copy, _latest_load(copy, copy.size / rate, times, floor),
                              host, budget)
        freed = (copy.acquire + 1, load)
        if freed[0] >= freed[1] or host.max(*freed) <= budget:
            continue  # frees nothing, or nothing over the budget
        if disk.max(copy.acquire, load + 1) + copy.size > trace.disk_budget_bytes:
            continue
        host.add(*freed, -host_bucket_bytes(copy.size))
        disk.add(copy.acquire, load + 1, copy.size)
        spills.append(Spill(copy, load, floor))
        if host.max_all() <= budget:
            break
    return spills


def _earlier(
    spill: Spill, stall_s: float, host: RangeAddMaxTree, times: Sequence[float],
    budget: int, disk_gbps: float,
) -> Spill:
    """``spill`` with its load moved earlier by ``stall_s`` (the timeline's wait at its
    reload), as far as the host has room for the buffer again; updates ``host``."""
    copy, load, floor = spill
    if stall_s <= 0 or load <= floor:
        return spill
    lead = times[copy.first_h2d] - times[load] + stall_s  # type: ignore[index]
    target = _latest_load(copy, max(lead, copy.size / (disk_gbps * 1e9)), times, floor)
    size = host_bucket_bytes(copy.size)
    start = load
    while start > target and host.max(start - 1, start) + size <= budget:
        start -= 1
    if start == load:
        return spill
    host.add(start, load, size)
    return Spill(copy, start, floor)


def _rewrite(schedule: ResidencySchedule, spills: Sequence[Spill]) -> ResidencySchedule:
    """``schedule`` with the actions of ``spills`` added (module docstring)."""
    pre = [list(actions) for actions in schedule.pre]
    post = [list(actions) for actions in schedule.post]
    for copy, load, _ in sorted(spills, key=lambda s: s.copy.storage):
        sid = copy.storage
        slots = post if copy.acquire % 2 else pre
        actions = slots[copy.acquire // 2]
        d2h = actions.index(ResidencyAction(ActionKind.COPY_D2H, sid))
        actions.insert(d2h + 1, ResidencyAction(ActionKind.SPILL_TO_DISK, sid))
        read = [ResidencyAction(ActionKind.LOAD_FROM_DISK, sid),
                ResidencyAction(ActionKind.RELEASE_DISK, sid)]
        actions = (post if load % 2 else pre)[load // 2]
        if load == copy.first_h2d:  # in the reload's own slot: right before it
            at = actions.index(ResidencyAction(ActionKind.COPY_H2D, sid))
        else:  # loads start first in a pre slot, last in a post slot
            at = len(actions) if load % 2 else 0
        actions[at:at] = read
    return ResidencySchedule(pre=pre, post=post)
