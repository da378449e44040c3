"""Order construction against torch: action conversion, GPipe / 1F1B vs torch's runtime, layouts."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import Schedule1F1B, _Action

from hyper_offload.passes.pipeline import (
    MetaStep,
    StepKind,
    build_rank_orders,
    format_order,
    layout_for,
    parse_order,
    torch_pipeline_order,
)
from hyper_offload.passes.pipeline.build import compute_orders, fuse_overlap_b_f, split_dx_dw
from hyper_offload.passes.pipeline.torch_actions import from_torch_actions, to_torch_actions


class _RecordingStage:
    """Enough of a PipelineStage for Schedule1F1B._step_microbatches: records compute calls."""

    def __init__(self, stage_index: int, num_stages: int, log: list[str]) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.log = log

    def forward_one_chunk(self, mb: int, *args: object, **kwargs: object) -> None:
        self.log.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb: int, **kwargs: object) -> None:
        self.log.append(f"{self.stage_index}B{mb}")

    def get_fwd_recv_ops(self, mb: int) -> list:
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def perform_reduce_grad(self, scale: int) -> None:
        pass


class _Recording1F1B(Schedule1F1B):
    """torch's 1F1B runtime loop with stage initialisation (shape inference, P2P) skipped."""

    def _initialize_stage(self, *args: object, **kwargs: object) -> None:
        pass


def _torch_1f1b_runtime_sequence(rank: int, num_ranks: int, num_microbatches: int) -> list[str]:
    log: list[str] = []
    schedule = _Recording1F1B(_RecordingStage(rank, num_ranks, log), num_microbatches)  # type: ignore[arg-type]
    schedule._step_microbatches()
    return log


@pytest.mark.parametrize(("num_ranks", "num_microbatches"), [(1, 3), (2, 4), (4, 8), (4, 4), (3, 7)])
def test_1f1b_matches_torch_runtime(num_ranks: int, num_microbatches: int) -> None:
    orders = compute_orders("1f1b", num_ranks=num_ranks, stages_per_rank=1, num_microbatches=num_microbatches)
    for rank in range(num_ranks):
        assert format_order(orders[rank]) == _torch_1f1b_runtime_sequence(rank, num_ranks, num_microbatches)


def test_torch_1f1b_pipeline_order_is_the_malformed_one() -> None:
    # Why we build 1F1B ourselves: torch 2.13's order drops F0 on the last rank.
    raw = torch_pipeline_order("1f1b", num_ranks=4, stages_per_rank=1, num_microbatches=8)
    last = [str(a) for a in raw[3] if a is not None]
    assert "3F0" not in last
    ours = compute_orders("1f1b", num_ranks=4, stages_per_rank=1, num_microbatches=8)
    assert "3F0" in format_order(ours[3])


def test_gpipe_matches_torch_order() -> None:
    raw = torch_pipeline_order("gpipe", num_ranks=3, stages_per_rank=1, num_microbatches=5)
    ours = compute_orders("gpipe", num_ranks=3, stages_per_rank=1, num_microbatches=5)
    for rank, actions in raw.items():
        torch_compute = [s for s in from_torch_actions(actions) if s.is_compute_slot]
        assert ours[rank] == torch_compute


@pytest.mark.parametrize(
    ("schedule", "ranks", "v", "m"),
    [
        ("interleaved-1f1b", 4, 2, 8),
        ("interleaved-1f1b", 2, 3, 4),
        ("interleaved-zb", 4, 2, 8),
        ("zbv", 4, 2, 8),
        ("dualpipev", 4, 2, 8),
    ],
)
def test_torch_orders_convert_both_ways(schedule: str, ranks: int, v: int, m: int) -> None:
    raw = torch_pipeline_order(schedule, num_ranks=ranks, stages_per_rank=v, num_microbatches=m)
    layout = layout_for(schedule, num_ranks=ranks, stages_per_rank=v)
    for rank, actions in raw.items():
        order = from_torch_actions(actions)
        expected = [a for a in actions if a is not None]
        assert to_torch_actions(order) == expected
        assert [repr(s) for s in order] == [str(a) for a in expected]  # same compact text as torch
        # every stage a rank computes is one the layout puts there, and every chunk runs F and a backward
        stages = {leaf.stage for s in order for leaf in s.leaves()}
        assert stages == set(layout.stages_of(rank))
        fwd = {leaf.chunk for s in order for leaf in s.leaves() if leaf.kind is StepKind.FWD}
        bwd = {leaf.chunk for s in order for leaf in s.leaves() if leaf.kind in (StepKind.BWD, StepKind.BWD_INPUT)}
        assert fwd == bwd == {(s, mb) for s in stages for mb in range(m)}


