"""Global logical timeline: slots written by hand for small schedules, plus invariants."""

from __future__ import annotations

import pytest

from hyper_offload.passes.pipeline.timeline import (
    Bubble,
    SwapWindow,
    Timeline,
    TimelineError,
    WindowKind,
    build_timeline,
)

from .swap_order_text import order

# GPipe, 2 ranks x 2 micro-batches, as torch.distributed.pipelining runs it (P2P included).
GPIPE_2X2 = {
    0: order("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1"),
    1: order("1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1"),
}


def slots(timeline: Timeline, rank: int) -> list[tuple[int, str]]:
    return [(s.start, s.label) for s in timeline.slots_of(rank)]


def test_gpipe_two_ranks_two_microbatches_slots_by_hand() -> None:
    timeline = build_timeline(GPIPE_2X2)
    # rank 1 can start F0 only once rank 0's F0 is done; rank 0's B0 waits for rank 1's B0.
    assert slots(timeline, 0) == [(0, "F0"), (1, "F1"), (4, "B0"), (5, "B1")]
    assert slots(timeline, 1) == [(1, "F0"), (2, "F1"), (3, "B0"), (4, "B1")]
    assert timeline.num_slots == 6
    assert timeline.bubbles == (Bubble(0, 2, 4), Bubble(1, 0, 1), Bubble(1, 5, 6))
    assert timeline.idle_slots(0) == 2 and timeline.idle_slots(1) == 2
    assert timeline.windows == ()


def test_compute_only_orders_follow_data_dependencies_without_p2p_steps() -> None:
    without_p2p = {rank: [s for s in steps if s.is_compute_slot] for rank, steps in GPIPE_2X2.items()}
    assert slots(build_timeline(without_p2p), 0) == slots(build_timeline(GPIPE_2X2), 0)
    assert slots(build_timeline(without_p2p), 1) == slots(build_timeline(GPIPE_2X2), 1)


def test_swap_windows_span_launch_to_wait_including_bubbles() -> None:
    orders = {
        0: order(
            "0F0 0SEND_F0 0LO0 0F1 0SEND_F1 0WO0 0F2 0SEND_F2 0F3 0SEND_F3 "
            "0RECV_B3 0B3 0LL0 0RECV_B2 0B2 0RECV_B1 0B1 0RECV_B0 0WL0 0B0"
        ),
        1: order("1RECV_F0 1F0 1RECV_F1 1F1 1RECV_F2 1F2 1RECV_F3 1F3 1B3 1SEND_B3 1B2 1SEND_B2 1B1 1SEND_B1 1B0 1SEND_B0"),
    }
    timeline = build_timeline(orders)
    # rank 0: F0..F3 at 0..3; bubble 4..5; B3 at 6 (after rank 1's B3 at 5), B2 7, B1 8, B0 9.
    assert slots(timeline, 0) == [(0, "F0"), (1, "F1"), (2, "F2"), (3, "F3"), (6, "B3"), (7, "B2"), (8, "B1"), (9, "B0")]
    assert timeline.windows == (
        # launched after F0 ends (1), waited after F1 ends (2)
        SwapWindow(0, 0, 0, WindowKind.OFFLOAD, 1, 2),
        # launched after B3 ends (7), waited after RECV_B0 arrives (rank 1's B0 ends at 9)
        SwapWindow(0, 0, 0, WindowKind.LOAD, 7, 9),
    )
    assert timeline.windows_of(0, WindowKind.LOAD) == (timeline.windows[1],)
    assert timeline.windows_of(1) == ()


def test_overlap_composite_is_one_slot_and_waits_for_both_inputs() -> None:
    # rank 0 holds stages 0 and 3 (V shape); rank 1 holds stages 1 and 2.
    orders = {
        0: order("0F0 0F1 3F0 (3B0;0F2)OVERLAP_B_F 3F1 3B1 0B0 0B1 0F3 3F2 3B2 0B2 3F3 3B3 0B3"),
        1: order("1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 1F2 2F2 1F3 2F3 2B2 1B2 2B3 1B3"),
    }
    timeline = build_timeline(orders)
    rank0 = timeline.slots_of(0)
    composite = next(s for s in rank0 if s.step.is_composite)
    assert composite.label == "B0+F2"
    assert composite.end - composite.start == 1
    # 3F0 needs 2F0 (rank 1 at slot 2): 3F0 at 3; the composite right after it at 4.
    assert [(s.start, s.label) for s in rank0[:4]] == [(0, "F0"), (1, "F1"), (3, "F0"), (4, "B0+F2")]
    assert len(rank0) == len(orders[0])


