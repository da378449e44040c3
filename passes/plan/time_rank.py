"""Time-aware ranking of offload candidates: prefer gaps whose copies fit their windows.

The design's greedy ranks gaps by distance and size only, so it may pick a gap whose
D2H cannot finish before its bytes must be gone (a large tensor produced just before
the peak) or whose reload cannot finish between the last op that needs it gone and its
reader. On the timeline model such a pick stalls compute whatever the placement does.
:func:`time_rank_key` ranks every gap that *fits* both windows ahead of every gap that
does not, and keeps the design's order within each tier::

    D2H window   from the end of the gap's d2h_op to the start of the first op in the
                 gap that is over budget (the bytes must be gone by then)
    H2D window   from the start of the op after the last over-budget op in the gap (not
                 before ``earliest_prefetch_op``) to the start of its reader
    fits         bytes / bandwidth <= window, for both

A window is judged alone (the copy stream's other traffic is the placement's and the
timeline model's business), so this is a ranking, never a promise: the pipeline predicts
every proposal and keeps the one that stalls least (:func:`~.planning.plan_residency`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..analysis.candidates import OffloadCandidate, design_rank_key
from ..analysis.predicted_timeline import op_start_times
from ..ir.limits import OpLimit, op_limit
from ..ir.trace import ActivationTrace

__all__ = ["copy_fits", "time_rank_key"]

RankKey = Callable[[OffloadCandidate], tuple[int, ...]]


def copy_fits(
    trace: ActivationTrace,
    candidates: Sequence[OffloadCandidate],
    excess: Sequence[int],
    *,
    earliest_prefetch_op: OpLimit = 0,
) -> list[bool]:
    """For each candidate, whether its D2H and its H2D each fit their window alone
    (``earliest_prefetch_op``: one op, or one per storage, :mod:`..ir.limits`)."""
    num_ops = trace.num_ops
    clock = op_start_times(trace)
    next_over = [num_ops] * (num_ops + 1)  # first op >= i over budget
    for op in range(num_ops - 1, -1, -1):
        next_over[op] = op if excess[op] > 0 else next_over[op + 1]
    prev_over = [-1] * num_ops  # last op <= i over budget
    for op in range(num_ops):
        prev_over[op] = op if excess[op] > 0 else (prev_over[op - 1] if op else -1)
    d2h_rate, h2d_rate = trace.d2h_bandwidth_gbps * 1e9, trace.h2d_bandwidth_gbps * 1e9
    fits = []
    for gap in candidates:
        first = next_over[gap.start + 1]
        last = prev_over[gap.end - 1]
        if first >= gap.end:  # covers no op over budget: nothing has to be gone in time
            fits.append(True)
            continue
        reload_from = min(max(last + 1, op_limit(earliest_prefetch_op, gap.storage, 0)), gap.end)
        d2h_window = clock[first] - clock[gap.d2h_op + 1]
        h2d_window = clock[gap.end] - clock[reload_from]
        fits.append(gap.size / d2h_rate <= d2h_window and gap.size / h2d_rate <= h2d_window)
    return fits


def time_rank_key(
    trace: ActivationTrace,
    candidates: Sequence[OffloadCandidate],
    excess: Sequence[int],
    *,
    earliest_prefetch_op: OpLimit = 0,
) -> RankKey:
    """A sort key (ascending) for :func:`~.greedy.select_greedy`: fitting gaps
    first, then the design's order (:func:`~..analysis.candidates.design_rank_key`)."""
    fits = dict(
        zip(candidates, copy_fits(trace, candidates, excess, earliest_prefetch_op=earliest_prefetch_op))
    )
    return lambda gap: (0 if fits[gap] else 1, *design_rank_key(gap))
