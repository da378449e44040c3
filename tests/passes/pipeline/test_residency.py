"""The residency model on small hand-built orders: every level, by hand."""

from __future__ import annotations

import pickle

import pytest

from hyper_offload.passes.pipeline import (
    StageFootprint,
    StageFootprints,
    StepKind,
    build_rank_orders,
    parse_order,
    predicted_peak,
    step_curve,
)
from hyper_offload.passes.pipeline.meta_step import SwapPhase
from hyper_offload.passes.pipeline.swap import find_weight_windows, inject_swap_steps
from hyper_offload.passes.pipeline.residency import ActivationSizes, chunk_lives, resident_curve

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


# Stage 0 sends its outputs (10 B each, part of forward_resident and of the tail); the
# table says which receive proves which send (hand-written, as send_releases would give).
SENDER = parse_order("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 3RECV_F0")
SENDER_FOOT = StageFootprint(activations=100, forward_resident=10, tail_bytes=12, sent_output=10)
SENDER_RELEASES = {
    (StepKind.RECV_B, 0, 0): ((StepKind.SEND_F, 0, 0),),  # before 0B0: the output dies at 0B0
    (StepKind.RECV_F, 3, 0): ((StepKind.SEND_F, 0, 1),),  # after 0B1: the output dies here
}


def test_a_released_output_leaves_at_its_backward_or_at_its_release_whichever_is_later() -> None:
    sizes = StageFootprints(default=SENDER_FOOT)
    # B0: 12 - 110 = -98, and its output (released already) goes too: -108. B1 leaves
    # 12 + 10 until 3RECV_F0 proves its send.
    assert step_curve(SENDER, sizes, releases=SENDER_RELEASES) == [
        110, 110, 220, 220, 220, 220, 112, 112, 4,
    ]
    # Every send waited at the step end: both tails keep their 10 B output.
    assert step_curve(SENDER, sizes) == [110, 110, 220, 220, 220, 220, 122, 122, 24]


def test_a_released_input_gradient_leaves_at_its_release_even_before_its_weight_step() -> None:
    order = parse_order("1RECV_F0 1F0 1RECV_B0 1I0 1SEND_B0 1RECV_F1 1W0")
    foot = StageFootprint(
        activations=100, forward_resident=10, weight_state=50, weight_resident=15, tail_bytes=20,
        sent_output=10, sent_grad=5,
    )
    releases = {(StepKind.RECV_F, 1, 1): ((StepKind.SEND_B, 1, 0),)}
    sizes = StageFootprints(default=foot)
    # I: 110 -> 65; the gradient (5 of the 15) goes at 1RECV_F1; W: 65 -> 20 as measured.
    assert step_curve(order, sizes, releases=releases) == [0, 110, 110, 110, 65, 60, 60]
    assert step_curve(order, sizes) == [0, 110, 110, 110, 65, 65, 65]
    assert predicted_peak(order, sizes, releases=releases) == 110


def test_send_sizes_are_byte_counts() -> None:
    with pytest.raises(ValueError, match=r"StageFootprint.sent_grad: expected a byte count"):
        StageFootprint(sent_grad=-1)
    assert pickle.loads(pickle.dumps(SENDER_FOOT)) == SENDER_FOOT


def test_zbv_rank_1_dw_windows_of_gap_3_hold_no_compute_slot_at_any_min_gap() -> None:
    """Why ZBV rank 1 (4 ranks, 8 micro-batches) stays below 0.8 x interleaved-1F1B's drop:
    its stage-1 W steps follow their I three slots later. A window is away only between its
    WAIT_OFFLOAD (after the first compute following I, so the copy hides) and its
    LAUNCH_LOAD (before the compute preceding W): even at the smallest min_gap the pass
    accepts, those windows hold no compute slot, so they cannot lower any step's level."""
    order = build_rank_orders("zbv", num_ranks=4, stages_per_rank=2, num_microbatches=8)[1]
    gaps = {w.key: w.gap for w in find_weight_windows(order, min_gap=2)}
    assert [gaps[(1, m)] for m in range(4, 8)] == [3, 3, 3, 3]
    swapped = inject_swap_steps(order, min_gap=2)
    lives = chunk_lives(swapped)
    for micro in range(4, 8):
        span = lives[(1, micro)].away_span(SwapPhase.WEIGHT_STATE)
        assert len(span) == 1 and not any(swapped[p].is_compute_slot for p in span), micro
    foot = StageFootprint(activations=100, forward_resident=10, weight_state=60, weight_resident=5)
    sizes = StageFootprints(default=foot)
    gap3 = [(1, m) for m in range(4, 8)]
    with_gap3 = step_curve(swapped, sizes, weight_swapped=gap3)
    without = step_curve(swapped, sizes, weight_swapped=())
    assert all(a <= b for a, b in zip(with_gap3, without))
    compute = [p for p, step in enumerate(swapped) if step.is_compute_slot]
    assert [with_gap3[p] for p in compute] == [without[p] for p in compute]
