"""Liveness of a trace and the offload gaps it leaves, what every planner starts from, and
the stall no schedule of those gaps escapes, the bound planners are judged against.

Liveness of a trace without any offload: per-storage intervals and the bytes curve.

Under the residency model of :mod:`..ir.trace`, a storage is on the device from its first
access to its last access (inclusive), or to the end of the step when it is retained, or
to the end of op ``held_until[s]`` when a reference holds it past its last access (then
an offload of that last stretch needs no reload: see :mod:`.liveness`).
Between two consecutive accesses lies a *gap*: the ops strictly between them are the
ones an offload of that gap can relieve.

Offload candidates: the analysis every residency planner starts from.

A *candidate* is a gap between two consecutive accesses of one storage (see
:class:`~.liveness.Gap`) together with where its host copy would be
made. Offloading gap ``(storage, start, end)`` means::

    post[d2h_op]:  COPY_D2H storage        (once per write epoch, shared by its gaps)
    post[start]:   RELEASE_DEVICE storage
    pre[end]:      COPY_H2D storage, WAIT_H2D storage

so the storage is off the device for ops ``start + 1 .. end - 1`` and nowhere else.

``d2h_op`` is the last WRITE of the storage at or before ``start`` (a D2H placed there
can never be made stale by a later write before the release), or the storage's first
access when it is never written before the gap (the first access creates it).

A *held* storage (``trace.held_until``) has one more gap, from its last access to the
end of its hold: ``(storage, last, held_until + 1)``, a *hold gap*. Nothing reads it
again, so its lowering has no reload: the host copy only keeps the bytes a reference
can still reach, and is released after op ``held_until`` (:func:`is_hold_gap`). All gaps
with the same ``(storage, d2h_op)`` form one *write epoch*: they share one host copy,
so the D2H is paid once however many of them are offloaded.

Cost model shared by every planner here: offloading a set of gaps moves the size of
each gap once (its H2D) plus the size of each epoch with an offloaded gap once (its
D2H) — exactly ``bytes_d2h + bytes_h2d`` as ``check_schedule`` counts them.

**The stall bound** (:func:`stall_lower_bound`): a lower bound on the compute stall of
*any* schedule that holds a trace's budget. The time-aware pipeline is judged against this
bound (its target: a stall <= 5% of compute, or <= 1.1 x the lower bound where that is
higher). It relaxes the timeline model of :mod:`.predicted_timeline` (one compute stream;
copies at the trace's bandwidths; a release that waits for its D2H where
``release_waits_for_d2h``; a reload waited for before its reader) and keeps only what no
schedule escapes. Notation: ``C[i]`` is when op ``i`` would start with no stall
(:func:`~.predicted_timeline.op_start_times`), ``T[i]`` when it starts in the schedule;
``T[i] >= C[i]`` and the step's stall is at least ``T[i] - C[i]`` for every ``i`` (compute
after ``i`` still takes what it takes). ``E[i]`` is op ``i``'s excess over its allowance
with no offload; at least ``E[i]`` bytes of gaps covering op ``i`` must be off the device
while it runs.

* **D2H side** (only where a release waits for its D2H). Those bytes were released
  before op ``i`` (before op ``L + 1`` when releases may not pass op ``L``, the compile
  forward's end), so their D2Hs were done by then. A gap's D2H can start no earlier than
  ``C[d2h_op + 1]``; one copy stream at ``B`` bytes/s, even splitting copies into bytes,
  cannot finish ``E`` bytes before ``max_u (u + (E - A(u)) / B)``, where ``A(u)`` is
  what became copyable before ``u``. Stall >= that minus ``C[min(i, L + 1)]``.
* **H2D side.** Of the gaps covering op ``k``, the offloaded ones total at least
  ``E[k]``; those whose reader comes at or before op ``j`` total at least
  ``E[k] - (bytes of covering gaps read after j)`` and must all be reloaded after op
  ``k`` ends (and not before op ``earliest_prefetch_op``, unless read before it) and
  before op ``j``: ``T[j] >=
  max(T[k + 1], T[earliest]) + need / B``, and ``T[x] >= C[x] + (the D2H side's bound
  for ops due before x)``.

Both sides only drop constraints (copies of other bytes, the stream the two directions
share, granularity, the budget while a reload runs), so every schedule's predicted stall
is at least :attr:`StallBound.stall_s` (a property test checks it on random traces).
Cost: O(sum over ops with excess of the gaps covering them x log), fine for the
benchmark's traces; it is a yardstick, not part of planning.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

from ..ir.trace import AccessKind, ActivationTrace, StorageId
from .predicted_timeline import op_start_times


@dataclass(frozen=True)
class StorageLiveness:
    """Invariant: ``first <= last < end``; ``end`` is exclusive (``last + 1``, ``held_until
    + 1`` for a held storage, or num_ops for a retained one)."""

    storage: StorageId
    size: int
    first: int
    last: int
    end: int
    retained: bool
    accesses: tuple[tuple[int, AccessKind], ...]

    def __repr__(self) -> str:
        return f"s{self.storage}[{self.first},{self.end}) {self.size}B"


class Gap(NamedTuple):
    """Ops ``start + 1 .. end - 1`` lie between two consecutive accesses of ``storage``."""

    storage: StorageId
    start: int
    end: int

    def __repr__(self) -> str:
        return f"gap(s{self.storage}: {self.start}->{self.end})"

    @property
    def covered(self) -> range:
        return range(self.start + 1, self.end)


class InfeasibleOp(NamedTuple):
    """An op whose unavoidable bytes exceed the budget by ``excess_bytes``."""

    op_index: int
    required_bytes: int
    excess_bytes: int


def storage_liveness(trace: ActivationTrace) -> dict[StorageId, StorageLiveness]:
    """The device lifetime of every accessed storage when nothing is offloaded (a new
    dict each call; computed once per trace)."""
    return dict(trace.memo("storage_liveness", lambda: _storage_liveness(trace)))


def _storage_liveness(trace: ActivationTrace) -> dict[StorageId, StorageLiveness]:
    result = {}
    for storage in trace.accessed_storages():
        accesses = trace.accesses_of(storage)
        retained = storage in trace.retained
        last = accesses[-1][0]
        result[storage] = StorageLiveness(
            storage=storage,
            size=trace.storage_sizes[storage],
            first=accesses[0][0],
            last=last,
            end=trace.num_ops if retained else trace.held_end(storage) + 1,
            retained=retained,
            accesses=accesses,
        )
    return result


def access_gaps(trace: ActivationTrace) -> list[Gap]:
    """Every gap that covers at least one op, ordered by storage then position."""
    gaps = []
    for storage in trace.accessed_storages():
        ops = [index for index, _ in trace.accesses_of(storage)]
        gaps.extend(Gap(storage, a, b) for a, b in zip(ops, ops[1:]) if b - a >= 2)
    return gaps


def resident_bytes_without_offload(trace: ActivationTrace) -> list[int]:
    """Device bytes during each op when every storage lives over its full interval."""
    delta = [0] * (trace.num_ops + 1)
    for live in storage_liveness(trace).values():
        delta[live.first] += live.size
        delta[live.end] -= live.size
    return list(accumulate(delta[:-1]))


def required_bytes(trace: ActivationTrace) -> list[int]:
    """Bytes no schedule can move off the device during each op.

    That is the op's own operands plus retained storages past their last access (they
    must still be on the device at the end of the step, and offload only happens in
    gaps between accesses). A held storage past its last access is no part of it: its
    last stretch may be offloaded without a reload. A door that can reload retained
    storages at the end of its step lists them as read by a final op instead
    (:func:`~..ir.trace.with_step_end`), which frees them here too. A new list
    each call; computed once per trace.
    """
    return list(trace.memo("required_bytes", lambda: _required_bytes(trace)))


def _required_bytes(trace: ActivationTrace) -> tuple[int, ...]:
    delta = [0] * (trace.num_ops + 1)
    for live in storage_liveness(trace).values():
        if live.retained and live.last + 1 < trace.num_ops:
            delta[live.last + 1] += live.size
            delta[trace.num_ops] -= live.size
    held = accumulate(delta[:-1])
    return tuple(trace.operand_bytes(i) + h for i, h in zip(range(trace.num_ops), held))


def infeasible_ops(trace: ActivationTrace) -> list[InfeasibleOp]:
    """Ops that cannot meet ``trace.budget_bytes`` under any schedule."""
    return [
        InfeasibleOp(i, need, need - trace.budget_bytes)
        for i, need in enumerate(required_bytes(trace))
        if need > trace.budget_bytes
    ]


class OffloadCandidate(NamedTuple):
    """One offloadable gap. Invariant: ``d2h_op <= start < end - 1`` and ``size > 0``."""

    storage: StorageId
    start: int
    end: int
    size: int
    d2h_op: int

    def __repr__(self) -> str:
        return f"cand(s{self.storage}: {self.start}->{self.end}, {self.size}B, d2h@{self.d2h_op})"

    @property
    def gap(self) -> Gap:
        return Gap(self.storage, self.start, self.end)

    @property
    def distance(self) -> int:
        return self.end - self.start

    @property
    def epoch(self) -> tuple[StorageId, int]:
        """The write epoch whose host copy this gap reloads from."""
        return (self.storage, self.d2h_op)


def offload_candidates(
    trace: ActivationTrace, movable: frozenset[StorageId] | None = None
) -> list[OffloadCandidate]:
    """Every gap worth considering, ordered by storage then position.

    Gaps that cover no op relieve nothing and gaps of zero-byte storages save nothing,
    so neither is a candidate. ``movable``: only those storages' gaps (None: every
    storage's); a step laid out as one trace has storages that must stay where they are
    between two accesses (a region's saved tensor that may not move).
    """
    candidates = []
    write = AccessKind.WRITE
    sizes = trace.storage_sizes
    for storage in trace.accessed_storages():
        size = sizes[storage]
        if size <= 0 or (movable is not None and storage not in movable):
            continue
        accesses = trace.accesses_of(storage)
        d2h_op = accesses[0][0]
        previous = d2h_op
        for index, (op, kind) in enumerate(accesses):
            if index and op - previous >= 2:
                candidates.append(OffloadCandidate(storage, previous, op, size, d2h_op))
            if kind is write:
                d2h_op = op
            previous = op
        held = trace.held_until.get(storage)
        if held is not None:  # the hold gap: previous is the last access, held > previous
            candidates.append(OffloadCandidate(storage, previous, held + 1, size, d2h_op))
    return candidates


def is_hold_gap(trace: ActivationTrace, candidate: OffloadCandidate) -> bool:
    """Whether ``candidate`` is its storage's hold gap (it ends past the last access, at
    the end of the hold: no op reads the storage there, so no reload)."""
    return candidate.end == trace.held_until.get(candidate.storage, -2) + 1


def design_rank_key(candidate: OffloadCandidate) -> tuple[int, int, int, int]:
    """Sort key (ascending) for the design's order: (distance, size, -start) descending.

    The design leaves ties between storages open; we break them by storage id,
    ascending, so every implementation of the design picks the same gaps.
    """
    return (-candidate.distance, -candidate.size, candidate.start, candidate.storage)


def op_byte_profile(trace: ActivationTrace) -> tuple[list[int], list[int]]:
    """``(resident, required)`` per op, in one pass over the accesses.

    Identical to ``liveness.resident_bytes_without_offload`` and
    ``liveness.required_bytes`` (the tests check it); computed here without building a
    ``StorageLiveness`` per storage, which dominates planning time on 10^5-op traces.
    """
    num_ops = trace.num_ops
    resident_delta = [0] * (num_ops + 1)
    held_delta = [0] * (num_ops + 1)
    operands = [0] * num_ops
    retained = trace.retained
    sizes = trace.storage_sizes
    for storage in trace.accessed_storages():
        accesses = trace.accesses_of(storage)
        size = sizes[storage]
        for op, _ in accesses:
            operands[op] += size
        first, last = accesses[0][0], accesses[-1][0]
        resident_delta[first] += size
        if storage in retained:
            resident_delta[num_ops] -= size
            held_delta[last + 1] += size  # past its last access it is held until the end
        else:
            resident_delta[trace.held_end(storage) + 1] -= size
    resident = list(accumulate(resident_delta))[:num_ops]
    held = accumulate(held_delta)
    return resident, [own + h for own, h in zip(operands, held)]


def budget_excess(trace: ActivationTrace) -> tuple[list[int], list[InfeasibleOp]]:
    """Per-op excess over the allowance with no offload, and the infeasible ops.

    The allowance is ``max(budget, required_bytes)``: an op whose own operands exceed
    the budget (infeasible) is satisfied once everything else around it is offloaded,
    which is exactly what ``check_schedule`` accepts. Positive excess means "over".
    The infeasible ops equal ``liveness.infeasible_ops(trace)``.
    """
    budget = trace.budget_bytes
    resident, required = op_byte_profile(trace)
    excess = [r - (need if need > budget else budget) for r, need in zip(resident, required)]
    infeasible = [
        InfeasibleOp(i, need, need - budget) for i, need in enumerate(required) if need > budget
    ]
    return excess, infeasible


def excess_over_allowed(trace: ActivationTrace) -> list[int]:
    """The first half of :func:`budget_excess`."""
    return budget_excess(trace)[0]


# ---------------------------------------------------------------- the stall bound

class StallBound(NamedTuple):
    """A lower bound on the predicted stall (seconds) and the side that sets it."""

    stall_s: float
    d2h_side_s: float
    h2d_side_s: float

    def __repr__(self) -> str:
        return (
            f"StallBound({self.stall_s * 1e3:.3g} ms: D2H side {self.d2h_side_s * 1e3:.3g}, "
            f"H2D side {self.h2d_side_s * 1e3:.3g})"
        )


def stall_lower_bound(
    trace: ActivationTrace,
    *,
    earliest_prefetch_op: int = 0,
    latest_release_op: int | None = None,
    release_waits_for_d2h: bool = True,
    default_op_duration_s: float | None = None,
) -> StallBound:
    """The bound of the module docstring ("The stall bound") for ``trace`` under its budget.

    The keyword arguments are the door's, as :func:`~..plan.planning.plan_residency` takes
    them (the compile path: the first backward op, the last forward op, True).
    """
    clock = op_start_times(trace, default_op_duration_s)
    excess, _ = budget_excess(trace)
    covering = _covering_gaps(trace, offload_candidates(trace), excess)
    last = trace.num_ops - 1 if latest_release_op is None else latest_release_op
    d2h_rate, h2d_rate = trace.d2h_bandwidth_gbps * 1e9, trace.h2d_bandwidth_gbps * 1e9
    # due[x]: the D2H side's bound for the ops whose off bytes are due before op x
    due = [0.0] * (trace.num_ops + 1)
    d2h_side = 0.0
    if release_waits_for_d2h:
        for op, gaps in covering.items():
            deadline = min(op, last + 1)
            stall = _copy_done(excess[op], gaps, clock, d2h_rate) - clock[deadline]
            due[deadline] = max(due[deadline], stall)
            d2h_side = max(d2h_side, stall)
        due = list(accumulate(due, max))
    h2d_side = 0.0
    for op, gaps in covering.items():
        if not gaps:
            continue
        gaps = sorted(gaps, key=lambda g: g.end)
        # a reload waited for before ``earliest_prefetch_op`` starts at its reader: the
        # earliest-read gap gives the earliest start any of them can have
        first = min(max(op + 1, earliest_prefetch_op), gaps[0].end)
        start = max(clock[op + 1] + due[op + 1], clock[first] + due[first])
        needed = excess[op] - sum(g.size for g in gaps)  # minus what may stay off
        for gap in gaps:
            needed += gap.size
            if needed > 0:
                h2d_side = max(h2d_side, start + needed / h2d_rate - clock[gap.end])
    return StallBound(max(0.0, d2h_side, h2d_side), max(0.0, d2h_side), max(0.0, h2d_side))


def _covering_gaps(
    trace: ActivationTrace, candidates: list[OffloadCandidate], excess: list[int]
) -> dict[int, list[OffloadCandidate]]:
    """``{op: gaps covering it}`` for every op over its allowance."""
    by_start: dict[int, list[OffloadCandidate]] = {}
    for gap in candidates:
        by_start.setdefault(gap.start + 1, []).append(gap)
    active: dict[OffloadCandidate, None] = {}
    covering = {}
    for op in range(trace.num_ops):
        for gap in by_start.get(op, ()):
            active[gap] = None
        for gap in [g for g in active if g.end <= op]:
            del active[gap]
        if excess[op] > 0:
            covering[op] = list(active)
    return covering


def _copy_done(
    nbytes: int, gaps: list[OffloadCandidate], clock: list[float], rate: float
) -> float:
    """The earliest time one stream at ``rate`` can have copied ``nbytes`` of ``gaps``,
    each copyable from the end of its ``d2h_op`` (bytes may be split across gaps)."""
    done = nbytes / rate
    before = 0
    for ready, size in sorted((clock[g.d2h_op + 1], g.size) for g in gaps):
        done = max(done, ready + (nbytes - before) / rate)
        before += size
        if before >= nbytes:
            break
    return done
