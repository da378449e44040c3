"""Golden orders, written as strings the way torch's TestScheduleLowering writes them.

Every expected order below was derived by hand from the rules in the module docstrings of
build.py (P2P, FSDP's one-slot unshard lookahead, transport) and swap.py (anchors); the
derivation for the less obvious steps is in the comments.
"""

from __future__ import annotations

import pytest

from hyper_offload.passes.pipeline import (
    assert_valid_order,
    build_rank_orders,
    format_order,
    parse_order,
)
from hyper_offload.passes.pipeline.build import compute_orders, rewrite_transport
from hyper_offload.passes.pipeline.swap import strip_swap_steps


def _build(schedule: str, rank: int, **kwargs: object) -> list[str]:
    orders = build_rank_orders(schedule, **kwargs)  # type: ignore[arg-type]
    return format_order(orders[rank])


def _words(text: str) -> list[str]:
    return text.split()


# GPipe, 2 ranks × 3 micro-batches, min_gap 3: every chunk has F at slot m and B at slot 3+m.
GPIPE_R0 = """
0F0 0SWAP_LAUNCH_OFFLOAD0 0SEND_F0
0F1 0SWAP_LAUNCH_OFFLOAD1 0SEND_F1
0SWAP_WAIT_OFFLOAD0 0SWAP_LAUNCH_LOAD0
0F2 0SWAP_LAUNCH_OFFLOAD2 0SEND_F2 0RECV_B0
0SWAP_WAIT_OFFLOAD1 0SWAP_LAUNCH_LOAD1 0SWAP_WAIT_LOAD0
0B0 0RECV_B1
0SWAP_WAIT_OFFLOAD2 0SWAP_LAUNCH_LOAD2 0SWAP_WAIT_LOAD1
0B1 0RECV_B2
0SWAP_WAIT_LOAD2
0B2
"""
# Last stage: no SEND_F, no RECV_B; the offload of chunk 2 is launched right before 1B0.
GPIPE_R1 = """
1RECV_F0 1F0 1SWAP_LAUNCH_OFFLOAD0
1RECV_F1 1F1 1SWAP_LAUNCH_OFFLOAD1
1RECV_F2 1SWAP_WAIT_OFFLOAD0 1SWAP_LAUNCH_LOAD0
1F2 1SWAP_LAUNCH_OFFLOAD2 1SWAP_WAIT_OFFLOAD1 1SWAP_LAUNCH_LOAD1 1SWAP_WAIT_LOAD0
1B0 1SEND_B0 1SWAP_WAIT_OFFLOAD2 1SWAP_LAUNCH_LOAD2 1SWAP_WAIT_LOAD1
1B1 1SEND_B1 1SWAP_WAIT_LOAD2
1B2 1SEND_B2
"""


def test_gpipe_swap_plain() -> None:
    kw = dict(num_ranks=2, stages_per_rank=1, num_microbatches=3, swap=True, min_gap=3)
    assert _build("gpipe", 0, **kw) == _words(GPIPE_R0)
    assert _build("gpipe", 1, **kw) == _words(GPIPE_R1)


def test_gpipe_default_gap_swaps_nothing_at_gap_3() -> None:
    orders = build_rank_orders("gpipe", num_ranks=2, stages_per_rank=1, num_microbatches=3, swap=True)
    assert format_order(orders[0]) == [s for s in _words(GPIPE_R0) if "SWAP" not in s]


