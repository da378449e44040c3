"""Cross-rank executability: built orders run to the end; broken ones are caught."""

from __future__ import annotations

import pytest

from hyper_offload.passes.pipeline import OrderRule, build_rank_orders, layout_for, parse_order
from hyper_offload.passes.pipeline.execution import check_execution

GPIPE_2X1 = {
    0: parse_order("0F0 0SEND_F0 0RECV_B0 0B0"),
    1: parse_order("1RECV_F0 1F0 1B0 1SEND_B0"),
}
LAYOUT_2 = layout_for("gpipe", num_ranks=2, stages_per_rank=1)


def _rules(orders, layout=LAYOUT_2, **kw) -> set[OrderRule]:
    return {v.rule for v in check_execution(orders, layout, **kw)}


def test_hand_written_orders_run() -> None:
    assert check_execution(GPIPE_2X1, LAYOUT_2) == []


def test_recv_before_send_deadlocks() -> None:
    orders = {**GPIPE_2X1, 0: parse_order("0RECV_B0 0F0 0SEND_F0 0B0")}
    violations = check_execution(orders, LAYOUT_2)
    deadlocks = [v for v in violations if v.rule is OrderRule.DEADLOCK]
    assert {(v.rank, v.step) for v in deadlocks} == {(0, 0), (1, 0)}
    assert "waits forever for 1SEND_B0" in str(deadlocks[0])
    # the two receives stay posted and unmatched; nothing else is wrong
    assert {v.rule for v in violations} == {OrderRule.DEADLOCK, OrderRule.UNMATCHED_P2P}


def test_missing_recv_is_a_dependency_error() -> None:
    orders = {**GPIPE_2X1, 1: parse_order("1F0 1B0 1SEND_B0")}
    assert _rules(orders) == {OrderRule.DEPENDENCY, OrderRule.UNMATCHED_P2P}


def test_backward_before_forward() -> None:
    orders = {**GPIPE_2X1, 1: parse_order("1RECV_F0 1B0 1F0 1SEND_B0")}
    assert _rules(orders) == {OrderRule.DEPENDENCY}


def test_send_before_compute() -> None:
    orders = {**GPIPE_2X1, 0: parse_order("0SEND_F0 0F0 0RECV_B0 0B0")}
    assert _rules(orders) == {OrderRule.DEPENDENCY}


def test_weight_before_input_grad() -> None:
    layout = layout_for("gpipe", num_ranks=1, stages_per_rank=1)
    assert _rules({0: parse_order("0F0 0W0 0I0")}, layout) == {OrderRule.DEPENDENCY}


def test_composite_leaves_cannot_feed_each_other() -> None:
    layout = layout_for("zbv", num_ranks=1, stages_per_rank=2)  # stages 0 and 1 on rank 0
    assert _rules({0: parse_order("0F0 (1F0;1B0)OVERLAP_F_B 0B0")}, layout) == {OrderRule.DEPENDENCY}
    assert check_execution({0: parse_order("0F0 1F0 1B0 0B0")}, layout) == []


def test_compute_on_sharded_stage() -> None:
    layout = layout_for("gpipe", num_ranks=1, stages_per_rank=1)
    assert check_execution({0: parse_order("0UNSHARD 0F0 0B0 0RESHARD")}, layout) == []
    assert _rules({0: parse_order("0UNSHARD 0F0 0RESHARD 0B0")}, layout) == {OrderRule.NOT_UNSHARDED}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("overlap", [False, True])
def test_single_stage_batches_survive_strict_batch_semantics(schedule: str, overlap: bool) -> None:
    for ranks, micro in [(2, 4), (4, 8), (3, 2)]:
        orders = build_rank_orders(
            schedule, num_ranks=ranks, stages_per_rank=1, num_microbatches=micro, transport="batch",
            overlap=overlap, swap=True, min_gap=2,
        )
        layout = layout_for(schedule, num_ranks=ranks, stages_per_rank=1)
        assert check_execution(orders, layout, batch_waits_sends=True) == []


def test_interleaved_batches_need_lazy_send_waits() -> None:
    # Documented limitation: if a fused batch completes as a whole, interleaved orders deadlock.
    kw = dict(num_ranks=2, stages_per_rank=2, num_microbatches=8, transport="batch")
    orders = build_rank_orders("interleaved-1f1b", **kw)
    layout = layout_for("interleaved-1f1b", num_ranks=2, stages_per_rank=2)
    assert check_execution(orders, layout) == []
    assert OrderRule.DEADLOCK in _rules(orders, layout, batch_waits_sends=True)