def test_dx_dw_split_weight_after_input_and_input_gradient_flows_back() -> None:
    orders = {
        0: order("0F0 0F1 0I0 0W0 0I1 0W1"),
        1: order("1F0 1I0 1F1 1I1 1W0 1W1"),
    }
    timeline = build_timeline(orders)
    assert slots(timeline, 1) == [(1, "F0"), (2, "I0"), (3, "F1"), (4, "I1"), (5, "W0"), (6, "W1")]
    # 0I0 waits for 1I0 (ends at 3), not for 1W0.
    assert slots(timeline, 0) == [(0, "F0"), (1, "F1"), (3, "I0"), (4, "W0"), (5, "I1"), (6, "W1")]


@pytest.mark.parametrize(
    "orders, blocked",
    [
        ({0: order("0B0 0F0")}, "rank 0 step 0 (0B0) waits for fwd of stage 0 micro-batch 0"),
        (
            {0: order("0F0 0RECV_B0 0B0 0F1"), 1: order("1F1 1F0 1B0")},
            "rank 1 step 0 (1F1) waits for fwd of stage 0 micro-batch 1",
        ),
    ],
)
def test_deadlocked_orders_name_rank_step_and_missing_input(orders: dict, blocked: str) -> None:
    with pytest.raises(TimelineError, match="deadlock") as caught:
        build_timeline(orders)
    assert blocked in str(caught.value)


def test_wait_without_launch_is_rejected() -> None:
    with pytest.raises(TimelineError, match=r"rank 0 step 1 .*never launched"):
        build_timeline({0: order("0F0 0WO0 0B0")})


def test_slots_and_bubbles_tile_every_rank_row() -> None:
    timeline = build_timeline(GPIPE_2X2)
    for rank in timeline.ranks:
        covered = sorted(
            [(s.start, s.end) for s in timeline.slots_of(rank)]
            + [(b.start, b.end) for b in timeline.bubbles_of(rank)]
        )
        assert covered[0][0] == 0 and covered[-1][1] == timeline.num_slots
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


@pytest.mark.parametrize(
    "schedule, stages_per_rank, options",
    [
        ("gpipe", 1, {"swap": True}),
        ("1f1b", 1, {"swap": True, "min_gap": 2, "transport": "batch"}),
        ("interleaved-1f1b", 2, {"swap": True, "fsdp": True}),
        ("interleaved-zb", 2, {"swap": True}),
        ("zbv", 2, {"swap": True, "min_gap": 2}),
        ("dualpipev", 2, {"swap": True, "dxdw_split": True}),
        ("gpipe", 1, {"swap": True, "overlap": True, "transport": "boundary"}),
    ],
)
def test_built_orders_respect_data_dependencies_and_rank_order(schedule, stages_per_rank, options) -> None:
    from hyper_offload.passes.pipeline.build import build_rank_orders

    orders = build_rank_orders(schedule, num_ranks=3, stages_per_rank=stages_per_rank, num_microbatches=6, **options)
    timeline = build_timeline(orders)
    last_stage = 3 * stages_per_rank - 1
    produced = {"F": "fwd", "B": "dx", "I": "dx", "W": "dw"}
    end_of: dict[tuple[str, int, int], int] = {}
    for slot in timeline.slots:
        for leaf in slot.leaves:
            end_of[(produced[leaf.kind.value], leaf.stage, leaf.micro)] = slot.end
    for rank in timeline.ranks:
        rank_slots = timeline.slots_of(rank)
        assert [s.position for s in rank_slots] == sorted(s.position for s in rank_slots)
        assert all(a.end <= b.start for a, b in zip(rank_slots, rank_slots[1:]))
        assert len(rank_slots) == sum(step.is_compute_slot for step in orders[rank])
        for slot in rank_slots:
            for leaf in slot.leaves:
                s, m = leaf.stage, leaf.micro
                grad_in = [("dx", s + 1, m)] if s < last_stage else []
                needs = {
                    "F": [("fwd", s - 1, m)] if s > 0 else [],
                    "B": [("fwd", s, m), *grad_in],
                    "I": [("fwd", s, m), *grad_in],
                    "W": [("dx", s, m)],
                }[leaf.kind.value]
                assert all(end_of[need] <= slot.start for need in needs), (rank, slot)
        for window in timeline.windows_of(rank):
            assert window.start <= window.end
            key = (window.stage, window.micro)
            if window.kind is WindowKind.OFFLOAD:
                assert window.start >= end_of[("fwd", *key)]
            elif window.kind is WindowKind.LOAD:
                assert window.end <= end_of[("dx", *key)] - 1
            elif window.kind is WindowKind.WEIGHT_OFFLOAD:  # the dW state leaves after its BWD_INPUT
                assert window.start >= end_of[("dx", *key)]
            else:  # and is back before its BWD_WEIGHT starts
                assert window.end <= end_of[("dw", *key)] - 1
    launches = ("SWAP_LAUNCH_OFFLOAD", "DW_LAUNCH_OFFLOAD")
    assert len(timeline.windows) == 2 * sum(
        step.kind.value in launches for order in orders.values() for step in order
    )