# 1F1B, 2 ranks × 4 micro-batches, batch transport: the fused containers are exactly the ones
# torch's Schedule1F1B runtime issues (fwd_send+bwd_recv on rank 0, bwd_send+fwd_recv on rank 1).
ONE_F_ONE_B_BATCH_R0 = """
0F0 (0SEND_F0)BATCH_SEND_RECV 0F1 (0SEND_F1;0RECV_B0)BATCH_SEND_RECV 0B0
0F2 (0SEND_F2;0RECV_B1)BATCH_SEND_RECV 0B1 0F3 (0SEND_F3;0RECV_B2)BATCH_SEND_RECV 0B2
(0RECV_B3)BATCH_SEND_RECV 0B3
"""
ONE_F_ONE_B_BATCH_R1 = """
(1RECV_F0)BATCH_SEND_RECV 1F0 1B0 (1SEND_B0;1RECV_F1)BATCH_SEND_RECV 1F1 1B1
(1SEND_B1;1RECV_F2)BATCH_SEND_RECV 1F2 1B2 (1SEND_B2;1RECV_F3)BATCH_SEND_RECV 1F3 1B3
(1SEND_B3)BATCH_SEND_RECV
"""
# Slots F0 F1 B0 F2 B1 F3 B2 B3: gaps 2, 3, 3, 2; min_gap 3 swaps chunks 1 and 2. Chunk 1's
# load cover point (before slot 3 = 0F2) equals its WAIT_OFFLOAD point, so both sit there.
ONE_F_ONE_B_BATCH_SWAP_R0 = """
0F0 (0SEND_F0)BATCH_SEND_RECV 0F1 0SWAP_LAUNCH_OFFLOAD1 (0SEND_F1;0RECV_B0)BATCH_SEND_RECV 0B0
0SWAP_WAIT_OFFLOAD1 0SWAP_LAUNCH_LOAD1 0F2 0SWAP_LAUNCH_OFFLOAD2 (0SEND_F2;0RECV_B1)BATCH_SEND_RECV
0SWAP_WAIT_LOAD1 0B1 0SWAP_WAIT_OFFLOAD2 0SWAP_LAUNCH_LOAD2 0F3 (0SEND_F3;0RECV_B2)BATCH_SEND_RECV
0SWAP_WAIT_LOAD2 0B2 (0RECV_B3)BATCH_SEND_RECV 0B3
"""


def test_1f1b_batch_transport() -> None:
    kw = dict(num_ranks=2, stages_per_rank=1, num_microbatches=4, transport="batch")
    assert _build("1f1b", 0, **kw) == _words(ONE_F_ONE_B_BATCH_R0)
    assert _build("1f1b", 1, **kw) == _words(ONE_F_ONE_B_BATCH_R1)
    assert _build("1f1b", 0, swap=True, min_gap=3, **kw) == _words(ONE_F_ONE_B_BATCH_SWAP_R0)


# dx/dw split on GPipe rank 1 (last stage), 3 micro-batches, min_gap 4. Slots:
# F0 F1 F2 I0 W0 I1 W1 I2 W2 → gaps (to BWD_INPUT) 3, 4, 5: chunks 1 and 2 swap. Loads are
# covered by the W before each I; no W ever waits for a load.
DXDW_R1 = """
1RECV_F0 1F0 1RECV_F1 1F1 1SWAP_LAUNCH_OFFLOAD1 1RECV_F2 1F2 1SWAP_LAUNCH_OFFLOAD2
1SWAP_WAIT_OFFLOAD1 1I0 1SEND_B0 1SWAP_WAIT_OFFLOAD2 1SWAP_LAUNCH_LOAD1 1W0
1SWAP_WAIT_LOAD1 1I1 1SEND_B1 1SWAP_LAUNCH_LOAD2 1W1 1SWAP_WAIT_LOAD2 1I2 1SEND_B2 1W2
"""
# Stage 0 keeps a plain BWD under dx/dw split.
DXDW_R0 = "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2"


def test_dxdw_split_swap() -> None:
    kw = dict(num_ranks=2, stages_per_rank=1, num_microbatches=3, dxdw_split=True, swap=True)
    assert _build("gpipe", 1, **kw) == _words(DXDW_R1)
    assert _build("gpipe", 0, **kw) == _words(DXDW_R0)