def test_torch_overlap_composite_converts() -> None:
    action = _Action.from_str("(0F7;7B3)OVERLAP_F_B")
    (step,) = from_torch_actions([None, action])
    assert repr(step) == "(0F7;7B3)OVERLAP_F_B" and step.stage is None
    assert to_torch_actions([step]) == [_Action(-1, action.computation_type, None, action.sub_actions)]


def test_to_torch_rejects_our_own_kinds() -> None:
    with pytest.raises(ValueError, match="no action for SWAP_WAIT_LOAD"):
        to_torch_actions(parse_order("0SWAP_WAIT_LOAD1"))
    with pytest.raises(ValueError, match="BATCH_SEND_RECV"):
        to_torch_actions(parse_order("(0SEND_F0)BATCH_SEND_RECV"))


def test_layouts() -> None:
    loop = layout_for("interleaved-1f1b", num_ranks=4, stages_per_rank=2)
    assert [loop.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    v = layout_for("zbv", num_ranks=4, stages_per_rank=2)
    assert [v.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert v.stages_of(0) == (0, 7)


@pytest.mark.parametrize(
    ("schedule", "v", "why"),
    [("gpipe", 2, "one stage per rank"), ("zbv", 1, "needs stages_per_rank=2"), ("nope", 1, "unknown schedule")],
)
def test_layout_errors(schedule: str, v: int, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        build_rank_orders(schedule, num_ranks=2, stages_per_rank=v, num_microbatches=4)


def test_v_shape_has_no_p2p_between_local_stages() -> None:
    # On ZBV rank 3 holds stages 3 and 4: the 3→4 hand-off stays on the rank.
    orders = build_rank_orders("zbv", num_ranks=4, stages_per_rank=2, num_microbatches=4)
    texts = format_order(orders[3])
    assert "3SEND_F0" not in texts and "4RECV_F0" not in texts
    assert "4SEND_B0" not in texts and "3RECV_B0" not in texts
    assert "2RECV_F0" not in texts  # stage 2 is not on rank 3
    assert "3RECV_F0" in texts and "4SEND_F0" in texts


def test_overlap_and_dxdw_variants() -> None:
    order = parse_order("1F0 1B0 1F1 1B1")
    fused = fuse_overlap_b_f(order)
    assert format_order(fused) == ["1F0", "(1B0;1F1)OVERLAP_B_F", "1B1"]
    assert format_order(split_dx_dw(fused)) == ["1F0", "(1I0;1F1)OVERLAP_B_F", "1W0", "1I1", "1W1"]
    assert format_order(split_dx_dw(parse_order("0F0 0B0"))) == ["0F0", "0B0"]  # stage 0 keeps BWD
    assert split_dx_dw([MetaStep(StepKind.BWD_INPUT, 1, 0)]) == [MetaStep(StepKind.BWD_INPUT, 1, 0)]


@pytest.mark.parametrize(
    "text",
    ["0F1", "1I2", "1W2", "2B0", "0UNSHARD", "0RESHARD", "3SEND_F1", "3RECV_F1", "3SEND_B1", "3RECV_B1",
     "2REDUCE_GRAD", "(0F7;7B3)OVERLAP_F_B"],
)
def test_every_torch_kind_converts(text: str) -> None:
    action = _Action.from_str(text)
    (step,) = from_torch_actions([action])
    assert repr(step) == str(action)
    assert to_torch_actions([step])[0].computation_type is action.computation_type


def test_build_logs_each_pass(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("DEBUG", logger="hyper_offload.passes.pipeline.build"):
        build_rank_orders("gpipe", num_ranks=2, stages_per_rank=1, num_microbatches=5, fsdp=True, swap=True)
    text = caplog.text
    assert "add_p2p -> inject_fsdp_steps -> rewrite_transport[plain] -> inject_swap_steps[min_gap=4]" in text
    # 10 F+SEND_F, 10 RECV_B+B, UNSHARD, REDUCE_GRAD, RESHARD; then 4 swap steps for each of 5 chunks
    assert "rank 0: inject_fsdp_steps: 20 -> 23 steps" in text
    assert "rank 0: inject_swap_steps[min_gap=4]: 23 -> 43 steps" in text


def test_swap_only_restricts_per_rank() -> None:
    kw = dict(num_ranks=2, stages_per_rank=1, num_microbatches=6, swap=True)
    orders = build_rank_orders("gpipe", swap_only={0: [(0, 1)]}, **kw)
    offloaded = {
        r: {s.chunk for s in o if s.kind is StepKind.SWAP_LAUNCH_OFFLOAD} for r, o in orders.items()
    }
    assert offloaded[0] == {(0, 1)}
    assert offloaded[1] == {(1, m) for m in range(6)}  # absent rank: every eligible chunk (gap 6)
    with pytest.raises(ValueError, match="no forward"):
        build_rank_orders("gpipe", swap_only={0: [(1, 0)]}, **kw)


def test_conversion_reads_kinds_by_name_not_by_value() -> None:
    # torch <= 2.10 numbers its computation types (FORWARD = 1, ...) and older actions have no
    # sub_actions field; the conversion must not depend on either.
    from enum import Enum
    from typing import NamedTuple

    class OldComputationType(Enum):
        FORWARD = 1
        BACKWARD_INPUT = 2
        BACKWARD_WEIGHT = 3
        SEND_F = 6
        FULL_BACKWARD = 10

    class OldAction(NamedTuple):
        stage_index: int
        computation_type: OldComputationType
        microbatch_index: int | None = None

    old = [OldAction(1, OldComputationType.FORWARD, 3), None, OldAction(1, OldComputationType.FULL_BACKWARD, 3),
           OldAction(2, OldComputationType.BACKWARD_INPUT, 0), OldAction(2, OldComputationType.BACKWARD_WEIGHT, 0),
           OldAction(0, OldComputationType.SEND_F, 4)]
    steps = from_torch_actions(old)  # type: ignore[arg-type]
    assert format_order(steps) == ["1F3", "1B3", "2I0", "2W0", "0SEND_F4"]
    assert [str(a) for a in to_torch_actions(steps)] == format_order(steps)  # back to this torch's actions

    class Unknown(Enum):
        SEND_F_RECV_B = 10

    with pytest.raises(ValueError, match="SEND_F_RECV_B has no MetaStep kind"):
        from_torch_actions([OldAction(0, Unknown.SEND_F_RECV_B, 0)])  # type: ignore[list-item]


@pytest.mark.parametrize(("schedule", "v"), [("interleaved-1f1b", 2), ("zbv", 2), ("dualpipev", 2), ("1f1b", 1)])
def test_our_orders_with_p2p_and_fsdp_convert_to_torch_and_back(schedule: str, v: int) -> None:
    # Before the transport and swap passes every step has a torch action, and torch prints it
    # the way we do (torch's lowering tests compare exactly these strings).
    orders = build_rank_orders(schedule, num_ranks=2, stages_per_rank=v, num_microbatches=4, fsdp=True)
    for order in orders.values():
        actions = to_torch_actions(order)
        assert [str(a) for a in actions] == format_order(order)
        assert from_torch_actions(actions) == order
