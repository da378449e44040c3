"""A lower bound on the compute stall of *any* schedule that holds a trace's budget.

The time-aware pipeline is judged against this bound (its target: a stall <= 5% of
compute, or <= 1.1 x the lower bound where that is higher). It relaxes the timeline model of
:mod:`.predicted_timeline` (one compute stream; copies at the trace's bandwidths; a
release that waits for its D2H where ``release_waits_for_d2h``; a reload waited for
before its reader) and keeps only what no schedule escapes. Notation: ``C[i]`` is when
op ``i`` would start with no stall (:func:`~.predicted_timeline.op_start_times`),
``T[i]`` when it starts in the schedule;
``T[i] >= C[i]`` and the step's stall is at least ``T[i] - C[i]`` for every ``i``
(compute after ``i`` still takes what it takes). ``E[i]`` is op ``i``'s excess over its
allowance with no offload; at least ``E[i]`` bytes of gaps covering op ``i`` must be off
the device while it runs.

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

from itertools import accumulate
from typing import NamedTuple

from ..ir.trace import ActivationTrace
from .liveness import OffloadCandidate, budget_excess, offload_candidates
from .predicted_timeline import op_start_times

__all__ = ["StallBound", "stall_lower_bound"]


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
    """The bound of the module docstring for ``trace`` under its budget.

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
