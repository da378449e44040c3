"""The timeline model's disk channel (issue 50): spills and loads on one serial channel
at the trace's disk bandwidth, a spill after its D2H, a load after its spill, a reload
after its load (compute waits for it). Every expected time below is worked out by hand
in the comments."""

from __future__ import annotations

import dataclasses

import pytest

from hyper_offload.passes import ActionKind, ActivationTrace, ResidencySchedule, predict_timeline
from hyper_offload.passes.ir.schedule import ResidencyAction

US = 1e-6


def _trace(durations_us: list[float], accesses: list[dict[int, str]],
           sizes: dict[int, int]) -> ActivationTrace:
    """Links at 1 GB/s (1000 B: 1 µs), the disk at 0.5 GB/s (1000 B: 2 µs)."""
    trace = ActivationTrace.from_accesses(accesses, sizes, budget_bytes=0)
    ops = tuple(dataclasses.replace(op, duration_s=d * US)
                for op, d in zip(trace.ops, durations_us))
    return dataclasses.replace(trace, ops=ops, d2h_bandwidth_gbps=1.0, h2d_bandwidth_gbps=1.0,
                               disk_budget_bytes=10_000, disk_bandwidth_gbps=0.5)


def _schedule(num_ops: int, pre: dict[int, str], post: dict[int, str]) -> ResidencySchedule:
    def parse(slots: dict[int, str]) -> dict[int, list[ResidencyAction]]:
        return {op: [ResidencyAction.from_str(a) for a in text.split(", ")]
                for op, text in slots.items()}

    return ResidencySchedule.from_slots(num_ops, parse(pre), parse(post))


def _spans(spans: tuple) -> list[tuple[str, float, float]]:
    return [(repr(s).split(" [")[0], round(s.start_s / US, 9), round(s.end_s / US, 9))
            for s in spans]


ONE = [{0: "W"}, {}, {}, {0: "R"}]
SPILLED = _schedule(
    4,
    pre={2: "LOAD_FROM_DISK 0, RELEASE_DISK 0", 3: "COPY_H2D 0, WAIT_H2D 0"},
    post={0: "COPY_D2H 0, SPILL_TO_DISK 0, RELEASE_DEVICE 0", 3: "RELEASE_HOST 0, RELEASE_DEVICE 0"},
)


def test_a_late_load_stalls_its_reload() -> None:
    timeline = predict_timeline(_trace([1, 1, 1, 1], ONE, {0: 1000}), SPILLED)
    # op 0 [0, 1); D2H [1, 2); the spill waits for it: [2, 4). The load, issued before
    # op 2 at 2, waits for the spill: [4, 6). At 3 the reload's COPY_H2D waits for the
    # load (stall [3, 6)), then copies [6, 7) and its WAIT_H2D stalls [6, 7); op 3 [7, 8).
    assert _spans(timeline.transfers) == [("D2H s0", 1, 2), ("H2D s0", 6, 7)]
    assert _spans(timeline.disk) == [("spill s0", 2, 4), ("load s0", 4, 6)]
    assert _spans(timeline.waits) == [("wait load s0", 3, 6), ("wait H2D s0", 6, 7)]
    assert timeline.exposed_transfer_s == pytest.approx(4 * US)
    assert timeline.compute_end_s == pytest.approx(8 * US) == timeline.end_s
    assert timeline.summary()["disk_busy_s"] == pytest.approx(4 * US)


def test_a_load_in_time_costs_nothing_but_the_copy() -> None:
    timeline = predict_timeline(_trace([5, 5, 5, 5], ONE, {0: 1000}), SPILLED)
    # op 0 [0, 5); D2H [5, 6); spill [6, 8); op 1 [5, 10); the load at 10: [10, 12);
    # op 2 [10, 15); at 15 the load is done, the H2D runs [15, 16) and its wait stalls
    # [15, 16); op 3 [16, 21).
    assert _spans(timeline.disk) == [("spill s0", 6, 8), ("load s0", 10, 12)]
    assert _spans(timeline.waits) == [("wait H2D s0", 15, 16)]
    assert timeline.exposed_transfer_s == pytest.approx(1 * US)
    assert timeline.end_s == pytest.approx(21 * US)
    assert [m.kind for m in timeline.releases].count(ActionKind.RELEASE_DISK) == 1


def test_the_disk_channel_is_serial() -> None:
    # Two 1000 B storages copied out after op 0, spilled together, loaded together.
    accesses = [{0: "W", 1: "W"}, {}, {}, {0: "R", 1: "R"}]
    schedule = _schedule(
        4,
        pre={1: "LOAD_FROM_DISK 0, LOAD_FROM_DISK 1, RELEASE_DISK 0, RELEASE_DISK 1",
             3: "COPY_H2D 0, COPY_H2D 1, WAIT_H2D 0, WAIT_H2D 1"},
        post={0: "COPY_D2H 0, COPY_D2H 1, SPILL_TO_DISK 0, SPILL_TO_DISK 1, "
                 "RELEASE_DEVICE 0, RELEASE_DEVICE 1",
              3: "RELEASE_HOST 0, RELEASE_HOST 1, RELEASE_DEVICE 0, RELEASE_DEVICE 1"},
    )
    timeline = predict_timeline(_trace([10, 1, 1, 1], accesses, {0: 1000, 1: 1000}), schedule)
    # Op 0 [0, 10); D2Hs [10, 11) and [11, 12) on the one copy stream; spills [11, 13)
    # (after its D2H) and [13, 15) (after the first spill); the loads, issued at 10,
    # queue behind them: [15, 17) and [17, 19). Op 1 [10, 11), op 2 [11, 12); at 12 the
    # first COPY_H2D waits for its load until 17, copies [17, 18); the second waits until
    # 19, copies [19, 20); the waits end at 18 (already past) and 20: exposed
    # 5 + 2 + 1 = 8 µs; op 3 [20, 21).
    assert _spans(timeline.disk) == [("spill s0", 11, 13), ("spill s1", 13, 15),
                                     ("load s0", 15, 17), ("load s1", 17, 19)]
    assert _spans(timeline.transfers)[2:] == [("H2D s0", 17, 18), ("H2D s1", 19, 20)]
    assert timeline.exposed_transfer_s == pytest.approx(8 * US)
    assert timeline.end_s == pytest.approx(21 * US)


def test_a_schedule_without_the_disk_tier_is_priced_as_before() -> None:
    trace = _trace([1, 1, 1, 1], ONE, {0: 1000})
    plain = _schedule(4, pre={3: "COPY_H2D 0, WAIT_H2D 0"},
                      post={0: "COPY_D2H 0, RELEASE_DEVICE 0", 3: "RELEASE_HOST 0, RELEASE_DEVICE 0"})
    timeline = predict_timeline(trace, plain)
    # D2H [1, 2); the H2D at 3: [3, 4), stalling its wait; op 3 [4, 5).
    assert timeline.disk == () and timeline.exposed_transfer_s == pytest.approx(1 * US)
    assert timeline.end_s == pytest.approx(5 * US)
