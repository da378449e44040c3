"""check_order: accepts what the passes build, and catches deliberately broken orders."""

from __future__ import annotations

import pytest

from hyper_offload.passes.pipeline import (
    MetaStep,
    OrderError,
    OrderRule,
    StepKind,
    assert_valid_order,
    build_rank_orders,
    check_order,
    format_order_table,
    parse_order,
)
from hyper_offload.passes.pipeline.swap import (
    SwapAnchor,
    apply_swap_anchors,
    find_swap_chunks,
    inject_swap_steps,
    strip_swap_steps,
    swap_anchors,
)

# GPipe rank 0 of 2, 3 micro-batches, swap at min_gap 3 (see test_pp_golden_orders.py).
BASE = parse_order("0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2")
SWAPPED = inject_swap_steps(BASE, min_gap=3)


def _rules(order: list[MetaStep], **kwargs: object) -> set[OrderRule]:
    kwargs.setdefault("min_gap", 3)
    kwargs.setdefault("reference", BASE)
    return {v.rule for v in check_order(order, rank=0, **kwargs)}  # type: ignore[arg-type]


def _index(order: list[MetaStep], text: str) -> int:
    return [repr(s) for s in order].index(text)


def _without(order: list[MetaStep], text: str) -> list[MetaStep]:
    i = _index(order, text)
    return order[:i] + order[i + 1 :]


def _move(order: list[MetaStep], text: str, before: str) -> list[MetaStep]:
    step = order[_index(order, text)]
    rest = _without(order, text)
    j = _index(rest, before)
    return rest[:j] + [step] + rest[j:]


def _move_after(order: list[MetaStep], text: str, after: str) -> list[MetaStep]:
    step = order[_index(order, text)]
    rest = _without(order, text)
    j = _index(rest, after) + 1
    return rest[:j] + [step] + rest[j:]


def test_valid_order_passes() -> None:
    assert check_order(SWAPPED, rank=0, min_gap=3, reference=BASE) == []
    assert check_order(BASE, rank=0, min_gap=4) == []  # nothing eligible at 4: nothing to swap


def test_drop_a_swap_step() -> None:
    assert _rules(_without(SWAPPED, "0SWAP_WAIT_OFFLOAD1")) == {OrderRule.MISSING_SWAP_STEP}


def test_duplicate_a_swap_step() -> None:
    broken = _move(SWAPPED, "0SWAP_WAIT_LOAD1", "0B1")
    broken.insert(_index(broken, "0B1"), MetaStep(StepKind.SWAP_WAIT_LOAD, 0, 1))
    assert _rules(broken) == {OrderRule.DUPLICATE_SWAP_STEP}


def test_wait_load_after_backward() -> None:
    broken = _move_after(SWAPPED, "0SWAP_WAIT_LOAD0", "0B0")
    assert OrderRule.LOAD_AFTER_CONSUMER in _rules(broken)


def test_wait_load_too_early() -> None:
    # Before the compute slot that precedes the consumer: the next compute is not the consumer.
    broken = _move(SWAPPED, "0SWAP_WAIT_LOAD1", "0B0")
    broken = _move(broken, "0SWAP_LAUNCH_LOAD1", "0SWAP_WAIT_LOAD1")
    assert _rules(broken) == {OrderRule.LOAD_NOT_AT_CONSUMER}


def test_offload_before_forward() -> None:
    broken = _move(SWAPPED, "0SWAP_LAUNCH_OFFLOAD1", "0F1")
    assert OrderRule.OFFLOAD_BEFORE_FORWARD in _rules(broken)


def test_steps_out_of_order() -> None:
    broken = _move(SWAPPED, "0SWAP_LAUNCH_LOAD0", "0SWAP_WAIT_OFFLOAD0")
    assert OrderRule.SWAP_STEP_ORDER in _rules(broken)


def test_wait_offload_without_compute_between() -> None:
    broken = _move(SWAPPED, "0SWAP_WAIT_OFFLOAD0", "0SEND_F0")
    assert OrderRule.OFFLOAD_NOT_COVERED in _rules(broken)


