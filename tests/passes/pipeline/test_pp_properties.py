"""Property tests over schedule × ranks × virtual stages × micro-batches × min-gap × passes."""

from __future__ import annotations

from typing import Any

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hyper_offload.passes.pipeline import (
    MetaStep,
    OrderRule,
    StepKind,
    build_rank_orders,
    check_order,
    layout_for,
)
from hyper_offload.passes.pipeline.swap import (
    find_swap_chunks,
    find_weight_windows,
    inject_swap_steps,
    strip_swap_steps,
)
from hyper_offload.passes.pipeline.execution import check_execution

_V_CHOICES = {
    "gpipe": [1],
    "1f1b": [1],
    "interleaved-1f1b": [1, 2, 3],
    "interleaved-zb": [1, 2],
    "zbv": [2],
    "dualpipev": [2],
}


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    schedule = draw(st.sampled_from(sorted(_V_CHOICES)))
    return dict(
        schedule=schedule,
        num_ranks=draw(st.integers(1, 4)),
        stages_per_rank=draw(st.sampled_from(_V_CHOICES[schedule])),
        num_microbatches=draw(st.integers(1, 8)),
        fsdp=draw(st.booleans()),
        transport=draw(st.sampled_from(["plain", "batch", "boundary"])),
        overlap=draw(st.booleans()),
        dxdw_split=draw(st.booleans()),
        min_gap=draw(st.integers(2, 6)),
    )


def _build(cfg: dict[str, Any], **extra: Any) -> dict[int, list[MetaStep]]:
    cfg = dict(cfg, **extra)
    schedule = cfg.pop("schedule")
    try:
        return build_rank_orders(schedule, **cfg)
    except ValueError as exc:
        assume("rejects" not in str(exc))  # a shape torch itself refuses
        raise


def _gaps_by_hand(order: list[MetaStep]) -> dict[tuple[int, int], int]:
    """gap = slot of first BWD/BWD_INPUT - slot of FWD, composites counting once."""
    fwd: dict[tuple[int, int], int] = {}
    bwd: dict[tuple[int, int], int] = {}
    slots = [s for s in order if s.kind.name in ("FWD", "BWD", "BWD_INPUT", "BWD_WEIGHT") or s.kind.name.startswith("OVERLAP")]
    for i, step in enumerate(slots):
        for leaf in step.leaves():
            if leaf.kind is StepKind.FWD:
                fwd[(leaf.stage, leaf.micro)] = i
            elif leaf.kind in (StepKind.BWD, StepKind.BWD_INPUT):
                bwd.setdefault((leaf.stage, leaf.micro), i)
    return {k: bwd[k] - fwd[k] for k in fwd if k in bwd}


def _weight_gaps_by_hand(order: list[MetaStep]) -> dict[tuple[int, int], int]:
    """dW gap = slot of BWD_WEIGHT - slot of BWD_INPUT, composites counting once."""
    first: dict[StepKind, dict[tuple[int, int], int]] = {StepKind.BWD_INPUT: {}, StepKind.BWD_WEIGHT: {}}
    slots = [s for s in order if s.is_compute_slot]
    for i, step in enumerate(slots):
        for leaf in step.leaves():
            if leaf.kind in first:
                first[leaf.kind].setdefault((leaf.stage, leaf.micro), i)
    inputs, weights = first[StepKind.BWD_INPUT], first[StepKind.BWD_WEIGHT]
    return {k: weights[k] - inputs[k] for k in inputs if k in weights}


@settings(max_examples=120, deadline=None)
@given(configs())
def test_swap_pass_invariants(cfg: dict[str, Any]) -> None:
    reference = _build(cfg)
    swapped = _build(cfg, swap=True)
    layout = layout_for(cfg["schedule"], num_ranks=cfg["num_ranks"], stages_per_rank=cfg["stages_per_rank"])
    for rank, order in swapped.items():
        assert check_order(order, rank=rank, min_gap=cfg["min_gap"], reference=reference[rank]) == []
        assert strip_swap_steps(order) == reference[rank]
        gaps = _gaps_by_hand(reference[rank])
        chunks = find_swap_chunks(reference[rank], min_gap=cfg["min_gap"])
        assert {c.key: c.gap for c in chunks} == gaps
        assert all(c.eligible == (c.gap >= cfg["min_gap"]) for c in chunks)
        offloaded = {s.chunk for s in order if s.kind is StepKind.SWAP_LAUNCH_OFFLOAD}
        assert offloaded == {k for k, g in gaps.items() if g >= cfg["min_gap"]}
        weight_gaps = _weight_gaps_by_hand(reference[rank])
        assert {c.key: c.gap for c in find_weight_windows(reference[rank], min_gap=cfg["min_gap"])} == weight_gaps
        weight_offloaded = {s.chunk for s in order if s.kind is StepKind.DW_LAUNCH_OFFLOAD}
        assert weight_offloaded == {k for k, g in weight_gaps.items() if g >= cfg["min_gap"]}
        for step in order:  # swap steps only at top level
            assert not any(leaf.is_swap for leaf in step.leaves()) or not step.is_composite
    assert check_execution(swapped, layout) == []


