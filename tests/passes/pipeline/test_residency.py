"""The residency model on small hand-built orders: every level, by hand."""

from __future__ import annotations

import pickle

import pytest

from hyper_offload.passes.pipeline import (
    StageFootprint,
    StageFootprints,
    StepKind,
    parse_order,
    predicted_peak,
    step_curve,
)
from hyper_offload.passes.pipeline.swap import inject_swap_steps
from hyper_offload.passes.pipeline.swap_cost import ActivationSizes, resident_curve

# One stage, dx/dw split, 1F1B-like: W of micro 0 waits five slots after its I.
SPLIT = parse_order("0F0 0F1 0I0 0F2 0I1 0F3 0I2 0W0 0I3 0W1 0W2 0W3")
FOOT = StageFootprint(
    activations=100, forward_resident=10, weight_state=60, weight_resident=5, tail_bytes=1,
    working={StepKind.BWD_INPUT: 200},
)


def test_levels_follow_each_chunk_through_forward_input_and_weight_by_hand() -> None:
    sizes = StageFootprints(default=FOOT)
    curve = step_curve(SPLIT, sizes)
    # F: +110; I: 110 -> 65 (peak: the 200 transient above the level it starts from);
    # W: 65 -> 1 (the tail stays until the step ends).
    f0, f1 = 110, 220
    i0 = f1 + 200
    after_i0 = f1 - 110 + 65
    assert curve[:3] == [f0, f1, i0]
    assert curve[3] == after_i0 + 110
    assert curve[-1] == 3 * 1 + 65  # three tails, and W3's chunk still counted at its own step
    assert predicted_peak(SPLIT, sizes) == max(curve)


def test_a_dw_swap_lowers_the_curve_exactly_over_its_away_span() -> None:
    swapped = inject_swap_steps(SPLIT, min_gap=4, only=(), weight_only=None)
    assert [repr(s) for s in swapped if s.is_swap][:2] == ["0DW_LAUNCH_OFFLOAD0", "0DW_WAIT_OFFLOAD0"]
    sizes = StageFootprints(default=FOOT)
    plain = step_curve(swapped, sizes, swapped=(), weight_swapped=())
    moved = step_curve(swapped, sizes)
    spans = []
    for micro in range(4):
        steps = {s.kind: i for i, s in enumerate(swapped) if s.chunk == (0, micro) and s.is_swap}
        if steps:
            spans.append(range(steps[StepKind.DW_WAIT_OFFLOAD], steps[StepKind.DW_LAUNCH_LOAD]))
    assert spans, "the order has dW windows to swap"
    assert [p - m for p, m in zip(plain, moved)] == [
        60 * sum(i in span for span in spans) for i in range(len(swapped))
    ]


def test_group_swap_packs_in_place_of_the_members_with_a_transient_at_pack_and_unpack() -> None:
    packed = StageFootprints(default=StageFootprint(activations=100, packed_activations=100))
    plain = StageFootprints(default=StageFootprint(activations=100))
    order = inject_swap_steps(parse_order("0F0 0F1 0F2 0F3 0F4 0B0 0B1 0B2 0B3 0B4"), min_gap=4)
    with_pack, without = step_curve(order, packed), step_curve(order, plain)
    steps = {s.kind: i for i, s in enumerate(order) if s.chunk == (0, 0) and s.is_swap}
    transients = {steps[StepKind.SWAP_LAUNCH_OFFLOAD], steps[StepKind.SWAP_WAIT_LOAD]}
    for i, (a, b) in enumerate(zip(with_pack, without)):
        extra = sum(i == steps_of[k] for steps_of in _swap_positions(order)
                    for k in (StepKind.SWAP_LAUNCH_OFFLOAD, StepKind.SWAP_WAIT_LOAD))
        assert a == b + 100 * extra, i
    assert transients <= {i for i, (a, b) in enumerate(zip(with_pack, without)) if a > b}


def _swap_positions(order: list) -> list[dict]:
    chunks = sorted({s.chunk for s in order if s.is_swap})
    return [{s.kind: i for i, s in enumerate(order) if s.chunk == c and s.is_swap} for c in chunks]


def test_activation_sizes_give_the_activation_only_curve_of_the_swap_pass() -> None:
    order = inject_swap_steps(parse_order("0F0 0F1 0F2 0F3 0F4 0B0 0B1 0B2 0B3 0B4"), min_gap=4)
    assert resident_curve(order, ActivationSizes(default_bytes=1)) == step_curve(
        order, StageFootprints(default=StageFootprint(activations=1))
    )


def test_a_full_backward_and_a_split_backward_leave_their_own_tails() -> None:
    foot = StageFootprint(activations=10, weight_state=5, tail_bytes=1, split_tail_bytes=3)
    sizes = StageFootprints(default=foot)
    assert step_curve(parse_order("0F0 0B0"), sizes)[-1] == 10  # B counts its chunk at its step
    assert step_curve(parse_order("0F0 0B0 0F1"), sizes)[-1] == 1 + 10
    assert step_curve(parse_order("0F0 0I0 0W0 0F1"), sizes)[-1] == 3 + 10


def test_parameter_gradients_appear_once_per_stage() -> None:
    sizes = StageFootprints(default=StageFootprint(activations=10, grad_bytes=50))
    # allocated while B0's chunk is still alive (+50 over 20), then B0 frees its 10 bytes
    assert step_curve(parse_order("0F0 0F1 0B0 0B1 0F2"), sizes) == [10, 20, 70, 60, 60]


def test_footprints_check_their_fields_and_survive_pickling() -> None:
    with pytest.raises(ValueError, match="StageFootprint.activations"):
        StageFootprint(activations=-1)
    with pytest.raises(ValueError, match="not a compute kind"):
        StageFootprint(working={StepKind.SEND_F: 1})
    sizes = StageFootprints(per_stage={2: FOOT})
    assert pickle.loads(pickle.dumps(sizes)) == sizes
