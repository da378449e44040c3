"""Structure tests of the compile path's pure passes on real AOTAutograd graphs of a
tiny MLP: the trace builder, the lowering, and the validator's verdict on schedules
re-derived from lowered graphs (including hand-broken ones)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition

from hyper_offload.passes import ActionKind, GreedyResidencyPlanner, Rule, check_schedule
from hyper_offload.passes.analysis.liveness import access_gaps
from hyper_offload.passes.fx.cost_model import exposed_transfer_time
from hyper_offload.passes.fx.graph_trace import build_fx_trace
from hyper_offload.passes.fx.lowering import LoweringError, lower_schedule
from hyper_offload.passes.fx.lowering_check import check_lowering, derive_schedule
from hyper_offload.passes.plan.placement import hoist_prefetches
from hyper_offload.runtime.ops import COPY_D2H, COPY_H2D, RELEASE_HOST, WAIT_TRANSFER


def capture(dtype: torch.dtype = torch.float32):
    """Forward/backward graphs of a 3-layer MLP (min-cut partition), and num_fwd_outputs."""
    torch.manual_seed(0)
    weights = [torch.randn(32, 32, dtype=dtype, requires_grad=True) for _ in range(3)]
    x = torch.randn(8, 32, dtype=dtype)
    got = {}

    def partition(gm, joint_inputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        got.update(fw=fw, bw=bw, num_fwd_outputs=kwargs["num_fwd_outputs"])
        return fw, bw

    def f(x, *ws):
        for w in ws:
            x = torch.nn.functional.gelu(x @ w)
        return x.sum()

    nop = lambda gm, _: gm  # noqa: E731
    aot_function(f, fw_compiler=nop, bw_compiler=nop, partition_fn=partition)(x, *weights)
    return got["fw"], got["bw"], got["num_fwd_outputs"]


def planned(budget_fraction: float):
    fw, bw, n = capture()
    fx_trace = build_fx_trace(fw, bw, num_fwd_outputs=n)
    trace = fx_trace.trace.with_budget(int(budget_fraction * fx_trace.peak_without_offload))
    fx_trace = dataclasses.replace(fx_trace, trace=trace)
    schedule = hoist_prefetches(
        trace, GreedyResidencyPlanner().plan(trace), earliest_op=fx_trace.num_fw_ops
    )
    return fw, bw, n, fx_trace, schedule


def test_trace_keeps_parameters_out_and_only_cross_graph_gaps_offloadable():
    fw, bw, n = capture()
    fx_trace = build_fx_trace(fw, bw, num_fwd_outputs=n)
    names = {s.name: s for s in fx_trace.saved}
    # primals saved for the backward (the input x, the weights) are not activations
    assert all(names[p].storage is None for p in names if p.startswith("primals"))
    offloadable = {s.storage for s in fx_trace.saved if s.offloadable}
    assert offloadable  # the matmul outputs (gelu inputs) and gelu outputs
    for gap in access_gaps(fx_trace.trace):
        assert gap.storage in offloadable
        assert gap.start < fx_trace.num_fw_ops <= gap.end  # from the forward into the backward
    assert fx_trace.op_nodes[0].startswith("fw:") and fx_trace.op_nodes[-1].startswith("bw:")


def test_lowering_inserts_copies_after_the_first_saved_tensor_and_reloads_before_readers():
    fw, bw, n, fx_trace, schedule = planned(0.0)
    groups = fx_trace.movable()
    assert any(s.base != s.name for g in groups.values() for s in g)  # views move too
    lower_schedule(fw, bw, fx_trace, schedule)
    nodes = list(fw.graph.nodes)
    copies = [i for i, node in enumerate(nodes) if node.target is COPY_D2H]
    assert len(copies) == len(groups)  # one copy per storage
    by_base = {g[0].base: g for g in groups.values()}
    for i in copies:
        source = nodes[i].args[0]
        group = by_base[source.name]
        # the copy reads the storage's base, right after the first saved tensor on it
        # (where Inductor realizes the base in the plain graph), or after the transfer
        # ops inserted there before it
        j = i - 1
        while nodes[j].target in (COPY_D2H, WAIT_TRANSFER):
            j -= 1
        first = min((n for n in nodes if n.name in {s.name for s in group}), key=nodes.index)
        assert nodes[j] is first
    output = fw.graph.find_nodes(op="output")[0].args[0]
    assert sum(1 for o in output if getattr(o, "target", None) is WAIT_TRANSFER) == len(copies)
    for node in bw.graph.find_nodes(op="call_function", target=WAIT_TRANSFER):
        copy, placeholder = node.args
        assert copy.target is COPY_H2D and placeholder.op == "placeholder"
        assert placeholder.meta["val"].device.type == "cpu"
        readers = [u for u in placeholder.users if u.target not in (COPY_H2D, WAIT_TRANSFER, RELEASE_HOST)]
        assert not readers  # every reader takes the reloaded value
    assert check_lowering(fw, bw, fx_trace, num_fwd_outputs=n).ok


def test_rederived_schedule_equals_the_planned_one():
    fw, bw, n, fx_trace, schedule = planned(0.0)
    lower_schedule(fw, bw, fx_trace, schedule)
    derived = derive_schedule(fw, bw, fx_trace, num_fwd_outputs=n)
    assert derived.count(ActionKind.COPY_H2D) == schedule.count(ActionKind.COPY_H2D)
    want = check_schedule(fx_trace.trace, schedule)
    got = check_schedule(fx_trace.trace, derived)
    assert got.ok and got.resident_bytes == want.resident_bytes


def _lowered():
    fw, bw, n, fx_trace, schedule = planned(0.0)
    lower_schedule(fw, bw, fx_trace, schedule)
    return fw, bw, n, fx_trace


def _rules(fw, bw, n, fx_trace):
    return {v.rule for v in check_lowering(fw, bw, fx_trace, num_fwd_outputs=n).violations}


def test_reader_moved_before_the_wait_is_rejected():
    fw, bw, n, fx_trace = _lowered()
    wait = bw.graph.find_nodes(op="call_function", target=WAIT_TRANSFER)[0]
    reader = next(u for u in wait.users if u.target is not RELEASE_HOST)
    reader.replace_input_with(wait, wait.args[0])  # reads the copy's result directly
    wait.prepend(reader)  # ... before the wait: the H2D may still be in flight
    bw.graph.lint()
    assert Rule.ACCESS_BEFORE_WAIT in _rules(fw, bw, n, fx_trace)


def test_reader_of_the_host_copy_without_reload_is_rejected():
    fw, bw, n, fx_trace = _lowered()
    wait = bw.graph.find_nodes(op="call_function", target=WAIT_TRANSFER)[0]
    copy, placeholder = wait.args
    for user in list(wait.users):
        if user.target is RELEASE_HOST:
            bw.graph.erase_node(user)
        else:
            user.replace_input_with(wait, placeholder)
    bw.graph.erase_node(wait)
    bw.graph.erase_node(copy)
    assert Rule.ACCESS_NOT_RESIDENT in _rules(fw, bw, n, fx_trace)


def test_missing_release_host_is_rejected():
    fw, bw, n, fx_trace = _lowered()
    bw.graph.erase_node(bw.graph.find_nodes(op="call_function", target=RELEASE_HOST)[0])
    assert Rule.HOST_NOT_RELEASED in _rules(fw, bw, n, fx_trace)


def test_a_compute_change_in_the_lowering_is_rejected():
    fw, bw, n, fx_trace = _lowered()
    node = next(n for n in bw.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.mm.default)
    with bw.graph.inserting_after(node):
        extra = bw.graph.call_function(torch.ops.aten.neg.default, (node,))
    extra.meta["val"] = node.meta["val"]
    with pytest.raises(LoweringError, match="no longer compute the planned ops"):
        derive_schedule(fw, bw, fx_trace, num_fwd_outputs=n)


def test_budget_at_peak_moves_nothing():
    _, _, _, fx_trace, schedule = planned(1.0)
    assert check_schedule(fx_trace.trace, schedule).num_transfers == 0


def test_hoisting_hides_copies_the_planner_left_exposed():
    _, _, _, fx_trace, _ = planned(0.6)
    slow = dataclasses.replace(fx_trace.trace, h2d_bandwidth_gbps=0.01)  # copies >> ops
    raw = GreedyResidencyPlanner().plan(slow)
    before = exposed_transfer_time(slow, raw)
    after = exposed_transfer_time(
        slow, hoist_prefetches(slow, raw, earliest_op=fx_trace.num_fw_ops)
    )
    assert after.h2d_s == pytest.approx(before.h2d_s)
    assert before.exposed_s > 0 and after.exposed_s <= before.exposed_s
    assert before.exposed_s <= before.d2h_s + before.h2d_s


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fraction=st.floats(0.0, 1.0))
def test_any_budget_lowers_to_a_schedule_the_validator_accepts(fraction):
    fw, bw, n, fx_trace, schedule = planned(fraction)
    report = check_schedule(fx_trace.trace, schedule)
    assert report.ok
    if report.num_transfers:
        lower_schedule(fw, bw, fx_trace, schedule)
        lowered = check_lowering(fw, bw, fx_trace, num_fwd_outputs=n)
        assert lowered.ok and lowered.bytes_moved == report.bytes_moved
        assert lowered.resident_bytes == report.resident_bytes