# Overlapped F/B, 1F1B, 2 ranks × 4 micro-batches, rank 0: F0 F1 (B0;F2) (B1;F3) B2 B3.
# Every gap is 2 slots (a composite counts once), so min_gap 2 swaps all four chunks.
OVERLAP_R0 = """
0F0 0SWAP_LAUNCH_OFFLOAD0 0SEND_F0 0F1 0SWAP_LAUNCH_OFFLOAD1 0SEND_F1 0RECV_B0
0SWAP_WAIT_OFFLOAD0 0SWAP_LAUNCH_LOAD0 0SWAP_WAIT_LOAD0 (0B0;0F2)OVERLAP_B_F
0SWAP_LAUNCH_OFFLOAD2 0SEND_F2 0RECV_B1
0SWAP_WAIT_OFFLOAD1 0SWAP_LAUNCH_LOAD1 0SWAP_WAIT_LOAD1 (0B1;0F3)OVERLAP_B_F
0SWAP_LAUNCH_OFFLOAD3 0SEND_F3 0RECV_B2
0SWAP_WAIT_OFFLOAD2 0SWAP_LAUNCH_LOAD2 0SWAP_WAIT_LOAD2 0B2 0RECV_B3
0SWAP_WAIT_OFFLOAD3 0SWAP_LAUNCH_LOAD3 0SWAP_WAIT_LOAD3 0B3
"""
# Rank 1 holds the last stage: its backwards receive nothing.
OVERLAP_R1 = """
1RECV_F0 1F0 1RECV_F1 (1B0;1F1)OVERLAP_B_F 1SEND_B0 1RECV_F2
(1B1;1F2)OVERLAP_B_F 1SEND_B1 1RECV_F3 (1B2;1F3)OVERLAP_B_F 1SEND_B2 1B3 1SEND_B3
"""


def test_overlap_b_f() -> None:
    kw = dict(num_ranks=2, stages_per_rank=1, num_microbatches=4, overlap=True)
    assert _build("1f1b", 0, swap=True, min_gap=2, **kw) == _words(OVERLAP_R0)
    assert _build("1f1b", 1, **kw) == _words(OVERLAP_R1)


# Interleaved 1F1B, 2 ranks × 2 virtual stages × 4 micro-batches (torch's order, checked
# against Megatron's rule by hand: warm-up (R-r-1)*2 + (V-1)*R forwards, then F/B pairs).
INTERLEAVED_COMPUTE = {
    0: "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
    1: "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
}
# With FSDP (one-slot lookahead), plain transport, swap at min_gap 4. Eligible: (0,0) gap 9,
# (0,1) 10, (2,1) 4, (0,2) 10, (0,3) 9, (2,2) 4; (2,0) and (2,3) have gap 3.
# (0,0) and (0,2): their stage is resharded and unsharded again one slot ahead, so
#   LAUNCH_LOAD → UNSHARD → (other stage's compute) → WAIT_LOAD → B.
# (0,1), (2,1), (0,3), (2,2): the stage computes between its last UNSHARD and the backward
#   (it stays unsharded), so the load starts right after the compute slot before the backward.
INTERLEAVED_FSDP_SWAP_R0 = """
0UNSHARD 0F0 0SWAP_LAUNCH_OFFLOAD0 2UNSHARD 0SEND_F0
0F1 0SWAP_LAUNCH_OFFLOAD1 0RESHARD 0SEND_F1 2RECV_F0 0SWAP_WAIT_OFFLOAD0
2F0 0UNSHARD 2SEND_F0 2RECV_F1 0SWAP_WAIT_OFFLOAD1
2F1 2SWAP_LAUNCH_OFFLOAD1 2SEND_F1
0F2 0SWAP_LAUNCH_OFFLOAD2 0SEND_F2 2RECV_B0 2SWAP_WAIT_OFFLOAD1
2B0 2SEND_B0 0SWAP_WAIT_OFFLOAD2
0F3 0SWAP_LAUNCH_OFFLOAD3 2SWAP_LAUNCH_LOAD1 0RESHARD 0SEND_F3 2RECV_B1 2SWAP_WAIT_LOAD1
2B1 0SWAP_LAUNCH_LOAD0 0UNSHARD 2SEND_B1 2RECV_F2 0SWAP_WAIT_OFFLOAD3
2F2 2SWAP_LAUNCH_OFFLOAD2 2SEND_F2 0RECV_B0 0SWAP_WAIT_LOAD0
0B0 2RECV_F3 2SWAP_WAIT_OFFLOAD2
2F3 0SWAP_LAUNCH_LOAD1 2SEND_F3 0RECV_B1 0SWAP_WAIT_LOAD1
0B1 2SWAP_LAUNCH_LOAD2 0RESHARD 2RECV_B2 2SWAP_WAIT_LOAD2
2B2 0SWAP_LAUNCH_LOAD2 0UNSHARD 2SEND_B2 2RECV_B3
2B3 2REDUCE_GRAD 2RESHARD 2SEND_B3 0RECV_B2 0SWAP_WAIT_LOAD2
0B2 0SWAP_LAUNCH_LOAD3 0RECV_B3 0SWAP_WAIT_LOAD3
0B3 0REDUCE_GRAD 0RESHARD
"""


