"""``RangeAddMaxTree`` against a plain list, on random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_offload.errors import ConfigurationError
from hyper_offload.passes.plan.segment_tree import RangeAddMaxTree


@st.composite
def _tree_scripts(draw: st.DrawFn) -> tuple[list[int], list[tuple[str, int, int, int]]]:
    n = draw(st.integers(1, 40))
    values = draw(st.lists(st.integers(-1000, 1000), min_size=n, max_size=n))
    steps = []
    for _ in range(draw(st.integers(0, 40))):
        lo = draw(st.integers(0, n - 1))
        hi = draw(st.integers(lo + 1, n))
        kind = draw(st.sampled_from(["add", "max", "add_if"]))
        steps.append((kind, lo, hi, draw(st.integers(-500, 500))))
    return values, steps


@settings(max_examples=150, deadline=None)
@given(_tree_scripts())
def test_matches_a_plain_list(script: tuple[list[int], list[tuple[str, int, int, int]]]) -> None:
    values, steps = script
    tree = RangeAddMaxTree(values)
    expected = list(values)
    for kind, lo, hi, delta in steps:
        if kind == "add":
            tree.add(lo, hi, delta)
            for i in range(lo, hi):
                expected[i] += delta
        elif kind == "add_if":  # threshold = delta, so both outcomes occur
            over = max(expected[lo:hi]) > delta
            assert tree.add_if_max_exceeds(lo, hi, delta, -delta) is over
            if over:
                for i in range(lo, hi):
                    expected[i] -= delta
        else:
            assert tree.max(lo, hi) == max(expected[lo:hi])
        assert tree.max_all() == max(expected)
        assert tree.argmax_all() == expected.index(max(expected))  # the leftmost
    assert tree.values() == expected


def test_power_of_two_and_odd_sizes_cover_every_range() -> None:
    for n in (1, 2, 3, 7, 8, 9, 16, 17):
        values = [(i * 37) % 11 - 5 for i in range(n)]
        tree = RangeAddMaxTree(values)
        tree.add(0, n, 3)
        values = [v + 3 for v in values]
        for lo in range(n):
            for hi in range(lo + 1, n + 1):
                assert tree.max(lo, hi) == max(values[lo:hi]), (n, lo, hi)


@pytest.mark.parametrize("lo, hi", [(2, 2), (3, 1), (-1, 2), (0, 6)])
def test_empty_or_out_of_range_is_rejected_with_the_range(lo: int, hi: int) -> None:
    tree = RangeAddMaxTree([1, 2, 3, 4, 5])
    with pytest.raises(ConfigurationError, match=rf"\[{lo}, {hi}\)"):
        tree.max(lo, hi)
    with pytest.raises(ConfigurationError, match="0 <= lo < hi"):
        tree.add(lo, hi, 1)


def test_len_and_repr() -> None:
    tree = RangeAddMaxTree([4, 9, 1])
    assert len(tree) == 3
    assert repr(tree) == "RangeAddMaxTree(n=3, max=9)"
