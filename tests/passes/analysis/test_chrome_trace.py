"""Predicted timeline and Chrome/Perfetto export: exact times on hand-built plans, track
layout, the serial copy stream, waits that delay compute, and properties on random plans."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_offload.passes import (
    ActionKind,
    ActivationTrace,
    GreedyResidencyPlanner,
    ResidencyAction,
    ResidencySchedule,
    TraceOp,
    chrome_trace,
    predict_timeline,
    write_chrome_trace,
)
from hyper_offload.passes.analysis.chrome_trace import (
    TRACK_COMPUTE,
    TRACK_D2H,
    TRACK_H2D,
    TRACK_RELEASES,
)
from hyper_offload.passes.fx.cost_model import exposed_transfer_time

from ..planner_strategies import traces

D2H, REL, H2D, WAIT, HREL = (
    ActionKind.COPY_D2H, ActionKind.RELEASE_DEVICE, ActionKind.COPY_H2D, ActionKind.WAIT_H2D,
    ActionKind.RELEASE_HOST,
)
US = 1e-6


def acts(*pairs) -> list[ResidencyAction]:  # noqa: ANN002
    return [ResidencyAction(kind, sid) for kind, sid in pairs]


def timed(accesses, sizes, durations_us, *, d2h_gbps=1.0, h2d_gbps=2.0, budget=0):  # noqa: ANN001, ANN201
    ops = [TraceOp(f"op{i}", tuple(a.items()), (), None if d is None else d * US)
           for i, (a, d) in enumerate(zip(accesses, durations_us))]
    return ActivationTrace(ops, sizes, budget, d2h_bandwidth_gbps=d2h_gbps, h2d_bandwidth_gbps=h2d_gbps)


# s0 (20 kB) is written at op 0 and read at op 3; s1 lives over ops 1..2. Every op 10 µs;
# D2H at 1 GB/s takes 20 µs, H2D at 2 GB/s takes 10 µs.
TRACE = timed([{0: "W"}, {1: "W"}, {1: "R"}, {0: "R"}], {0: 20_000, 1: 5_000}, [10] * 4)


def plan(pre=None, post=None, trace=TRACE) -> ResidencySchedule:  # noqa: ANN001
    return ResidencySchedule.from_slots(trace.num_ops, pre or {}, post or {})


LATE_PREFETCH = plan(
    {3: acts((H2D, 0), (WAIT, 0))},
    {0: acts((D2H, 0), (REL, 0)), 2: acts((REL, 1)), 3: acts((REL, 0), (HREL, 0))},
)


def x_events(document: dict, tid: int) -> list[dict]:
    return [e for e in document["traceEvents"] if e["ph"] == "X" and e["tid"] == tid]


def spans(events: list[dict]) -> list[tuple[str, float, float]]:
    return [(e["name"], e["ts"], round(e["ts"] + e["dur"], 3)) for e in events]


def test_a_late_prefetch_stalls_compute_for_the_whole_copy() -> None:
    document = chrome_trace(TRACE, LATE_PREFETCH)
    assert spans(x_events(document, TRACK_COMPUTE)) == [
        ("op0", 0, 10), ("op1", 10, 20), ("op2", 20, 30), ("op3", 40, 50),
        ("wait H2D s0", 30, 40),  # the H2D is issued at 30 and op3 needs it
    ]
    assert spans(x_events(document, TRACK_D2H)) == [("D2H s0", 10, 30)]
    assert spans(x_events(document, TRACK_H2D)) == [("H2D s0", 30, 40)]
    other = document["otherData"]
    assert other["exposed_transfer_s"] == pytest.approx(10 * US)
    assert other["predicted_step_s"] == pytest.approx(50 * US)
    assert other["compute_s"] == pytest.approx(40 * US)


def test_an_early_prefetch_is_hidden_unless_the_serial_copy_stream_is_busy() -> None:
    # H2D issued before op 2 (at 20 µs) while the D2H runs until 30: it queues behind it.
    early = plan(
        {2: acts((H2D, 0)), 3: acts((WAIT, 0))},
        {0: acts((D2H, 0), (REL, 0)), 2: acts((REL, 1)), 3: acts((REL, 0), (HREL, 0))},
    )
    document = chrome_trace(TRACE, early)
    h2d = x_events(document, TRACK_H2D)[0]
    assert (h2d["ts"], h2d["dur"], h2d["args"]["queued_us"]) == (30, 10, 10)
    assert spans(x_events(document, TRACK_COMPUTE))[-1] == ("wait H2D s0", 30, 40)
    # With a faster D2H (done at 20) the same plan hides the H2D entirely.
    fast = dataclasses.replace(TRACE, d2h_bandwidth_gbps=2.0)
    document = chrome_trace(fast, early)
    assert not [e for e in x_events(document, TRACK_COMPUTE) if e["name"].startswith("wait")]
    assert spans(x_events(document, TRACK_COMPUTE))[-1] == ("op3", 30, 40)


def test_two_copy_streams_let_a_reload_pass_another_storages_d2h_but_not_its_own() -> None:
    """``copy_streams=2`` (one stream per direction): an H2D no longer queues behind an
    unrelated D2H, but still starts after the D2H that filled its own host copy."""
    # s2 (20 kB, written at op 1) is copied out while s0's reload is issued before op 2.
    trace = timed([{0: "W"}, {2: "W", 1: "W"}, {1: "R"}, {0: "R", 2: "R"}],
                  {0: 5_000, 1: 5_000, 2: 20_000}, [10] * 4)
    schedule = plan(
        {2: acts((H2D, 0)), 3: acts((WAIT, 0))},
        {0: acts((D2H, 0), (REL, 0)), 1: acts((D2H, 2)), 2: acts((REL, 1)),
         3: acts((REL, 0), (HREL, 0), (REL, 2))},
        trace=trace,
    )
    shared = predict_timeline(trace, schedule)
    split = predict_timeline(trace, schedule, copy_streams=2)
    h2d = lambda t: next(x for x in t.transfers if x.kind is H2D)  # noqa: E731
    assert h2d(shared).start_s == pytest.approx(40 * US)  # behind s2's D2H (20..40 µs)
    assert h2d(split).start_s == pytest.approx(20 * US)  # at its issue: its own D2H ended at 15
    assert split.exposed_transfer_s < shared.exposed_transfer_s
    # its own D2H still comes first: a D2H slower than the time to the reload's issue
    slow = dataclasses.replace(trace, d2h_bandwidth_gbps=0.2)  # s0's D2H: 10..35 µs
    assert h2d(predict_timeline(slow, schedule, copy_streams=2)).start_s == pytest.approx(35 * US)
    with pytest.raises(ValueError, match="copy_streams must be 1"):
        predict_timeline(trace, schedule, copy_streams=3)


def test_tracks_metadata_and_releases() -> None:
    document = chrome_trace(TRACE, LATE_PREFETCH, title="unit")
    names = {e["tid"]: e["args"]["name"] for e in document["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {TRACK_COMPUTE: "compute", TRACK_D2H: "copy stream: D2H",
                     TRACK_H2D: "copy stream: H2D", TRACK_RELEASES: "releases"}
    process = [e for e in document["traceEvents"] if e["name"] == "process_name"]
    assert process[0]["args"]["name"] == "unit"
    instants = [(e["name"], e["ts"]) for e in document["traceEvents"] if e["ph"] == "i"]
    assert instants == [("RELEASE_DEVICE s0", 10), ("RELEASE_DEVICE s1", 30),
                        ("RELEASE_DEVICE s0", 50), ("RELEASE_HOST s0", 50)]
    counters = [e["args"]["bytes"] for e in document["traceEvents"] if e["ph"] == "C"]
    assert counters == [20_000, 5_000, 5_000, 20_000]  # check_schedule's resident curve


def test_the_json_is_valid_trace_event_format(tmp_path: Path) -> None:
    path = write_chrome_trace(tmp_path / "plan.json", TRACE, LATE_PREFETCH)
    document = json.loads(path.read_text())
    assert isinstance(document["traceEvents"], list) and document["displayTimeUnit"] == "ms"
    for event in document["traceEvents"]:
        assert isinstance(event["name"], str) and event["pid"] == 1
        if event["ph"] == "X":
            assert isinstance(event["tid"], int)
            assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0
        assert event["ph"] in {"M", "X", "C", "i"}


def test_the_compile_lowering_waits_for_a_d2h_where_it_releases_the_device_bytes() -> None:
    # op0 0-10 µs; D2H of s0 issued at 10, 20 µs long; H2D issued at pre[3], 10 µs long.
    residency = predict_timeline(TRACE, LATE_PREFETCH)
    assert [(w.kind, w.start_s, w.end_s) for w in residency.waits] == [
        (H2D, pytest.approx(30 * US), pytest.approx(40 * US))]  # RELEASE_DEVICE frees, no wait
    lowered = predict_timeline(TRACE, LATE_PREFETCH, release_waits_for_d2h=True)
    assert [(w.kind, w.start_s, w.end_s) for w in lowered.waits] == [
        (D2H, pytest.approx(10 * US), pytest.approx(30 * US)),
        (H2D, pytest.approx(50 * US), pytest.approx(60 * US))]
    assert lowered.exposed_transfer_s == pytest.approx(30 * US)
    # The compile path's figure is this timeline, not a second model of it.
    timing = exposed_transfer_time(TRACE, LATE_PREFETCH)
    assert timing == pytest.approx((20 * US, 10 * US, 30 * US))


def test_missing_durations_default_to_the_mean_of_the_known_ones() -> None:
    trace = timed([{0: "W"}, {0: "R"}, {0: "R"}], {0: 8}, [10, None, 30])
    timeline = predict_timeline(trace, plan(trace=trace, post={2: acts((REL, 0))}))
    assert [op.end_s - op.start_s for op in timeline.ops] == pytest.approx([10 * US, 20 * US, 30 * US])
    assert [op.estimated for op in timeline.ops] == [False, True, False]
    explicit = predict_timeline(trace, plan(trace=trace), default_op_duration_s=0.0)
    assert explicit.compute_end_s == pytest.approx(40 * US)


def test_schedule_that_does_not_fit_is_refused_naming_the_problem() -> None:
    with pytest.raises(ValueError, match="3 op slots but the trace has 4 ops"):
        predict_timeline(TRACE, ResidencySchedule.empty(3))
    with pytest.raises(ValueError, match=r"pre\[3\] WAIT_H2D 0 has no COPY_H2D"):
        predict_timeline(TRACE, plan({3: acts((WAIT, 0))}))


@st.composite
def timed_traces(draw: st.DrawFn) -> ActivationTrace:
    trace = draw(traces(max_ops=16, max_storages=6))
    durations = st.one_of(st.none(), st.floats(0, 1e-3))
    ops = tuple(dataclasses.replace(op, duration_s=draw(durations)) for op in trace.ops)
    bandwidth = st.floats(1e-6, 1e-3)  # GB/s: a few bytes take micro- to milliseconds
    return dataclasses.replace(trace, ops=ops, d2h_bandwidth_gbps=draw(bandwidth),
                               h2d_bandwidth_gbps=draw(bandwidth))


@settings(max_examples=60, deadline=None)
@given(trace=timed_traces())
def test_planned_timelines_keep_the_stream_invariants(trace: ActivationTrace) -> None:
    schedule = GreedyResidencyPlanner().plan(trace)
    timeline = predict_timeline(trace, schedule)
    compute = sorted([(op.start_s, op.end_s) for op in timeline.ops]
                     + [(w.start_s, w.end_s) for w in timeline.waits])
    copies = [(t.start_s, t.end_s) for t in timeline.transfers]  # D2H and H2D together
    for lane in (compute, copies):
        for (_, end), (start, _) in zip(lane, lane[1:]):
            assert start >= end - 1e-15  # one stream: never two things at once
    assert [op.index for op in timeline.ops] == list(range(trace.num_ops))
    assert all(t.start_s >= t.issue_s for t in timeline.transfers)
    h2d_ends = {t.end_s for t in timeline.transfers if t.kind is H2D}
    assert all(w.end_s in h2d_ends and w.end_s > w.start_s for w in timeline.waits)
    assert timeline.compute_end_s == pytest.approx(timeline.compute_s + timeline.exposed_transfer_s)
    document = json.loads(json.dumps(chrome_trace(trace, schedule), allow_nan=False))
    assert len(x_events(document, TRACK_D2H)) == schedule.count(D2H)
    assert len(x_events(document, TRACK_H2D)) == schedule.count(H2D)
    assert len([e for e in x_events(document, TRACK_COMPUTE) if e["cat"] == "compute"]) == trace.num_ops