def test_swap_step_inside_batch() -> None:
    i = _index(SWAPPED, "0RECV_B1")
    bad = MetaStep(StepKind.BATCH_SEND_RECV, None, None, (SWAPPED[i], MetaStep(StepKind.SWAP_WAIT_LOAD, 0, 0)))
    broken = _without(SWAPPED[:i] + [bad] + SWAPPED[i + 1 :], "0SWAP_WAIT_LOAD0")
    rules = _rules(broken)
    assert OrderRule.SWAP_IN_CONTAINER in rules
    assert OrderRule.MISSING_SWAP_STEP in rules  # the top-level WAIT_LOAD0 is gone


def test_p2p_order_changed() -> None:
    broken = _move(SWAPPED, "0RECV_B1", "0RECV_B0")
    assert {OrderRule.P2P_ORDER_CHANGED, OrderRule.ORDER_CHANGED} <= _rules(broken)
    # moving a send across a compute keeps the P2P sequence but still changes the order
    assert _rules(_move(SWAPPED, "0SEND_F1", "0F1")) == {OrderRule.ORDER_CHANGED}


def test_other_step_changed() -> None:
    broken = [MetaStep(StepKind.FSDP_UNSHARD, 5)] + SWAPPED
    assert _rules(broken) == {OrderRule.ORDER_CHANGED}


def test_ineligible_chunk_swapped() -> None:
    # at min_gap 4 no chunk is eligible: every swap step is for a chunk that must stay resident
    rules = _rules(SWAPPED, min_gap=4)
    assert rules == {OrderRule.NOT_CHOSEN_SWAPPED}


def test_chosen_subset_is_strict() -> None:
    only = inject_swap_steps(BASE, min_gap=3, only=[(0, 1)])
    assert check_order(only, min_gap=3, swapped=[(0, 1)], reference=BASE) == []
    # the same order judged against "every eligible chunk": chunks 0 and 2 are missing
    missing = {(v.stage, v.micro) for v in check_order(only, min_gap=3) if v.rule is OrderRule.MISSING_SWAP_STEP}
    assert missing == {(0, 0), (0, 2)}
    # a chosen chunk that is not eligible is itself a violation
    assert _rules(only, swapped=[(0, 1)], min_gap=4) >= {OrderRule.CHOSEN_INELIGIBLE}
    with pytest.raises(ValueError, match="gap 3 < min_gap 4"):
        inject_swap_steps(BASE, min_gap=4, only=[(0, 1)])
    with pytest.raises(ValueError, match="no forward"):
        inject_swap_steps(BASE, min_gap=3, only=[(5, 1)])


def test_unknown_chunk() -> None:
    broken = SWAPPED + [MetaStep(StepKind.SWAP_WAIT_LOAD, 9, 9)]
    assert OrderRule.UNKNOWN_CHUNK in _rules(broken)


def test_bwd_weight_never_loads() -> None:
    base = parse_order("1F0 1F1 1F2 1F3 1I0 1W0 1I1 1W1 1I2 1W2 1I3 1W3")
    good = inject_swap_steps(base, min_gap=4)
    assert check_order(good, min_gap=4, reference=base) == []
    assert sum(1 for s in good if s.kind is StepKind.SWAP_WAIT_LOAD and s.micro == 0) == 1
    # chunk 0's wait moved to right before its W: the consumer I already ran without it
    broken = _move(good, "1SWAP_WAIT_LOAD0", "1W0")
    assert OrderRule.LOAD_AFTER_CONSUMER in {v.rule for v in check_order(broken, min_gap=4, reference=base)}
    # a second load wait aimed at the W
    extra = _move(good, "1SWAP_WAIT_LOAD0", "1I0")
    extra.insert(_index(extra, "1W0"), MetaStep(StepKind.SWAP_WAIT_LOAD, 1, 0))
    assert OrderRule.DUPLICATE_SWAP_STEP in {v.rule for v in check_order(extra, min_gap=4)}


def test_weight_load_rule() -> None:
    order = parse_order(
        "1F0 1SWAP_LAUNCH_OFFLOAD0 1F1 1SWAP_WAIT_OFFLOAD0 1F2 1SWAP_LAUNCH_LOAD0 1F3 "
        "1SWAP_WAIT_LOAD0 1W0 1I0"
    )
    assert {v.rule for v in check_order(order, min_gap=4)} == {OrderRule.WEIGHT_LOADS}


