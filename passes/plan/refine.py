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

Refinement of a feasible offload choice: move fewer bytes, stay within budget.

The design's greedy ranks gaps by distance and size alone, so it often offloads a large
storage where a small one would do, and keeps early picks that later picks made
unnecessary. :func:`refine_choice` takes any feasible choice (every op within its
allowance) and improves it by local moves, each of which strictly lowers the bytes moved
and keeps every op within its allowance:

* **drop** a chosen gap whose covered ops all stay within budget without it;
* **swap** a chosen gap for a set of unchosen gaps overlapping it that cover the ops it
  leaves over budget and cost fewer bytes (its H2D, plus its epoch's D2H when it was the
  epoch's only chosen gap, against the new gaps' H2Ds and any new epochs' D2Hs). The
  replacement set is filled greedily in three orders (cheapest, longest, cheapest per
  op covered) and the cheapest result wins. Then the same for all chosen gaps of one
  storage at once: adjacent picks of one storage, or picks sharing one D2H, often only
  pay off removed together;
* **insert** an unchosen gap, drop the chosen gaps it makes redundant and, if that does
  not pay yet, swap out the chosen gaps it overlaps (each swap now only has to cover
  what the new gap leaves); kept only if the whole move saves bytes, else rolled back
  through the journal of adds and removes. One gap replacing two or more picks at once,
  or two picks out and two in, which a swap (one pick out) cannot find. Only gaps
  covering an op that was over budget with no offload are inserted, longest first.

All moves are tested with the same :class:`RangeAddMaxTree` as the greedy, so a move
costs O(K log S) where K is the number of gaps looked at. Drops cost O(M log S) per
round; swaps and inserts look at most at ``max_scan`` gaps each and all of them in one
refinement share a fixed budget of ``swap_work`` tree operations, so on huge traces refinement adds
O(M log S) plus a constant, while on small traces (the ones the ILP can judge) every
chosen gap gets its swap attempts against every overlapping gap and every gap its
insert attempt. The result never moves more bytes than the input choice (every move is an
improvement or is reverted).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate

from ..analysis.liveness import OffloadCandidate
from .segment_tree import RangeAddMaxTree

__all__ = [
    "DEFAULT_MAX_SCAN",
    "DEFAULT_ROUNDS",
    "DEFAULT_SWAP_WORK",
    "fill_peak",
    "refine_choice",
]


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

    Bytes are counted as :mod:`..analysis.liveness` does (each gap's H2D plus its
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


# How many candidate gaps one swap attempt may look at. The bundled quality traces have
# at most a few hundred gaps, so there the search is exhaustive; on huge traces it
# bounds the work per chosen gap.
DEFAULT_MAX_SCAN = 256
# Full passes over the chosen set; later passes rarely find anything after the second.
DEFAULT_ROUNDS = 3
# Work units (segment-tree operations and candidates scanned or sorted) all swap and
# insert attempts of one refinement may spend together: about 0.06 s of CPU on the
# 100k-op benchmark trace, which spends all of it. On 1430 small traces (the 30 bundled
# ones and 1400 random 4-60-op ones) the search was cut short on 10 (20_000: on 33).
DEFAULT_SWAP_WORK = 40_000


class _Choice:
    """A mutable chosen set plus the residency it implies; lives inside one refinement."""

    def __init__(
        self, candidates: Sequence[OffloadCandidate], excess: Sequence[int], chosen: Sequence[int]
    ) -> None:
        self.candidates = candidates
        # Epochs as small ints, so the per-move bookkeeping allocates nothing.
        epoch_ids: dict[tuple[int, int], int] = {}
        self.epoch_of = [epoch_ids.setdefault(c.epoch, len(epoch_ids)) for c in candidates]
        self.epoch_count = [0] * len(epoch_ids)
        # Residency of the initial choice by a difference array: O(M + S), where one
        # tree update per chosen gap would cost O(M log S).
        delta = [0] * (len(excess) + 1)
        for k in chosen:
            cand = candidates[k]
            delta[cand.start + 1] -= cand.size
            delta[cand.end] += cand.size
            self.epoch_count[self.epoch_of[k]] += 1
        self.tree = RangeAddMaxTree([e + d for e, d in zip(excess, accumulate(delta))])
        self.chosen: set[int] = set(chosen)
        # Bytes the current choice moves (H2D per gap, D2H per epoch with a gap), kept
        # up to date by add / remove so a composite move can compare before and after.
        self.moved = sum(candidates[k].size for k in self.chosen) + sum(
            candidates[k].size for k in {self.epoch_of[k]: k for k in self.chosen}.values()
        )
        # Every add (k + 1) and remove (-(k + 1)) in order, so that ``rollback`` can undo
        # a composite move exactly.
        self.journal: list[int] = []
        # Work counter compared against the swap budget: one unit per tree operation
        # and per candidate a swap attempt scans or sorts.
        self.work = 0

    def add(self, k: int) -> None:
        cand = self.candidates[k]
        self.work += 1
        self.moved += self.cost_to_add(k)
        self.tree.add(cand.start + 1, cand.end, -cand.size)
        self.chosen.add(k)
        self.epoch_count[self.epoch_of[k]] += 1
        self.journal.append(k + 1)

    def remove(self, k: int) -> None:
        cand = self.candidates[k]
        self.work += 1
        self.moved -= self.saving_of_remove(k)
        self.tree.add(cand.start + 1, cand.end, cand.size)
        self.chosen.discard(k)
        self.epoch_count[self.epoch_of[k]] -= 1
        self.journal.append(-(k + 1))

    def rollback(self, mark: int) -> None:
        """Undo every add and remove since ``len(self.journal)`` was ``mark``."""
        undo = self.journal[mark:]
        del self.journal[mark:]
        for entry in reversed(undo):
            if entry > 0:
                self.remove(entry - 1)
            else:
                self.add(-entry - 1)
        del self.journal[mark:]  # the undo steps themselves are not part of the history

    def cost_to_add(self, k: int) -> int:
        """Bytes moved by adding candidate ``k``: its H2D, plus a D2H for a new epoch."""
        return self.candidates[k].size * (1 if self.epoch_count[self.epoch_of[k]] else 2)

    def saving_of_remove(self, k: int) -> int:
        """Bytes saved by removing chosen ``k``: its H2D, plus a D2H if last of its epoch."""
        return self.candidates[k].size * (2 if self.epoch_count[self.epoch_of[k]] == 1 else 1)

    def range_max(self, lo: int, hi: int) -> int:
        self.work += 1
        return self.tree.max(lo, hi)

    def over(self, k: int) -> bool:
        """Is some op that candidate ``k`` covers over its allowance now?"""
        cand = self.candidates[k]
        return self.range_max(cand.start + 1, cand.end) > 0

    def removable(self, k: int) -> bool:
        """Would every op candidate ``k`` covers stay within its allowance without it?"""
        cand = self.candidates[k]
        return self.range_max(cand.start + 1, cand.end) + cand.size <= 0


def refine_choice(
    candidates: Sequence[OffloadCandidate],
    excess: Sequence[int],
    chosen: Sequence[OffloadCandidate],
    *,
    rounds: int = DEFAULT_ROUNDS,
    max_scan: int = DEFAULT_MAX_SCAN,
    swap_work: int = DEFAULT_SWAP_WORK,
) -> list[OffloadCandidate]:
    """A choice that moves no more bytes than ``chosen`` and is feasible where it was.

    ``candidates`` must contain every member of ``chosen``; ``excess`` is the per-op
    excess with no offload (see ``excess_over_allowed``). The result is ordered like
    ``candidates``.
    """
    if not chosen:
        return []
    index_of = {cand: k for k, cand in enumerate(candidates)}
    state = _Choice(candidates, excess, [index_of[c] for c in chosen])
    by_start = sorted(range(len(candidates)), key=lambda k: candidates[k].start)
    starts = [candidates[k].start for k in by_start]
    _drop_redundant(state)
    swap_budget_end = state.work + swap_work
    insertable: list[int] | None = None  # built only if swaps leave work budget for it
    for _ in range(rounds):
        swapped = False
        for k in _by_saving(state):
            if state.work >= swap_budget_end:
                break
            if k in state.chosen and _try_swap(state, (k,), by_start, starts, max_scan):
                swapped = True
        groups = _multi_gap_storages(state) if state.work < swap_budget_end else []
        for out in groups:  # a storage's adjacent picks, or its shared D2H, go together
            if state.work >= swap_budget_end:
                break
            if all(k in state.chosen for k in out) and _try_swap(
                state, out, by_start, starts, max_scan
            ):
                swapped = True
        if insertable is None and state.work < swap_budget_end:
            insertable = _insertable(candidates, excess)
            state.work += len(candidates)  # the scan and sort, in the same work units
        for j in insertable or ():
            if state.work >= swap_budget_end:
                break
            if j not in state.chosen and _try_insert(state, j, by_start, starts, max_scan):
                swapped = True
        if not swapped:
            break
        _drop_redundant(state)  # a swap can make other chosen gaps redundant
        if state.work >= swap_budget_end:
            break
    return [candidates[k] for k in sorted(state.chosen)]


def _insertable(candidates: Sequence[OffloadCandidate], excess: Sequence[int]) -> list[int]:
    """Candidates an insert move may add, longest first (ties: smaller, then by index).

    Only gaps covering an op that is over its allowance with no offload: the planner
    never offloads a gap where nothing was over budget to begin with.
    """
    over_before = list(accumulate((1 if e > 0 else 0 for e in excess), initial=0))
    return sorted(
        (k for k, c in enumerate(candidates) if over_before[c.end] > over_before[c.start + 1]),
        key=lambda k: (-candidates[k].distance, candidates[k].size, k),
    )


def _multi_gap_storages(state: _Choice) -> list[tuple[int, ...]]:
    """Chosen gaps grouped by storage, for storages with two or more of them; the most
    bytes first (ties: by first index)."""
    cands = state.candidates
    groups: dict[int, list[int]] = {}
    for k in sorted(state.chosen):
        groups.setdefault(cands[k].storage, []).append(k)
    state.work += len(state.chosen)
    multi = [tuple(g) for g in groups.values() if len(g) >= 2]
    return sorted(multi, key=lambda g: (-len(g) * cands[g[0]].size, g[0]))


def _by_saving(state: _Choice) -> list[int]:
    """Chosen gaps, most bytes saved by removing them first (ties: by index)."""
    n = len(state.candidates)  # an int key (not a tuple): no allocation per element
    return sorted(state.chosen, key=lambda k: k - state.saving_of_remove(k) * n)


def _drop_redundant(state: _Choice) -> bool:
    """Remove every chosen gap the others make redundant, most bytes saved first.

    A gap whose range holds the op at the tree's maximum cannot be removable when that
    maximum plus its size is over the allowance (the range max is at least the maximum):
    that answer costs no tree walk, which is most of the checks on long traces (the
    100k-op benchmark: all 33k). It counts as one unit of work like the walk it replaces,
    so the swap budget, and with it the result, are what they were.
    """
    changed = False
    peak_op, peak = state.tree.argmax_all(), state.tree.max_all()
    for k in _by_saving(state):
        cand = state.candidates[k]
        if cand.start < peak_op < cand.end and peak + cand.size > 0:
            state.work += 1
            continue
        if state.removable(k):
            state.remove(k)
            changed = True
            peak_op, peak = state.tree.argmax_all(), state.tree.max_all()
    return changed


def _overlapping(
    state: _Choice,
    k: int,
    by_start: Sequence[int],
    starts: Sequence[int],
    max_scan: int,
    *,
    chosen: bool = False,
) -> list[int]:
    """Candidates (unchosen, or chosen if ``chosen``) covering some op that ``k`` covers,
    ``k`` excluded; at most ``max_scan`` looked at.

    Scans from the latest start that still overlaps backwards, so the nearest gaps are
    seen first when the cap bites.
    """
    target = state.candidates[k]
    lo, hi = target.start + 1, target.end
    found = []
    position = bisect_left(starts, hi - 1)
    scanned = 0
    in_set = state.chosen
    while position > 0 and scanned < max_scan:
        position -= 1
        scanned += 1
        state.work += 1
        j = by_start[position]
        if (j in in_set) is chosen and j != k and state.candidates[j].end > lo:
            found.append(j)
    return found


def _try_swap(
    state: _Choice, out: Sequence[int], by_start: Sequence[int], starts: Sequence[int],
    max_scan: int,
) -> bool:
    """Replace chosen gaps ``out`` (one, or all chosen gaps of one epoch) by cheaper
    overlapping gaps if that saves bytes; else revert."""
    pool = list(dict.fromkeys(
        j for k in out for j in _overlapping(state, k, by_start, starts, max_scan)
    ))
    if not pool:
        return False
    ranges = [(state.candidates[k].start + 1, state.candidates[k].end) for k in out]
    saving = 0
    for k in out:
        saving += state.saving_of_remove(k)  # counts the epoch's D2H once, at its last gap
        state.remove(k)
    orders = _fill_orders(state, pool, ranges)  # costs as they are without ``out``
    state.work += len(pool) * len(orders)
    best: tuple[int, list[int]] | None = None
    for order in orders:
        added, spent = _fill(state, order, ranges, saving)
        if spent < saving and _covered(state, ranges) and (best is None or spent < best[0]):
            best = (spent, list(added))
        for j in added:
            state.remove(j)
    for k in out if best is None else best[1]:
        state.add(k)
    return best is not None


def _covered(state: _Choice, ranges: Sequence[tuple[int, int]]) -> bool:
    return all(state.range_max(lo, hi) <= 0 for lo, hi in ranges)


def _fill(
    state: _Choice, order: Sequence[int], ranges: Sequence[tuple[int, int]], saving: int
) -> tuple[list[int], int]:
    """Add gaps of ``order`` that cover an op still over budget until ``ranges`` are
    covered or they cost ``saving``; then drop those later ones made redundant.

    Returns the added gaps (they stay chosen; the caller reverts them) and the bytes
    they move."""
    added: list[int] = []
    spent = 0
    for j in order:
        if spent >= saving:
            break
        if state.over(j):
            spent += state.cost_to_add(j)
            state.add(j)
            added.append(j)
            if _covered(state, ranges):
                break
    # Fill gaps may overlap each other: drop those the later ones made redundant.
    for j in sorted(added, key=lambda j: (-state.saving_of_remove(j), j)):
        if state.removable(j):
            spent -= state.saving_of_remove(j)
            state.remove(j)
            added.remove(j)
    return added, spent


def _try_insert(
    state: _Choice, j: int, by_start: Sequence[int], starts: Sequence[int], max_scan: int
) -> bool:
    """Add unchosen ``j`` if the chosen gaps it makes redundant save more than it costs.

    The reverse of a swap: one new gap replaces several chosen ones at once (two picks
    that each cover half of ``j``'s ops, say), which no single-pick swap can find.
    Reverted unless it strictly lowers the bytes moved.
    """
    rivals = _overlapping(state, j, by_start, starts, max_scan, chosen=True)
    if not rivals:
        return False
    mark, before = len(state.journal), state.moved
    state.add(j)
    rivals.sort(key=lambda k: (-state.saving_of_remove(k), k))
    for k in rivals:
        if state.removable(k):
            state.remove(k)
    if state.moved >= before:
        # Not paid off yet: ``j`` may still let a rival be swapped for gaps that cover
        # only what ``j`` leaves (two picks out, two in). Each swap commits only if it
        # saves bytes, and the whole move is undone unless the total does.
        for k in rivals:
            if k in state.chosen:
                _try_swap(state, (k,), by_start, starts, max_scan)
    if state.moved < before:
        return True
    state.rollback(mark)
    return False


def _fill_orders(
    state: _Choice, pool: list[int], ranges: Sequence[tuple[int, int]]
) -> list[list[int]]:
    """Orders in which to try replacement gaps for the ops of ``ranges``: cheapest first,
    longest first, and fewest bytes moved per op of the ranges covered first."""
    cands = state.candidates

    def per_op_covered(j: int) -> float:
        start, end = cands[j].start + 1, cands[j].end
        covered = sum(max(0, min(end, hi) - max(start, lo)) for lo, hi in ranges)
        return state.cost_to_add(j) / covered  # covered >= 1: j overlaps some range

    return [
        sorted(pool, key=lambda j: (state.cost_to_add(j), -cands[j].distance, j)),
        sorted(pool, key=lambda j: (-cands[j].distance, cands[j].size, j)),
        sorted(pool, key=lambda j: (per_op_covered(j), j)),
    ]
