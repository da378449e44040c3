"""Structure tests for the trace / schedule IR and its JSON formats."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_offload.passes import (
    AccessKind,
    ActionKind,
    ActivationTrace,
    OpGuide,
    ReplayMismatchError,
    ResidencyAction,
    ResidencySchedule,
    StorageAccess,
    TraceFormatError,
    TraceOp,
)


def small_trace() -> ActivationTrace:
    return ActivationTrace.from_accesses(
        [{0: "W"}, {"1": "W", 0: "R"}, {1: "R"}, {0: "R", 2: "W"}],
        {0: 100, "1": 50, 2: 8},
        budget_bytes=120,
        retained=[2],
    )


def test_from_accesses_builds_sorted_accesses_and_coerces_ids() -> None:
    trace = small_trace()
    assert trace.num_ops == 4
    assert trace.ops[1].accesses == (StorageAccess(0, AccessKind.READ), StorageAccess(1, AccessKind.WRITE))
    assert trace.storage_sizes == {0: 100, 1: 50, 2: 8}
    assert trace.retained == frozenset({2})
    assert trace.accesses_of(0) == ((0, AccessKind.WRITE), (1, AccessKind.READ), (3, AccessKind.READ))
    assert trace.operand_bytes(3) == 108
    assert repr(trace.ops[1]) == "TraceOp(op1: R0 W1)"


@pytest.mark.parametrize(
    ("ops", "sizes", "retained", "message"),
    [
        ([{0: "X"}], {0: 1}, (), r"ops\[0\]\.accesses\[0\]: expected 'R' or 'W'"),
        ([{0: "W"}, {1: "R"}], {0: 1}, (), r"ops\[1\] \(op1\): storage 1 has no entry in storage_sizes"),
        ([{0: "W"}], {0: -4}, (), r"expected a non-negative integer"),
        ([{0: "W"}], {0: 4}, (7,), r"retained: storage 7 is retained but no op accesses it"),
        ([{"a": "W"}], {0: 4}, (), r"storage id 'a' is not an integer"),
        (["W"], {0: 4}, (), r"ops\[0\]: expected a mapping"),
    ],
)
def test_from_accesses_rejects_malformed_input(ops, sizes, retained, message) -> None:
    with pytest.raises(TraceFormatError, match=message):
        ActivationTrace.from_accesses(ops, sizes, budget_bytes=10, retained=retained)


def test_negative_budget_is_rejected() -> None:
    with pytest.raises(TraceFormatError, match="budget_bytes: must be >= 0"):
        ActivationTrace.from_accesses([{0: "W"}], {0: 1}, budget_bytes=-1)


def test_trace_json_round_trip_keeps_everything() -> None:
    trace = ActivationTrace(
        ops=(
            TraceOp("mm", (StorageAccess(0, AccessKind.WRITE),), outputs=(0,), duration_s=1e-4),
            TraceOp("relu_", (StorageAccess(0, AccessKind.WRITE),)),
        ),
        storage_sizes={0: 64},
        budget_bytes=32,
        retained=frozenset({0}),
        d2h_bandwidth_gbps=12.5,
        h2d_bandwidth_gbps=25.0,
    )
    again = ActivationTrace.from_json(trace.to_json())
    assert again == trace
    assert again.ops[0].duration_s == 1e-4 and again.ops[0].outputs == (0,)
    assert again.d2h_bandwidth_gbps == 12.5


def _doc(**changes):
    doc = json.loads(small_trace().to_json())
    doc.update(changes)
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{nope", r"not valid JSON"),
        ("[]", r"expected a JSON object"),
        (_doc(format="other"), r"trace\.format"),
        (_doc(version=99), r"trace\.version: this build reads version 1, got 99"),
        (_doc(ops={"0": {}}), r"trace\.ops: expected a list"),
        (_doc(ops=[{"accesses": {"0": "W"}}, {"accesses": {"0": "Q"}}]), r"trace\.ops\[1\]\.accesses\['0'\]"),
        (_doc(ops=[{"accesses": {"0": "W"}, "duration_s": -1}]), r"trace\.ops\[0\]\.duration_s"),
        (_doc(ops=[{"accesses": {"0": "W"}, "outputs": [5]}]), r"trace\.ops\[0\] \(op0\)\.outputs: storage 5"),
        (_doc(budget_bytes=-3), r"trace\.budget_bytes"),
        (_doc(h2d_bandwidth_gbps=0), r"trace\.h2d_bandwidth_gbps"),
        (_doc(storage_sizes=[1, 2]), r"trace\.storage_sizes"),
    ],
)
def test_trace_json_schema_check_names_field_and_op(text: str, message: str) -> None:
    with pytest.raises(TraceFormatError, match=message):
        ActivationTrace.from_json(text)


def test_missing_required_field_is_named() -> None:
    doc = json.loads(small_trace().to_json())
    del doc["ops"]
    with pytest.raises(TraceFormatError, match=r"trace\.ops: required field is missing"):
        ActivationTrace.from_dict(doc)


def test_schedule_repr_and_json_round_trip() -> None:
    d2h = ResidencyAction(ActionKind.COPY_D2H, 3)
    assert repr(d2h) == "COPY_D2H 3"
    assert ResidencyAction.from_str("COPY_D2H 3") == d2h
    schedule = ResidencySchedule.from_slots(
        3,
        pre={2: [ResidencyAction(ActionKind.COPY_H2D, 3), ResidencyAction(ActionKind.WAIT_H2D, 3)]},
        post={0: [d2h, ResidencyAction(ActionKind.RELEASE_DEVICE, 3)]},
    )
    assert ResidencySchedule.from_json(schedule.to_json()) == schedule
    assert "post     0: COPY_D2H 3, RELEASE_DEVICE 3" in repr(schedule)
    assert schedule.count(ActionKind.COPY_H2D) == 1
    assert [(i, where) for i, where, _ in schedule.actions()] == [(0, "post"), (0, "post"), (2, "pre"), (2, "pre")]


@pytest.mark.parametrize("text", ["COPY 1", "COPY_D2H x", "COPY_D2H", "RELEASE_HOST 1 2"])
def test_action_parse_errors(text: str) -> None:
    with pytest.raises(TraceFormatError, match="schedule action"):
        ResidencyAction.from_str(text)


def test_schedule_slot_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"post\[5\]: op index out of range"):
        ResidencySchedule.from_slots(2, {}, {5: []})


def test_op_guide_binds_leaves_and_detects_a_changed_step() -> None:
    trace = ActivationTrace(
        ops=(TraceOp("split", (StorageAccess(0, AccessKind.WRITE), StorageAccess(1, AccessKind.WRITE)), outputs=(0, 1)),),
        storage_sizes={0: 4, 1: 4},
        budget_bytes=8,
    )
    guide = OpGuide.from_trace(trace)
    assert guide.storage_of_leaf(0, 1) == 1
    assert guide.check_op(0, "split", 2).output_leaf_count == 2
    with pytest.raises(ReplayMismatchError, match="warmup recorded split with 2 output tensors, replay ran mm with 1"):
        guide.check_op(0, "mm", 1)
    with pytest.raises(ReplayMismatchError, match="recorded only 1 ops"):
        guide.check_op(1, "mm", 1)


access_maps = st.lists(
    st.dictionaries(st.integers(0, 6), st.sampled_from(["R", "W"]), min_size=1, max_size=3),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(ops=access_maps, budget=st.integers(0, 10_000), data=st.data())
def test_any_trace_round_trips_through_json(ops, budget, data) -> None:
    sizes = {s: data.draw(st.integers(0, 4096)) for s in range(7)}
    used = sorted({s for op in ops for s in op})
    retained = data.draw(st.lists(st.sampled_from(used), unique=True))
    trace = ActivationTrace.from_accesses(ops, sizes, budget_bytes=budget, retained=retained)
    assert ActivationTrace.from_json(trace.to_json()) == trace
