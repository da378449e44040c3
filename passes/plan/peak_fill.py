"""Fewest bytes at the peak: an exact fill of the excess where every pick covers it all.

On a training step the ops over budget sit together around the forward/backward
boundary, and the gaps the greedy picks (long ones first) each cover all of them. Then
the choice only has to put ``E`` bytes off the device, ``E`` the largest excess, and the
greedy's last pick overshoots it by up to its own size: at a budget some other schedule
meets exactly (torchtitan's own peak, ``benchmarks/peers.py``) it moved 1,006 MiB where
996 MiB do. Local swaps (:mod:`.refine`) cannot find that: it takes three picks out and
seven in.

:func:`fill_peak` solves that part exactly. Its *pool* is every candidate gap that covers
every op over budget (first to last); when the chosen gaps are all in the pool, any pool
subset of at least ``E`` bytes is feasible at every op, and the cheapest is a subset sum:
one pass of a bitset dynamic program over the pool (sizes in units of their greatest
common divisor, or coarser with sizes rounded down and ``E`` up, which keeps every
answer feasible). It replaces the choice only when it moves fewer bytes. Work is bounded
(``max_items`` gaps, ``max_units`` bits), independent of the trace's length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..analysis.candidates import OffloadCandidate

__all__ = ["fill_peak"]

MAX_ITEMS = 256
MAX_UNITS = 1 << 20


def fill_peak(
    candidates: Sequence[OffloadCandidate],
    excess: Sequence[int],
    chosen: Sequence[OffloadCandidate],
    *,
    max_items: int = MAX_ITEMS,
    max_units: int = MAX_UNITS,
) -> list[OffloadCandidate]:
    """``chosen``, or a cheaper choice that is feasible wherever it was (module docstring).

    Bytes are counted as :mod:`..analysis.candidates` does (each gap's H2D plus its
    epoch's D2H), so only storages with one gap in the pool take part."""
    if not chosen:
        return list(chosen)
    first = next((op for op, e in enumerate(excess) if e > 0), None)
    if first is None:
        return list(chosen)
    last = next(op for op in range(len(excess) - 1, -1, -1) if excess[op] > 0)
    # Cheap test first: every pick must cover every op over budget (else nothing to do).
    if not all(c.start < first and c.end > last for c in chosen):
        return list(chosen)
    pool = [c for c in candidates if c.start < first and c.end > last]
    per_storage: dict[int, int] = {}
    for c in pool:
        per_storage[c.storage] = per_storage.get(c.storage, 0) + 1
    pool = [c for c in pool if per_storage[c.storage] == 1]
    in_pool = set(pool)
    if len(pool) > max_items or not all(c in in_pool for c in chosen):
        return list(chosen)
    need = max(excess)
    picked = _cheapest_cover([c.size for c in pool], need, max_units)
    if picked is None or sum(pool[i].size for i in picked) >= sum(c.size for c in chosen):
        return list(chosen)
    return [pool[i] for i in sorted(picked)]


def _cheapest_cover(sizes: list[int], need: int, max_units: int) -> list[int] | None:
    """Indices of a subset of ``sizes`` summing to at least ``need``, as small as the
    unit allows (exact when every size is a multiple of it); None if none reaches."""
    if sum(sizes) < need or need <= 0:
        return None
    unit = math.gcd(*sizes) if sizes else 1
    unit = max(unit, -(-sum(sizes) // max_units))
    weights = [size // unit for size in sizes]  # rounded down: never over-counts cover
    target = -(-need // unit)
    reach, history = 1, []
    for weight in weights:
        history.append(reach)
        reach |= reach << weight
    reachable = reach >> target
    if not reachable:
        return None
    total = target + (reachable & -reachable).bit_length() - 1
    picked = []
    for index in range(len(weights) - 1, -1, -1):
        if not (history[index] >> total) & 1:
            picked.append(index)
            total -= weights[index]
    return picked