def test_fsdp_load_order() -> None:
    kw = dict(num_ranks=2, stages_per_rank=2, num_microbatches=4, fsdp=True)
    ref = build_rank_orders("interleaved-1f1b", **kw)[0]
    good = build_rank_orders("interleaved-1f1b", swap=True, **kw)[0]
    assert check_order(good, rank=0, reference=ref) == []
    # chunk (0,0): LAUNCH_LOAD0 → 0UNSHARD → 2F2 → WAIT_LOAD0 → 0B0. Move the launch after the unshard.
    texts = [repr(s) for s in good]
    unshard = texts.index("0UNSHARD", texts.index("0SWAP_LAUNCH_LOAD0"))
    broken = _without(good, "0SWAP_LAUNCH_LOAD0")
    broken.insert(unshard, MetaStep(StepKind.SWAP_LAUNCH_LOAD, 0, 0))
    assert {v.rule for v in check_order(broken, rank=0, reference=ref)} == {OrderRule.FSDP_LOAD_ORDER}
    # chunk (0,3) stays unsharded. Default ("cover"): its load is hidden by the compute
    # preceding 0B3, like a stage without FSDP, and not started any earlier.
    early = _move(good, "0SWAP_LAUNCH_LOAD3", "2B3")
    assert {v.rule for v in check_order(early, rank=0, reference=ref)} == {OrderRule.LOAD_NOT_AT_COVER_POINT}
    # "delay" (the design document's rule): no compute between the launch and the wait.
    delayed = build_rank_orders("interleaved-1f1b", swap=True, unsharded_load="delay", **kw)[0]
    assert check_order(delayed, rank=0, reference=ref, unsharded_load="delay") == []
    assert check_order(delayed, rank=0, reference=ref) != []  # not at the cover point
    early = _move(delayed, "0SWAP_LAUNCH_LOAD3", "0B2")
    assert {v.rule for v in check_order(early, rank=0, reference=ref, unsharded_load="delay")} == {
        OrderRule.FSDP_LOAD_ORDER
    }


def test_malformed_step_reported_not_raised() -> None:
    broken = SWAPPED + [MetaStep(StepKind.FWD, None, 1)]
    assert OrderRule.MALFORMED_STEP in _rules(broken)


def test_error_message_has_where_rule_and_table() -> None:
    broken = _without(SWAPPED, "0SWAP_WAIT_OFFLOAD1")
    with pytest.raises(OrderError) as info:
        assert_valid_order(broken, rank=0, min_gap=3, reference=BASE)
    text = str(info.value)
    assert "rank 0, step 3 (stage 0, micro 1): [missing-swap-step]" in text
    assert "<-- missing-swap-step" in text
    assert "0SWAP_LAUNCH_OFFLOAD0" in text  # the order is printed
    assert len(info.value.violations) == 1
    table = format_order_table(SWAPPED)
    assert table.splitlines()[1].split() == ["0", "0F0"]


def test_find_swap_chunks_reports_gaps() -> None:
    chunks = find_swap_chunks(BASE, min_gap=3)
    assert [(c.stage, c.micro, c.forward_index, c.backward_index, c.gap, c.eligible) for c in chunks] == [
        (0, 0, 0, 3, 3, True),
        (0, 1, 1, 4, 3, True),
        (0, 2, 2, 5, 3, True),
    ]
    assert [(c.forward_step, c.backward_step) for c in chunks] == [(0, 7), (2, 9), (4, 11)]
    assert not any(c.eligible for c in find_swap_chunks(BASE))
    with pytest.raises(ValueError, match="min_gap must be >= 2"):
        find_swap_chunks(BASE, min_gap=1)
    assert strip_swap_steps(SWAPPED) == BASE


def test_anchor_analysis_is_separate_from_the_rewrite() -> None:
    chunk1 = [c for c in find_swap_chunks(BASE, min_gap=3) if c.key == (0, 1)]
    anchors = swap_anchors(BASE, chunk1)
    # F1 at 2 → offload launched before 3 (0SEND_F1); wait before slot 3 (0B0 at 7);
    # load launched before the slot preceding 0B1 (0B0 at 7), waited right before 0B1 (9).
    assert [(a.position, repr(a.step)) for a in anchors] == [
        (3, "0SWAP_LAUNCH_OFFLOAD1"),
        (7, "0SWAP_WAIT_OFFLOAD1"),
        (7, "0SWAP_LAUNCH_LOAD1"),
        (9, "0SWAP_WAIT_LOAD1"),
    ]
    assert apply_swap_anchors(BASE, anchors) == inject_swap_steps(BASE, min_gap=3, only=[(0, 1)])
    with pytest.raises(ValueError, match="position outside"):
        apply_swap_anchors(BASE, [SwapAnchor(99, anchors[0].step)])