def test_interleaved_compute_order_is_megatron() -> None:
    orders = compute_orders("interleaved-1f1b", num_ranks=2, stages_per_rank=2, num_microbatches=4)
    assert {r: format_order(o) for r, o in orders.items()} == {
        r: _words(t) for r, t in INTERLEAVED_COMPUTE.items()
    }


def test_interleaved_fsdp_swap() -> None:
    kw = dict(num_ranks=2, stages_per_rank=2, num_microbatches=4, fsdp=True)
    got = _build("interleaved-1f1b", 0, swap=True, unsharded_load="delay", **kw)
    assert got == _words(INTERLEAVED_FSDP_SWAP_R0)
    reference = parse_order(_build("interleaved-1f1b", 0, **kw))
    assert_valid_order(parse_order(got), rank=0, reference=reference, unsharded_load="delay")
    # The default places the loads of the stays-unsharded chunks one compute slot earlier.
    cover = parse_order(_build("interleaved-1f1b", 0, swap=True, **kw))
    assert_valid_order(cover, rank=0, reference=reference)
    moved = [s for s, d in zip(cover, parse_order(got)) if s != d]
    assert moved and all(s.kind.name.startswith("SWAP") or s.is_compute_slot or s.is_comm for s in moved)


def test_interleaved_fsdp_batch_keeps_swap_outside_containers() -> None:
    kw = dict(num_ranks=2, stages_per_rank=2, num_microbatches=4, fsdp=True, swap=True)
    plain = parse_order(_build("interleaved-1f1b", 0, **kw))
    batched = parse_order(_build("interleaved-1f1b", 0, transport="batch", **kw))
    # Batch transport wraps the same P2P runs; the swap steps land at the same anchors, so
    # flattening the containers gives the plain order back.
    flat = [leaf for step in batched for leaf in (step.leaves() if step.kind.name == "BATCH_SEND_RECV" else [step])]
    assert flat == plain
    assert all(not leaf.is_swap for step in batched if step.is_composite for leaf in step.leaves())


@pytest.mark.parametrize(
    ("transport", "expected"),
    [
        ("plain", "0F0 0SEND_F0 0RESHARD 2RECV_F0 2F0 2SEND_F0"),
        ("batch", "0F0 (0SEND_F0)BATCH_SEND_RECV 0RESHARD (2RECV_F0)BATCH_SEND_RECV 2F0 (2SEND_F0)BATCH_SEND_RECV"),
        ("boundary", "0F0 (0SEND_F0;2RECV_F0)BATCH_SEND_RECV 0RESHARD 2F0 (2SEND_F0)BATCH_SEND_RECV"),
    ],
)
def test_transport_modes(transport: str, expected: str) -> None:
    order = parse_order("0F0 0SEND_F0 0RESHARD 2RECV_F0 2F0 2SEND_F0")
    assert format_order(rewrite_transport(order, transport)) == _words(expected)


def test_strip_gives_back_golden_inputs() -> None:
    assert format_order(strip_swap_steps(parse_order(_words(GPIPE_R0)))) == _words(
        "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2"
    )


