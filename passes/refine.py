"""Refinement of a feasible offload choice: move fewer bytes, stay within budget.

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
  op covered) and the cheapest result wins.

Both moves are tested with the same :class:`RangeAddMaxTree` as the greedy, so a move
costs O(K log S) where K is the number of gaps looked at. Drops cost O(M log S) per
round; swaps look at most at ``max_scan`` gaps each and all swaps of one refinement
share a fixed budget of ``swap_work`` tree operations, so on huge traces refinement adds
O(M log S) plus a constant, while on small traces (the ones the ILP can judge) every
chosen gap gets its swap attempts against every overlapping gap. The result never moves more bytes than the input choice (every move is an
improvement or is reverted).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate

from .planner_candidates import OffloadCandidate
from .segment_tree import RangeAddMaxTree

# How many candidate gaps one swap attempt may look at. The bundled quality traces have
# at most a few hundred gaps, so there the search is exhaustive; on huge traces it
# bounds the work per chosen gap.
DEFAULT_MAX_SCAN = 256
# Full passes over the chosen set; later passes rarely find anything after the second.
DEFAULT_ROUNDS = 3
# Work units (segment-tree operations and candidates scanned or sorted) all swap attempts
# of one refinement may spend together: about 0.1 s of CPU. None of 230 random
# 20-60-op traces needed more than 10_000.
DEFAULT_SWAP_WORK = 20_000


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
        # Work counter compared against the swap budget: one unit per tree operation
        # and per candidate a swap attempt scans or sorts.
        self.work = 0

    def add(self, k: int) -> None:
        cand = self.candidates[k]
        self.work += 1
        self.tree.add(cand.start + 1, cand.end, -cand.size)
        self.chosen.add(k)
        self.epoch_count[self.epoch_of[k]] += 1

    def remove(self, k: int) -> None:
        cand = self.candidates[k]
        self.work += 1
        self.tree.add(cand.start + 1, cand.end, cand.size)
        self.chosen.discard(k)
        self.epoch_count[self.epoch_of[k]] -= 1

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
    for _ in range(rounds):
        swapped = False
        for k in _by_saving(state):
            if state.work >= swap_budget_end:
                break
            if k in state.chosen and _try_swap(state, k, by_start, starts, max_scan):
                swapped = True
        if not swapped:
            break
        _drop_redundant(state)  # a swap can make other chosen gaps redundant
        if state.work >= swap_budget_end:
            break
    return [candidates[k] for k in sorted(state.chosen)]


def _by_saving(state: _Choice) -> list[int]:
    """Chosen gaps, most bytes saved by removing them first (ties: by index)."""
    n = len(state.candidates)  # an int key (not a tuple): no allocation per element
    return sorted(state.chosen, key=lambda k: k - state.saving_of_remove(k) * n)


def _drop_redundant(state: _Choice) -> bool:
    changed = False
    for k in _by_saving(state):
        if state.removable(k):
            state.remove(k)
            changed = True
    return changed


def _overlapping(
    state: _Choice, k: int, by_start: Sequence[int], starts: Sequence[int], max_scan: int
) -> list[int]:
    """Unchosen candidates covering some op that ``k`` covers; at most ``max_scan`` looked at.

    Scans from the latest start that still overlaps backwards, so the nearest gaps are
    seen first when the cap bites.
    """
    target = state.candidates[k]
    lo, hi = target.start + 1, target.end
    found = []
    position = bisect_left(starts, hi - 1)
    scanned = 0
    while position > 0 and scanned < max_scan:
        position -= 1
        scanned += 1
        state.work += 1
        j = by_start[position]
        if j not in state.chosen and state.candidates[j].end > lo:
            found.append(j)
    return found


def _try_swap(
    state: _Choice, k: int, by_start: Sequence[int], starts: Sequence[int], max_scan: int
) -> bool:
    """Replace chosen ``k`` by cheaper overlapping gaps if that saves bytes; else revert."""
    pool = _overlapping(state, k, by_start, starts, max_scan)
    if not pool:
        return False
    saving = state.saving_of_remove(k)
    target = state.candidates[k]
    lo, hi = target.start + 1, target.end
    state.remove(k)
    orders = _fill_orders(state, pool, lo, hi)  # costs as they are without k
    state.work += len(pool) * len(orders)
    best: tuple[int, list[int]] | None = None
    for order in orders:
        added: list[int] = []
        spent = 0
        for j in order:
            if spent >= saving:
                break
            if state.over(j):
                spent += state.cost_to_add(j)
                state.add(j)
                added.append(j)
                if state.range_max(lo, hi) <= 0:
                    break  # k's ops are covered again
        # Fill gaps may overlap each other: drop those the later ones made redundant.
        for j in sorted(added, key=lambda j: (-state.saving_of_remove(j), j)):
            if state.removable(j):
                spent -= state.saving_of_remove(j)
                state.remove(j)
                added.remove(j)
        if spent < saving and state.range_max(lo, hi) <= 0 and (best is None or spent < best[0]):
            best = (spent, list(added))
        for j in added:
            state.remove(j)
    if best is None:
        state.add(k)
        return False
    for j in best[1]:
        state.add(j)
    return True


def _fill_orders(state: _Choice, pool: list[int], lo: int, hi: int) -> list[list[int]]:
    """Orders in which to try replacement gaps for ops ``lo .. hi - 1``: cheapest first,
    longest first, and fewest bytes moved per op of the range covered first."""
    cands = state.candidates

    def per_op_covered(j: int) -> float:
        covered = min(cands[j].end, hi) - max(cands[j].start + 1, lo)  # >= 1: j overlaps
        return state.cost_to_add(j) / covered

    return [
        sorted(pool, key=lambda j: (state.cost_to_add(j), -cands[j].distance, j)),
        sorted(pool, key=lambda j: (-cands[j].distance, cands[j].size, j)),
        sorted(pool, key=lambda j: (per_op_covered(j), j)),
    ]