# GPipe rank 0 of 2, 5 micro-batches, min_gap 4: every chunk has gap 5. Chunk 0's anchors:
# LAUNCH_OFFLOAD right after 0F0, WAIT_OFFLOAD right before 0F2 (after 0F1 and its send),
# LAUNCH_LOAD right before 0F4 (the last slot ahead of 0B0), WAIT_LOAD right before 0B0.
BASE5 = parse_order(
    "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0F3 0SEND_F3 0F4 0SEND_F4 "
    "0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2 0RECV_B3 0B3 0RECV_B4 0B4"
)
SWAPPED5 = inject_swap_steps(BASE5, min_gap=4)


def _drift(order: list[MetaStep], moves: list[tuple[str, str, str]]) -> list[MetaStep]:
    for how, text, anchor in moves:
        order = (_move if how == "before" else _move_after)(order, text, anchor)
    return order


@pytest.mark.parametrize(
    ("moves", "rule"),
    [
        # offload launched one slot late (its wait moved along, so only the launch is wrong)
        ([("after", "0SWAP_LAUNCH_OFFLOAD0", "0F1"), ("before", "0SWAP_WAIT_OFFLOAD0", "0F3")],
         OrderRule.OFFLOAD_NOT_AT_FORWARD),
        # offload waited one slot late: two compute slots inside the offload window
        ([("before", "0SWAP_WAIT_OFFLOAD0", "0F3")], OrderRule.WAIT_OFFLOAD_LATE),
        # offload waited before the comm block that follows the first intervening compute
        ([("after", "0SWAP_WAIT_OFFLOAD0", "0F1")], OrderRule.WAIT_OFFLOAD_LATE),
        # load launched one slot early: the activation is back while 0F3 still runs
        ([("before", "0SWAP_LAUNCH_LOAD0", "0F3")], OrderRule.LOAD_NOT_AT_COVER_POINT),
        # load launched after the last cover slot: nothing hides the copy
        ([("before", "0SWAP_LAUNCH_LOAD0", "0SWAP_WAIT_LOAD0")], OrderRule.LOAD_NOT_AT_COVER_POINT),
        # load launched before the comm block ahead of the cover slot
        ([("after", "0SWAP_LAUNCH_LOAD0", "0F3")], OrderRule.LOAD_NOT_AT_COVER_POINT),
    ],
)
def test_anchor_drift_is_caught(moves: list[tuple[str, str, str]], rule: OrderRule) -> None:
    assert check_order(SWAPPED5, rank=0, min_gap=4, reference=BASE5) == []
    broken = _drift(SWAPPED5, moves)
    assert strip_swap_steps(broken) == BASE5  # only swap steps moved
    violations = check_order(broken, rank=0, min_gap=4, reference=BASE5)
    assert {v.rule for v in violations} == {rule}
    assert {(v.stage, v.micro) for v in violations} == {(0, 0)}


def test_fsdp_anchor_drift_is_caught() -> None:
    kw = dict(num_ranks=2, stages_per_rank=2, num_microbatches=4, fsdp=True)
    ref = build_rank_orders("interleaved-1f1b", **kw)[0]
    good = build_rank_orders("interleaved-1f1b", swap=True, **kw)[0]
    # 0F1 → LAUNCH_OFFLOAD1 → 0RESHARD: launching after the reshard breaks FWD → LAUNCH → RESHARD
    late = _move_after(good, "0SWAP_LAUNCH_OFFLOAD1", "0RESHARD")
    assert {(v.rule, v.micro) for v in check_order(late, rank=0, reference=ref)} == {
        (OrderRule.OFFLOAD_NOT_AT_FORWARD, 1)
    }
    # chunk (0,0) loads right before the lookahead 0UNSHARD; one compute slot earlier is too early
    early = _move(good, "0SWAP_LAUNCH_LOAD0", "2SWAP_WAIT_LOAD1")
    assert {(v.rule, v.micro) for v in check_order(early, rank=0, reference=ref)} == {
        (OrderRule.FSDP_LOAD_ORDER, 0)
    }