# GPipe + FSDP + batch, 2 ranks × 3 micro-batches, rank 0, min_gap 3. One stage per rank:
# it stays unsharded (UNSHARD at the top, REDUCE_GRAD + RESHARD at the bottom). With
# unsharded_load="delay" (the design document's rule) every load is delayed to the comm
# block right before its backward, where no compute hides it.
GPIPE_FSDP_BATCH_R0 = """
0UNSHARD 0F0 0SWAP_LAUNCH_OFFLOAD0 (0SEND_F0)BATCH_SEND_RECV
0F1 0SWAP_LAUNCH_OFFLOAD1 (0SEND_F1)BATCH_SEND_RECV 0SWAP_WAIT_OFFLOAD0
0F2 0SWAP_LAUNCH_OFFLOAD2 0SWAP_LAUNCH_LOAD0 (0SEND_F2;0RECV_B0)BATCH_SEND_RECV 0SWAP_WAIT_OFFLOAD1 0SWAP_WAIT_LOAD0
0B0 0SWAP_LAUNCH_LOAD1 (0RECV_B1)BATCH_SEND_RECV 0SWAP_WAIT_OFFLOAD2 0SWAP_WAIT_LOAD1
0B1 0SWAP_LAUNCH_LOAD2 (0RECV_B2)BATCH_SEND_RECV 0SWAP_WAIT_LOAD2
0B2 0REDUCE_GRAD 0RESHARD
"""


# The default, unsharded_load="cover": each load starts before the compute slot ahead of
# its backward, exactly as on a stage without FSDP, so that slot hides the H2D.
GPIPE_FSDP_BATCH_COVER_R0 = """
0UNSHARD 0F0 0SWAP_LAUNCH_OFFLOAD0 (0SEND_F0)BATCH_SEND_RECV
0F1 0SWAP_LAUNCH_OFFLOAD1 (0SEND_F1)BATCH_SEND_RECV 0SWAP_WAIT_OFFLOAD0 0SWAP_LAUNCH_LOAD0
0F2 0SWAP_LAUNCH_OFFLOAD2 (0SEND_F2;0RECV_B0)BATCH_SEND_RECV 0SWAP_WAIT_OFFLOAD1 0SWAP_LAUNCH_LOAD1 0SWAP_WAIT_LOAD0
0B0 (0RECV_B1)BATCH_SEND_RECV 0SWAP_WAIT_OFFLOAD2 0SWAP_LAUNCH_LOAD2 0SWAP_WAIT_LOAD1
0B1 (0RECV_B2)BATCH_SEND_RECV 0SWAP_WAIT_LOAD2
0B2 0REDUCE_GRAD 0RESHARD
"""


def test_gpipe_fsdp_batch_swap() -> None:
    kw = dict(num_ranks=2, stages_per_rank=1, num_microbatches=3, fsdp=True, transport="batch")
    delayed = _build("gpipe", 0, swap=True, min_gap=3, unsharded_load="delay", **kw)
    assert delayed == _words(GPIPE_FSDP_BATCH_R0)
    assert _build("gpipe", 0, swap=True, min_gap=3, **kw) == _words(GPIPE_FSDP_BATCH_COVER_R0)


