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
        # str.isdigit accepts these, int() does not: must be a format error, not a crash.
        ([{"--3": "W"}], {3: 4}, (), r"storage id '--3' is not an integer"),
        ([{"\u00b2": "W"}], {2: 4}, (), r"storage id '\u00b2' is not an integer"),
        # Two keys naming one storage: merging would turn the WRITE into a READ.
        ([{1: "W", "1": "R"}], {1: 4}, (), r"ops\[0\]\.accesses: storage 1 is listed twice"),
        ([{1: "W"}], {1: 4, "01": 8}, (), r"sizes: storage 1 is listed twice"),
        ([{1: "W"}], [4], (), r"sizes: expected a mapping"),
        ([{12: "W"}], {12: 4}, "12", r"retained: expected a list of storage ids"),
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
        (_doc(storage_sizes={"0": 100, "00": 1, "1": 50, "2": 8}), r"storage 0 is listed twice"),
        (_doc(ops=[{"accesses": {"0": "W", "00": "R"}}]), r"trace\.ops\[0\]\.accesses: storage 0 is listed twice"),
        (_doc(ops=[{"accesses": {"-0x1": "W"}}]), r"trace\.ops\[0\]\.accesses: storage id '-0x1'"),
        (_doc(retaind=[2]), r"trace\.retaind: unknown field"),
        (_doc(ops=[{"accesses": {"0": "W"}, "duraton_s": 1.0}]), r"trace\.ops\[0\]\.duraton_s: unknown field"),
        (_doc(ops=[{"accesses": {"0": "W"}, "duration_s": float("nan")}]), r"trace\.ops\[0\]\.duration_s: expected a finite"),
        (_doc(d2h_bandwidth_gbps=float("inf")), r"trace\.d2h_bandwidth_gbps: expected a positive finite"),
        ("[" * 100_000 + "]" * 100_000, r"nested too deeply"),
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


def _schedule_doc(**changes) -> dict:
    doc = {"format": "hyper-offload.schedule", "version": 1, "num_ops": 3,
           "pre": {"1": ["COPY_H2D 0"]}, "post": {}}
    doc.update(changes)
    return doc


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (_schedule_doc(pre={"\u00b2": []}), r"schedule\.pre\['\u00b2'\]: expected op index"),
        (_schedule_doc(pre={"-1": []}), r"schedule\.pre\['-1'\]: expected op index"),
        (_schedule_doc(post={"0": ["RELEASE_DEVICE 0"], "00": ["RELEASE_HOST 0"]}),
         r"schedule\.post\['00'\]: op 0 is listed twice"),
        (_schedule_doc(psot={}), r"schedule\.psot: unknown field"),
        (_schedule_doc(pre={"1": ["COPY_H2D \u00b2"]}), r"storage is not an integer"),
        (_schedule_doc(post={"7": []}), r"post\[7\]: op index out of range"),
    ],
)
def test_schedule_json_schema_check(doc: dict, message: str) -> None:
    with pytest.raises(TraceFormatError, match=message):
        ResidencySchedule.from_dict(doc)


def test_schedule_slot_out_of_range_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"post\[5\]: op index out of range"):
        ResidencySchedule.from_slots(2, {}, {5: []})


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


def test_trace_op_built_directly_gets_enum_kinds_and_sorted_accesses() -> None:
    # Front doors build TraceOps directly; a plain "W" must still count as a write.
    op = TraceOp("add_", (StorageAccess(1, "W"), StorageAccess(0, "R")))  # type: ignore[arg-type]
    assert op.accesses == (StorageAccess(0, AccessKind.READ), StorageAccess(1, AccessKind.WRITE))
    assert all(type(a.kind) is AccessKind for a in op.accesses)
    trace = ActivationTrace(ops=(TraceOp("w", ((0, "W"),)), op), storage_sizes={0: 4, 1: 4},  # type: ignore[arg-type]
                            budget_bytes=8)
    assert trace.accesses_of(1) == ((1, AccessKind.WRITE),)
    assert ActivationTrace.from_json(trace.to_json()) == trace
    with pytest.raises(TraceFormatError, match=r"TraceOp\(mm\): access kind 'X' is not 'R' or 'W'"):
        TraceOp("mm", (StorageAccess(0, "X"),))  # type: ignore[arg-type]
