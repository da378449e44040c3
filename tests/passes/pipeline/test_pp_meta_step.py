"""MetaStep: compact repr round trip, parse errors, predicates."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_offload.passes.pipeline.meta_step import (
    COMPUTE_KINDS,
    FSDP_KINDS,
    P2P_KINDS,
    SWAP_KINDS,
    MetaStep,
    StepFormatError,
    StepKind,
    composite,
    format_order,
    leaf,
    parse_order,
)

_index = st.integers(min_value=0, max_value=120)


def _leaves(kinds: frozenset[StepKind], with_micro: bool = True) -> st.SearchStrategy[MetaStep]:
    kind = st.sampled_from(sorted(kinds, key=lambda k: k.name))
    micro = _index if with_micro else st.none()
    # Explicit lambda: st.builds(MetaStep, ...) would also invent sub_steps from the hints.
    return st.builds(lambda k, s, m: MetaStep(k, s, m), kind, _index, micro)


_micro_leaf = _leaves(COMPUTE_KINDS | P2P_KINDS | SWAP_KINDS)
_stage_leaf = _leaves(FSDP_KINDS, with_micro=False)
_compute_leaf = _leaves(COMPUTE_KINDS)
_p2p_leaf = _leaves(P2P_KINDS)
_overlap = st.builds(
    lambda kind, subs: MetaStep(kind, None, None, tuple(subs)),
    st.sampled_from([StepKind.OVERLAP_B_F, StepKind.OVERLAP_F_B]),
    st.lists(_compute_leaf, min_size=1, max_size=3),
)
_batch = st.builds(
    lambda subs: MetaStep(StepKind.BATCH_SEND_RECV, None, None, tuple(subs)),
    st.lists(_p2p_leaf, min_size=1, max_size=4),
)
any_step = st.one_of(_micro_leaf, _stage_leaf, _overlap, _batch)


@settings(max_examples=300, deadline=None)
@given(any_step)
def test_repr_parses_back(step: MetaStep) -> None:
    text = repr(step)
    assert MetaStep.from_str(text) == step
    assert str(step) == text


@settings(max_examples=50, deadline=None)
@given(st.lists(any_step, max_size=12))
def test_order_round_trip(order: list[MetaStep]) -> None:
    assert parse_order(format_order(order)) == order
    assert parse_order(" ".join(format_order(order))) == order


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1F3", MetaStep(StepKind.FWD, 1, 3)),
        ("0B12", MetaStep(StepKind.BWD, 0, 12)),
        ("2I0", MetaStep(StepKind.BWD_INPUT, 2, 0)),
        ("2W0", MetaStep(StepKind.BWD_WEIGHT, 2, 0)),
        ("0UNSHARD", MetaStep(StepKind.FSDP_UNSHARD, 0)),
        ("3RESHARD", MetaStep(StepKind.FSDP_RESHARD, 3)),
        ("3REDUCE_GRAD", MetaStep(StepKind.REDUCE_GRAD, 3)),
        ("0SEND_F1", MetaStep(StepKind.SEND_F, 0, 1)),
        ("0SWAP_LAUNCH_OFFLOAD2", MetaStep(StepKind.SWAP_LAUNCH_OFFLOAD, 0, 2)),
        (
            "(0F3;3B1)OVERLAP_B_F",
            MetaStep(StepKind.OVERLAP_B_F, None, None, (MetaStep(StepKind.FWD, 0, 3), MetaStep(StepKind.BWD, 3, 1))),
        ),
        (
            "(0SEND_F1;0RECV_B0)BATCH_SEND_RECV",
            MetaStep(
                StepKind.BATCH_SEND_RECV, None, None, (MetaStep(StepKind.SEND_F, 0, 1), MetaStep(StepKind.RECV_B, 0, 0))
            ),
        ),
    ],
)
def test_documented_forms(text: str, expected: MetaStep) -> None:
    assert MetaStep.from_str(text) == expected
    assert repr(expected) == text


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("F3", "needs a stage"),
        ("0F", "needs a micro-batch"),
        ("0UNSHARD1", "takes no micro-batch"),
        ("0F3x", "unexpected text"),
        ("(0F1)F", "not a composite kind"),
        ("(0F1;0UNSHARD)OVERLAP_B_F", "may hold only"),
        ("(0F1;0SWAP_WAIT_LOAD1)BATCH_SEND_RECV", "may hold only"),
        ("(0F1", "expected ';' or '\\)'"),
        ("0OVERLAP_B_F", "needs at least one sub-step"),
        ("", "cannot read a step"),
    ],
)
def test_parse_errors_say_why(text: str, why: str) -> None:
    with pytest.raises(StepFormatError, match=why):
        MetaStep.from_str(text)


def test_predicates_and_leaves() -> None:
    overlap = MetaStep.from_str("(1I2;1F4)OVERLAP_B_F")
    batch = MetaStep.from_str("(1SEND_F1;1RECV_B0)BATCH_SEND_RECV")
    assert overlap.is_compute_slot and not overlap.is_compute and overlap.is_composite
    assert [repr(s) for s in overlap.leaves()] == ["1I2", "1F4"]
    assert batch.is_p2p and batch.is_comm and not batch.is_compute_slot
    assert MetaStep.from_str("0W1").is_compute
    assert MetaStep.from_str("0SWAP_WAIT_LOAD1").is_swap
    assert MetaStep.from_str("0UNSHARD").is_fsdp and not MetaStep.from_str("0UNSHARD").is_p2p
    assert MetaStep.from_str("2F5").chunk == (2, 5)
    assert MetaStep.from_str("2UNSHARD").chunk is None


def test_builders_validate() -> None:
    assert leaf("FWD", 1, 2) == leaf("F", 1, 2) == MetaStep(StepKind.FWD, 1, 2)
    assert repr(composite(StepKind.OVERLAP_B_F, leaf("B", 0, 1), leaf("F", 0, 3))) == "(0B1;0F3)OVERLAP_B_F"
    with pytest.raises(StepFormatError, match="unknown step kind"):
        leaf("NOPE", 0, 0)
    with pytest.raises(StepFormatError, match="non-negative"):
        leaf("F", -1, 0)
    with pytest.raises(StepFormatError, match="may hold only"):
        composite("BATCH_SEND_RECV", leaf("F", 0, 0))