# Interleaved 1F1B with 3 virtual stages: 2 ranks × 3 × 2 micro-batches. Rank 0 holds stages
# 0, 2, 4; its warm-up (R-r-1)*2 + (V-1)*R = 6 covers every forward, then the backwards run
# from the last local stage down. Gaps: stage 0 → 10, stage 2 → 6, stage 4 → 2 (min_gap 4).
INTERLEAVED_V3_COMPUTE_R0 = "0F0 0F1 2F0 2F1 4F0 4F1 4B0 4B1 2B0 2B1 0B0 0B1"
INTERLEAVED_V3_SWAP_R0 = """
0F0 0SWAP_LAUNCH_OFFLOAD0 0SEND_F0 0F1 0SWAP_LAUNCH_OFFLOAD1 0SEND_F1 2RECV_F0 0SWAP_WAIT_OFFLOAD0
2F0 2SWAP_LAUNCH_OFFLOAD0 2SEND_F0 2RECV_F1 0SWAP_WAIT_OFFLOAD1
2F1 2SWAP_LAUNCH_OFFLOAD1 2SEND_F1 4RECV_F0 2SWAP_WAIT_OFFLOAD0
4F0 4SEND_F0 4RECV_F1 2SWAP_WAIT_OFFLOAD1
4F1 4SEND_F1 4RECV_B0
4B0 4SEND_B0 4RECV_B1 2SWAP_LAUNCH_LOAD0
4B1 4SEND_B1 2RECV_B0 2SWAP_LAUNCH_LOAD1 2SWAP_WAIT_LOAD0
2B0 2SEND_B0 2RECV_B1 0SWAP_LAUNCH_LOAD0 2SWAP_WAIT_LOAD1
2B1 2SEND_B1 0RECV_B0 0SWAP_LAUNCH_LOAD1 0SWAP_WAIT_LOAD0
0B0 0RECV_B1 0SWAP_WAIT_LOAD1
0B1
"""


def test_interleaved_three_virtual_stages() -> None:
    kw = dict(num_ranks=2, stages_per_rank=3, num_microbatches=2)
    compute = compute_orders("interleaved-1f1b", **kw)
    assert format_order(compute[0]) == _words(INTERLEAVED_V3_COMPUTE_R0)
    assert _build("interleaved-1f1b", 0, swap=True, **kw) == _words(INTERLEAVED_V3_SWAP_R0)


# Overlapped F/B with dx/dw split (design section 6.8.4), 1F1B, 2 ranks × 4 micro-batches,
# min_gap 2. Rank 1 (last stage) computes F0 B0 F1 B1 F2 B2 F3 B3; fusing gives
# F0 (B0;F1) (B1;F2) (B2;F3) B3 and the split turns each B into I + a W slot right after:
# slots F0 | (I0;F1) | W0 | (I1;F2) | W1 | (I2;F3) | W2 | I3 | W3. Gaps F→I: chunk 0 → 1
# (resident), chunks 1..3 → 2. Each load is waited right before the composite holding its I,
# the dx is sent right after it, and the W that follows never loads:
#   SWAP_LAUNCH_LOAD1 → SWAP_WAIT_LOAD1 → (I1;F2)OVERLAP_B_F → SEND_B1 → W1.
OVERLAP_DXDW_R1 = """
1RECV_F0 1F0 1RECV_F1 (1I0;1F1)OVERLAP_B_F 1SWAP_LAUNCH_OFFLOAD1 1SEND_B0 1W0
1RECV_F2 1SWAP_WAIT_OFFLOAD1 1SWAP_LAUNCH_LOAD1 1SWAP_WAIT_LOAD1 (1I1;1F2)OVERLAP_B_F
1SWAP_LAUNCH_OFFLOAD2 1SEND_B1 1W1
1RECV_F3 1SWAP_WAIT_OFFLOAD2 1SWAP_LAUNCH_LOAD2 1SWAP_WAIT_LOAD2 (1I2;1F3)OVERLAP_B_F
1SWAP_LAUNCH_OFFLOAD3 1SEND_B2 1W2
1SWAP_WAIT_OFFLOAD3 1SWAP_LAUNCH_LOAD3 1SWAP_WAIT_LOAD3 1I3 1SEND_B3 1W3
"""


def test_overlap_with_dxdw_split() -> None:
    kw = dict(num_ranks=2, stages_per_rank=1, num_microbatches=4, overlap=True, dxdw_split=True, swap=True, min_gap=2)
    assert _build("1f1b", 1, **kw) == _words(OVERLAP_DXDW_R1)
    # Stage 0 keeps a plain BWD under dx/dw split, so rank 0 is the overlap order unchanged.
    assert _build("1f1b", 0, **kw) == _words(OVERLAP_R0)
