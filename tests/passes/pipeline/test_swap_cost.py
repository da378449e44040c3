"""Cost-aware swap eligibility: hand-built orders with known answers, then properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_offload.passes.pipeline.build import build_rank_orders
from hyper_offload.passes.pipeline.check_order import check_order
from hyper_offload.passes.pipeline.meta_step import StepKind, SwapPhase
from hyper_offload.passes.pipeline.residency import (
    ActivationSizes,
    StageFootprint,
    StageFootprints,
    chunk_lives,
    peak_bytes,
    resident_curve,
)
from hyper_offload.passes.pipeline.swap import find_swap_chunks, find_weight_windows, inject_swap_steps
from hyper_offload.passes.pipeline.swap_cost import (
    RejectReason,
    SwapCostModel,
    chunk_windows,
    choose_swaps,
    copy_stream_misses,
    plan_rank_swaps,
    plan_swaps,
)

from .swap_order_text import order

MB = 10**6
# Default model: FWD 10 ms, BWD 20 ms, 20 GB/s each way -> 100 MB copy in 5 ms.
COST = SwapCostModel()


# One stage, four micro-batches, only chunk 0 has swap steps. Offload window: F1 (10 ms);
# load window: B2 + B1 (40 ms). Peak: 4 chunks at F3 / B3, where chunk 0 is away.
ONE_CANDIDATE = order("0F0 0LO0 0F1 0WO0 0F2 0F3 0B3 0LL0 0B2 0B1 0WL0 0B0")
# Then a second phase with at most 3 live chunks: chunk 4 is away only there.
TWO_PHASES = order(
    "0F0 0LO0 0F1 0WO0 0F2 0F3 0B3 0LL0 0B2 0B1 0WL0 0B0 "
    "0F4 0LO4 0F5 0WO4 0F6 0B6 0LL4 0B5 0WL4 0B4"
)


def sizes(nbytes: int) -> ActivationSizes:
    return ActivationSizes(default_bytes=nbytes)


def reasons(report) -> dict[tuple[int, int], RejectReason]:
    return {(r.stage, r.micro): r.reason for r in report.rejected}


def test_resident_curve_counts_chunks_from_forward_through_consumer() -> None:
    unit = sizes(1)
    assert resident_curve(ONE_CANDIDATE, unit, swapped=()) == [1, 1, 2, 2, 3, 4, 4, 3, 3, 2, 1, 1]
    # swapped: away from SWAP_WAIT_OFFLOAD (position 3) up to SWAP_LAUNCH_LOAD (position 7)
    assert resident_curve(ONE_CANDIDATE, unit) == [1, 1, 2, 1, 2, 3, 3, 3, 3, 2, 1, 1]
    assert peak_bytes(ONE_CANDIDATE, unit, swapped=()) == 4 and peak_bytes(ONE_CANDIDATE, unit) == 3


def test_resident_curve_refuses_a_swapped_chunk_without_swap_steps() -> None:
    with pytest.raises(ValueError, match="stage 0 micro-batch 1 .* lacks some of its four swap steps"):
        resident_curve(ONE_CANDIDATE, sizes(1), swapped=[(0, 1)])


def test_windows_are_compute_time_between_launch_and_wait() -> None:
    window = chunk_windows(ONE_CANDIDATE, sizes(100 * MB), COST)[(0, 0)]
    assert window.offload_window_s == pytest.approx(0.010)
    assert window.load_window_s == pytest.approx(0.040)
    assert window.d2h_s == pytest.approx(0.005) and window.h2d_s == pytest.approx(0.005)


def test_chunk_whose_copy_fits_its_window_is_chosen_and_lowers_the_peak() -> None:
    report = choose_swaps(ONE_CANDIDATE, sizes=sizes(100 * MB), cost=COST)
    assert report.chosen == ((0, 0),)
    assert (report.peak_without, report.peak_with) == (400 * MB, 300 * MB)
    assert report.saved_bytes == 100 * MB
    assert reasons(report) == {k: RejectReason.NOT_ELIGIBLE for k in [(0, 1), (0, 2), (0, 3)]}


@pytest.mark.parametrize(
    "nbytes, chosen",
    [(200 * MB, True), (200 * MB + 1, False)],  # D2H of 200 MB takes exactly the 10 ms of F1
)
def test_offload_window_too_short_is_rejected_with_that_reason(nbytes: int, chosen: bool) -> None:
    report = choose_swaps(ONE_CANDIDATE, sizes=sizes(nbytes), cost=COST)
    assert ((0, 0) in report.chosen) is chosen
    if not chosen:
        rejected = next(r for r in report.rejected if (r.stage, r.micro) == (0, 0))
        assert rejected.reason is RejectReason.OFFLOAD_WINDOW_TOO_SHORT
        assert "10 ms" in rejected.detail
        assert report.peak_with == report.peak_without


def test_load_window_too_short_is_rejected_with_that_reason() -> None:
    slow_load = SwapCostModel(h2d_bytes_per_s=2e9)  # 100 MB in 50 ms > 40 ms of B2 + B1
    report = choose_swaps(ONE_CANDIDATE, sizes=sizes(100 * MB), cost=slow_load)
    assert report.chosen == ()
    assert reasons(report)[(0, 0)] is RejectReason.LOAD_WINDOW_TOO_SHORT
    assert report.peak_with == report.peak_without == 400 * MB


def test_per_stage_durations_widen_the_window() -> None:
    # 300 MB needs 15 ms; F1 on stage 0 takes 10 ms by default, 20 ms with the override.
    slow_stage = SwapCostModel(stage_step_seconds={(0, StepKind.FWD): 0.020})
    assert choose_swaps(ONE_CANDIDATE, sizes=sizes(300 * MB), cost=COST).chosen == ()
    assert choose_swaps(ONE_CANDIDATE, sizes=sizes(300 * MB), cost=slow_stage).chosen == ((0, 0),)


def test_chunk_not_resident_at_the_peak_is_not_chosen() -> None:
    report = choose_swaps(TWO_PHASES, sizes=sizes(100 * MB), cost=COST)
    assert report.chosen == ((0, 0),)
    assert reasons(report)[(0, 4)] is RejectReason.NOT_AT_PEAK
    assert (report.peak_without, report.peak_with) == (400 * MB, 300 * MB)
    # both hide alone, so the choice is about the peak, not the copies
    assert all(w.hides_alone for w in report.windows)


def test_per_chunk_sizes_move_the_peak_to_the_other_phase() -> None:
    # chunks 4-6 at 300 MB: the second phase holds the peak (900 MB at F6 > 400 MB at F3)
    big_late = ActivationSizes(default_bytes=100 * MB, per_chunk={(0, 4): 300 * MB, (0, 5): 300 * MB, (0, 6): 300 * MB})
    report = choose_swaps(TWO_PHASES, sizes=big_late, cost=SwapCostModel(d2h_bytes_per_s=40e9))
    assert report.peak_without == 900 * MB
    assert report.chosen == ((0, 4),)
    assert report.peak_with == 600 * MB
    assert reasons(report)[(0, 0)] is RejectReason.NOT_AT_PEAK


def test_shared_copy_stream_rejects_the_chunk_that_no_longer_hides() -> None:
    # Chunks 0 and 1 both offload over F2 (10 ms). At 10 GB/s a 60 MB D2H takes 6 ms: alone
    # each hides; on one copy stream the second ends 12 ms after launch, 2 ms after its wait.
    both = order(
        "0F0 0F1 0LO0 0LO1 0F2 0WO0 0WO1 0F3 0F4 0B4 0B3 0LL1 0LL0 0B2 0WL1 0B1 0WL0 0B0"
    )
    cost = SwapCostModel(d2h_bytes_per_s=10e9)
    report = choose_swaps(both, sizes=sizes(60 * MB), cost=cost)
    assert report.chosen == ((0, 0),)
    assert report.peak_with == 4 * 60 * MB  # 5 chunks live at F4 without swap
    assert reasons(report)[(0, 1)] is RejectReason.COPY_STREAM_BUSY
    lives = chunk_lives(both)
    assert copy_stream_misses(both, lives, [(0, 0), (0, 1)], sizes(60 * MB), cost) == [(0, 1)]
    # with a faster link both hide and both are needed to lower the peak from 5 to 3 chunks
    fast = choose_swaps(both, sizes=sizes(60 * MB), cost=SwapCostModel())
    assert fast.chosen == ((0, 0), (0, 1)) and fast.peak_with == 3 * 60 * MB


def test_target_stops_the_greedy_and_names_the_reason() -> None:
    report = choose_swaps(ONE_CANDIDATE, sizes=sizes(100 * MB), cost=COST, target_peak_bytes=400 * MB)
    assert report.chosen == ()
    assert reasons(report)[(0, 0)] is RejectReason.TARGET_MET


def test_zero_byte_chunks_are_not_moved() -> None:
    report = choose_swaps(ONE_CANDIDATE, sizes=sizes(0), cost=COST)
    assert report.chosen == () and reasons(report)[(0, 0)] is RejectReason.NO_ACTIVATIONS


def test_overlap_composite_takes_its_longest_sub_step() -> None:
    # chunk 0's offload window is one composite slot (B of stage 1 = 20 ms with F of stage 0)
    with_overlap = order(
        "0F0 1F0 0LO0 (1B0;0F1)OVERLAP_B_F 0WO0 1F1 1B1 0F2 0LL0 1F2 1B2 0WL0 0B0"
    )
    window = chunk_windows(with_overlap, sizes(100 * MB), COST)[(0, 0)]
    assert window.offload_window_s == pytest.approx(0.020)


def test_plan_swaps_names_gap_of_ineligible_chunks_and_matches_injection() -> None:
    plain = build_rank_orders("1f1b", num_ranks=4, stages_per_rank=1, num_microbatches=8)[0]
    report = plan_swaps(plain, sizes=sizes(100 * MB), cost=COST, min_gap=8)
    gaps = {c.key: c.gap for c in find_swap_chunks(plain, min_gap=8)}
    ineligible = [r for r in report.rejected if r.reason is RejectReason.NOT_ELIGIBLE]
    assert {(r.stage, r.micro) for r in ineligible} == {k for k, gap in gaps.items() if gap < 8} != set()
    for rejected in ineligible:
        assert rejected.detail == f"gap {gaps[(rejected.stage, rejected.micro)]} < min gap 8"
    swapped = inject_swap_steps(plain, min_gap=8, only=report.chosen)
    assert peak_bytes(swapped, sizes(100 * MB)) == report.peak_with


def test_gpipe_cost_aware_reaches_the_gap_rule_peak_with_fewer_chunks() -> None:
    plain = build_rank_orders("gpipe", num_ranks=4, stages_per_rank=1, num_microbatches=8)[0]
    every = inject_swap_steps(plain, min_gap=4)
    report = plan_swaps(plain, sizes=sizes(100 * MB), cost=COST)
    eligible = [c.key for c in find_swap_chunks(plain) if c.eligible]
    assert report.peak_with == peak_bytes(every, sizes(100 * MB)) < report.peak_without
    assert 0 < len(report.chosen) < len(eligible)
    assert all(reasons(report)[k] is RejectReason.NOT_AT_PEAK for k in eligible if k not in report.chosen)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: ActivationSizes(default_bytes=-1), "ActivationSizes.default_bytes"),
        (lambda: ActivationSizes(per_chunk={(0, 1): 1.5}), r"per_chunk\[\(0, 1\)\]"),
        (lambda: SwapCostModel(d2h_bytes_per_s=0), "d2h_bytes_per_s"),
        (lambda: SwapCostModel(step_seconds={StepKind.FWD: -1.0}), "step_seconds"),
    ],
)
def test_bad_model_inputs_name_the_field(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


SHAPES = [
    ("gpipe", 1, {}),
    ("1f1b", 1, {}),
    ("interleaved-1f1b", 2, {}),
    ("interleaved-1f1b", 3, {"fsdp": True}),
    ("interleaved-zb", 2, {}),
    ("zbv", 2, {}),
    ("dualpipev", 2, {}),
    ("gpipe", 1, {"overlap": True, "dxdw_split": True, "transport": "batch"}),
]


@settings(max_examples=25, deadline=None)
@given(
    shape=st.sampled_from(SHAPES),
    num_ranks=st.integers(2, 4),
    rounds=st.integers(2, 3),
    min_gap=st.integers(2, 6),
    chunk_mb=st.sampled_from([20, 100, 250]),
    d2h_gbps=st.sampled_from([5, 20]),
    with_weight_state=st.booleans(),
)
def test_every_choice_is_hideable_minimal_and_never_raises_the_peak(
    shape, num_ranks: int, rounds: int, min_gap: int, chunk_mb: int, d2h_gbps: int, with_weight_state: bool
) -> None:
    schedule, stages_per_rank, extra = shape
    orders = build_rank_orders(
        schedule,
        num_ranks=num_ranks,
        stages_per_rank=stages_per_rank,
        num_microbatches=num_ranks * rounds,
        **extra,
    )
    chunk_sizes: ActivationSizes | StageFootprints = ActivationSizes(
        default_bytes=chunk_mb * MB, per_stage={0: 2 * chunk_mb * MB}
    )
    if with_weight_state:  # the full residency model: dW state, tails, transients
        full = StageFootprint(
            activations=chunk_mb * MB, forward_resident=MB, weight_state=chunk_mb * MB * 3 // 2,
            weight_resident=MB, tail_bytes=MB // 2, working={StepKind.BWD_INPUT: chunk_mb * MB},
        )
        chunk_sizes = StageFootprints(default=full)
    cost = SwapCostModel(d2h_bytes_per_s=d2h_gbps * 1e9)
    reports = plan_rank_swaps(orders, sizes=chunk_sizes, cost=cost, min_gap=min_gap)
    for rank, report in reports.items():
        plain = orders[rank]
        weight = report.chosen_weight
        swapped = inject_swap_steps(plain, min_gap=min_gap, only=report.chosen, weight_only=weight)
        assert check_order(
            swapped, rank=rank, min_gap=min_gap, swapped=report.chosen, weight_swapped=weight, reference=plain
        ) == []
        assert report.peak_with <= report.peak_without
        assert report.peak_without == peak_bytes(plain, chunk_sizes)
        assert report.peak_with == peak_bytes(swapped, chunk_sizes)
        for phase, chosen, windows in (
            (SwapPhase.ACTIVATIONS, report.chosen, find_swap_chunks(plain, min_gap=min_gap)),
            (SwapPhase.WEIGHT_STATE, weight, find_weight_windows(plain, min_gap=min_gap)),
        ):
            rejected = {(r.stage, r.micro) for r in report.rejected if r.phase is phase}
            assert set(chosen).isdisjoint(rejected)
            assert {c.key for c in windows} <= set(chosen) | rejected
        all_windows = [*report.chosen, *((*k, SwapPhase.WEIGHT_STATE) for k in weight)]
        assert copy_stream_misses(swapped, chunk_lives(swapped), all_windows, chunk_sizes, cost) == []
        for key in report.chosen:  # minimal: dropping any chosen window raises the peak
            rest = [k for k in report.chosen if k != key]
            assert peak_bytes(swapped, chunk_sizes, swapped=rest, weight_swapped=weight) > report.peak_with
        for key in weight:
            rest = [k for k in weight if k != key]
            assert peak_bytes(swapped, chunk_sizes, swapped=report.chosen, weight_swapped=rest) > report.peak_with