def test_check_order_does_not_reuse_the_swap_pass() -> None:
    # The validator must judge the pass, not repeat it: nothing the swap pass defines (chunk
    # finder, anchor placement, injection) may be used by check_order; only the default gap.
    from hyper_offload.passes.pipeline import check_order as validator
    from hyper_offload.passes.pipeline import swap as swap_pass

    defined_by_pass = {
        id(value) for value in vars(swap_pass).values() if getattr(value, "__module__", None) == swap_pass.__name__
    }
    reused = sorted(name for name, value in vars(validator).items() if id(value) in defined_by_pass)
    assert reused == []
    assert defined_by_pass  # the probe itself sees the pass's functions


# One stage, dx/dw split: W of micro 0 runs five slots after its I (a dW window).
SPLIT_BASE = parse_order("0F0 0F1 0I0 0F2 0I1 0F3 0I2 0W0 0I3 0W1 0W2 0W3")
SPLIT_SWAPPED = inject_swap_steps(SPLIT_BASE, min_gap=4, only=())


def _split_rules(order: list[MetaStep], **kwargs: object) -> set[OrderRule]:
    return {v.rule for v in check_order(order, rank=0, min_gap=4, swapped=(), reference=SPLIT_BASE, **kwargs)}  # type: ignore[arg-type]


def test_dw_windows_are_placed_by_the_activation_rules_and_accepted() -> None:
    dw = [repr(s) for s in SPLIT_SWAPPED if s.is_swap and s.micro == 0]
    assert dw == ["0DW_LAUNCH_OFFLOAD0", "0DW_WAIT_OFFLOAD0", "0DW_LAUNCH_LOAD0", "0DW_WAIT_LOAD0"]
    texts = [repr(s) for s in SPLIT_SWAPPED]
    assert texts[texts.index("0I0") + 1] == "0DW_LAUNCH_OFFLOAD0"  # right after its BWD_INPUT
    assert texts[texts.index("0W0") - 1] == "0DW_WAIT_LOAD0"  # right before its BWD_WEIGHT
    assert _split_rules(SPLIT_SWAPPED) == set()


def test_a_dw_wait_load_after_its_weight_step_is_caught_and_named() -> None:
    broken = list(SPLIT_SWAPPED)
    wait = _index(broken, "0DW_WAIT_LOAD0")
    step = broken.pop(wait)
    broken.insert(_index(broken, "0W0") + 1, step)
    violations = check_order(broken, rank=0, min_gap=4, swapped=(), reference=SPLIT_BASE)
    assert OrderRule.LOAD_AFTER_CONSUMER in {v.rule for v in violations}
    message = next(v.message for v in violations if v.rule is OrderRule.LOAD_AFTER_CONSUMER)
    assert message.startswith("dW state:") and "DW_WAIT_LOAD" in message and "BWD_WEIGHT" in message


def test_a_dw_offload_before_its_input_step_and_a_missing_dw_step_are_caught() -> None:
    early = list(SPLIT_SWAPPED)
    launch = early.pop(_index(early, "0DW_LAUNCH_OFFLOAD0"))
    early.insert(_index(early, "0I0"), launch)
    assert OrderRule.OFFLOAD_BEFORE_FORWARD in _split_rules(early)
    dropped = [s for s in SPLIT_SWAPPED if repr(s) != "0DW_LAUNCH_LOAD0"]
    assert OrderRule.MISSING_SWAP_STEP in _split_rules(dropped)


def test_the_chosen_dw_set_is_checked_like_the_activation_set() -> None:
    assert OrderRule.NOT_CHOSEN_SWAPPED in _split_rules(SPLIT_SWAPPED, weight_swapped=())
    plain = inject_swap_steps(SPLIT_BASE, min_gap=4, only=(), weight_swap=False)
    assert OrderRule.MISSING_SWAP_STEP in _split_rules(plain)  # every eligible window by default
    assert _split_rules(plain, weight_swapped=()) == set()
    assert OrderRule.CHOSEN_INELIGIBLE in _split_rules(plain, weight_swapped=[(0, 3)])