@settings(max_examples=60, deadline=None)
@given(configs(), st.data())
def test_chosen_subset(cfg: dict[str, Any], data: st.DataObject) -> None:
    reference = _build(cfg)
    gap = cfg["min_gap"]
    for rank, base in reference.items():
        eligible = sorted(c.key for c in find_swap_chunks(base, min_gap=gap) if c.eligible)
        weight_eligible = sorted(c.key for c in find_weight_windows(base, min_gap=gap) if c.eligible)
        chosen = data.draw(st.sets(st.sampled_from(eligible)) if eligible else st.just(set()))
        weight = data.draw(st.sets(st.sampled_from(weight_eligible)) if weight_eligible else st.just(set()))
        order = inject_swap_steps(base, min_gap=gap, only=chosen, weight_only=weight)
        kw = dict(rank=rank, min_gap=gap, reference=base)
        assert check_order(order, swapped=chosen, weight_swapped=weight, **kw) == []
        judged_as_all = check_order(order, **kw)
        assert (judged_as_all == []) == (set(chosen) == set(eligible) and set(weight) == set(weight_eligible))


@settings(max_examples=80, deadline=None)
@given(configs(), st.data())
def test_mutations_are_caught(cfg: dict[str, Any], data: st.DataObject) -> None:
    reference = _build(cfg)
    swapped = _build(cfg, swap=True)
    rank = data.draw(st.sampled_from(sorted(swapped)))
    order, base = swapped[rank], reference[rank]
    swap_positions = [i for i, s in enumerate(order) if s.is_swap]
    assume(swap_positions)
    kw = dict(rank=rank, min_gap=cfg["min_gap"], reference=base)
    mutation = data.draw(st.sampled_from(["drop", "late_wait", "early_offload", "early_load", "into_batch"]))
    if mutation == "drop":
        i = data.draw(st.sampled_from(swap_positions))
        broken = order[:i] + order[i + 1 :]
        expected = OrderRule.MISSING_SWAP_STEP
    elif mutation == "early_load":
        # launch the H2D one compute slot earlier than its anchor: the activation comes back early
        loads = (StepKind.SWAP_LAUNCH_LOAD, StepKind.DW_LAUNCH_LOAD)
        i = data.draw(st.sampled_from([p for p in swap_positions if order[p].kind in loads]))
        earlier = max(j for j in range(i) if order[j].is_compute_slot)
        broken = order[:earlier] + [order[i]] + order[earlier:i] + order[i + 1 :]
        rules = {v.rule for v in check_order(broken, **kw)}
        assert rules & {OrderRule.LOAD_NOT_AT_COVER_POINT, OrderRule.FSDP_LOAD_ORDER, OrderRule.SWAP_STEP_ORDER}
        return
    elif mutation == "late_wait":
        waits = (StepKind.SWAP_WAIT_LOAD, StepKind.DW_WAIT_LOAD)
        i = data.draw(st.sampled_from([p for p in swap_positions if order[p].kind in waits]))
        consumer = next(j for j in range(i + 1, len(order)) if order[j].is_compute_slot)
        broken = order[:i] + order[i + 1 : consumer + 1] + [order[i]] + order[consumer + 1 :]
        expected = OrderRule.LOAD_AFTER_CONSUMER
    elif mutation == "early_offload":
        launches = (StepKind.SWAP_LAUNCH_OFFLOAD, StepKind.DW_LAUNCH_OFFLOAD)
        i = data.draw(st.sampled_from([p for p in swap_positions if order[p].kind in launches]))
        fwd = max(j for j in range(i) if order[j].is_compute_slot)
        broken = order[:fwd] + [order[i]] + order[fwd:i] + order[i + 1 :]
        expected = OrderRule.OFFLOAD_BEFORE_FORWARD
    else:
        i = data.draw(st.sampled_from(swap_positions))
        container = MetaStep(StepKind.BATCH_SEND_RECV, None, None, (order[i],))
        broken = order[:i] + [container] + order[i + 1 :]
        expected = OrderRule.SWAP_IN_CONTAINER
    assert expected in {v.rule for v in check_order(broken, **kw)}
