"""The recompute search's rules on hand-built graphs (nothing here compiles a model).

``choose_partition`` is driven by a stub partitioner (one pair of graphs per
``activation_memory_budget``) and a stub planner (a price per partition), so each test
pins one rule: when the search runs, which partition wins, what is rejected, what is
reported.
"""

from __future__ import annotations

import math
import warnings
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from hyper_offload.compiler.recompute.candidates import copy_joint, refine_count, share_counts
from hyper_offload.compiler.recompute.rules import (
    draws_random,
    low_precision_bans,
    recomputed_nodes,
    uses_low_precision,
)
from hyper_offload.compiler.recompute.search import choose_partition

aten = torch.ops.aten


def _node(graph: fx.Graph, name: str, target, args, dtype=torch.float32, shape=(4,)) -> fx.Node:
    node = graph.create_node("call_function", target, args, name=name)
    node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
    return node


def _placeholder(graph: fx.Graph, name: str, dtype=torch.float32, shape=(4,)) -> fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
    return node


def _pair(saved: list[str], recomputed: list[str], target=aten.relu.default):
    """A forward that computes and saves ``saved`` and a backward that recomputes
    ``recomputed`` (ops named as the partitioner names them: the same in both graphs)."""
    fw, bw = fx.Graph(), fx.Graph()
    x = _placeholder(fw, "x")
    outputs = [_node(fw, name, target, (x,)) for name in {*saved, *recomputed}]
    fw.output(tuple(o for o in outputs if o.name in saved))
    y = _placeholder(bw, "x")
    bw.output(tuple(_node(bw, name, target, (y,)) for name in recomputed))
    return fx.GraphModule(torch.nn.Module(), fw), fx.GraphModule(torch.nn.Module(), bw)


class _Stubs:
    """Partitions per ``activation_memory_budget`` and their prices."""

    def __init__(self, pairs, prices, target=aten.relu.default, accesses=10):
        self.graphs = {b: _pair(s, r, target) for b, (s, r) in pairs.items()}
        self.prices = prices
        self.accesses = accesses  # each plan's trace: its planning work
        self.partitioned: list[float] = []
        self.budgets: list[int | None] = []

    def partition(self, joint):
        budget = float(torch._functorch.config.activation_memory_budget)
        self.partitioned.append(budget)
        return self.graphs[budget]

    def plan(self, fw, bw, budget):
        self.budgets.append(budget)
        (memory_budget,) = [b for b, g in self.graphs.items() if g[0] is fw]
        compute, stall, feasible, peak, *after = self.prices[memory_budget]
        peak_after = after[0] if after else (min(peak, 100) if feasible else 150)
        ops = (SimpleNamespace(accesses=(None,) * self.accesses),)
        return SimpleNamespace(
            fx_trace=SimpleNamespace(trace=SimpleNamespace(budget_bytes=100, ops=ops),
                                     peak_without_offload=peak),
            check=SimpleNamespace(peak_resident_bytes=peak_after, bytes_d2h=1),
            predicted_stall_s=stall, compute_s=compute, step_s=compute + stall, feasible=feasible,
            budget_bytes=100,  # GraphPlan.budget_bytes: the budget asked for
        )


JOINT = fx.GraphModule(torch.nn.Module(), fx.Graph())
JOINT.graph.output(())


def _choose(stubs, mode="auto", grid=(0.8, 0.5, 0.0)):
    return choose_partition(
        JOINT, stubs.partition, stubs.plan, mode=mode, restrict_low_precision=False, grid=grid,
    )


def test_a_stall_free_default_partition_is_kept_without_searching():
    stubs = _Stubs({1.0: (["a"], [])}, {1.0: (1.0, 0.0, True, 200)})
    choice = _choose(stubs)
    assert stubs.partitioned == [1.0] and not choice.report.searched
    assert choice.report.recomputed == () and choice.report.joint_s == 1.0
    assert choice.report.offload_only_s == 1.0


def test_off_never_searches_even_when_the_default_stalls():
    stubs = _Stubs({1.0: (["a"], [])}, {1.0: (1.0, 5.0, True, 200)})
    choice = _choose(stubs, mode="off")
    assert stubs.partitioned == [1.0] and not choice.report.searched and choice.report.mode == "off"


def test_the_least_predicted_step_wins_under_the_default_partitions_budget():
    stubs = _Stubs(
        {1.0: (["a", "b"], []), 0.8: (["a"], ["b"]), 0.5: (["x"], ["a", "b"]), 0.0: (["x"], ["a", "b"])},
        {1.0: (1.0, 5.0, True, 200), 0.8: (1.5, 1.0, True, 150), 0.5: (1.7, 0.0, True, 90),
         0.0: (9.0, 0.0, True, 90)},
    )
    choice = _choose(stubs)
    report = choice.report
    assert report.searched and report.memory_budget == 0.5 and choice.fw is stubs.graphs[0.5][0]
    assert report.recomputed == ("a", "b") and report.joint_s == pytest.approx(1.7)
    assert report.offload_only_s == 6.0
    assert report.recompute_only_s == pytest.approx(1.7)  # 0.5 fits alone (peak 90 <= 100)
    # every searched partition is planned under the default partition's byte budget
    assert stubs.budgets == [None, 100, 100]
    # 0.0 saves what 0.5 saves: the same partition, not planned twice
    assert [p.memory_budget for p in report.partitions] == [1.0, 0.8, 0.5]
    assert stubs.partitioned == [1.0, 0.8, 0.5, 0.0]


def test_ties_keep_the_partition_that_recomputes_less():
    stubs = _Stubs(
        {1.0: (["a"], []), 0.8: (["b"], ["a"]), 0.5: (["c"], ["a"]), 0.0: (["c"], ["a"])},
        {1.0: (1.0, 2.0, True, 200), 0.8: (2.0, 0.0, True, 150), 0.5: (2.0, 0.0, True, 150),
         0.0: (2.0, 0.0, True, 150)},
    )
    assert _choose(stubs).report.memory_budget == 0.8


def test_a_feasible_partition_beats_a_faster_infeasible_one_and_none_feasible_takes_the_lowest_peak():
    prices = {1.0: (1.0, 0.0, False, 300), 0.8: (1.0, 3.0, True, 150), 0.5: (0.5, 0.0, False, 300),
              0.0: (0.5, 0.0, False, 300)}
    pairs = {1.0: (["a"], []), 0.8: (["b"], ["a"]), 0.5: (["c"], ["a"]), 0.0: (["d"], ["a"])}
    assert _choose(_Stubs(pairs, prices)).report.memory_budget == 0.8
    none_fit = {**prices, 0.8: (1.0, 3.0, False, 300, 120)}
    report = _choose(_Stubs(pairs, none_fit)).report
    assert report.offload_only_s is None and report.recompute_only_s is None
    assert report.memory_budget == 0.8  # the plan closest to the budget (120 B < 150 B)
    report = _choose(_Stubs(pairs, {**none_fit, 0.8: (1.0, 3.0, False, 300)})).report
    assert report.memory_budget == 0.5  # all end at 150 B: the least step, first on ties


def test_a_partition_that_recomputes_a_random_op_is_rejected():
    stubs = _Stubs(
        {1.0: (["a"], []), 0.8: (["b"], ["a"])},
        {1.0: (1.0, 5.0, True, 200), 0.8: (1.0, 0.0, True, 150)},
        target=aten.native_dropout.default,
    )
    report = _choose(stubs, grid=(0.8,)).report
    assert report.memory_budget == 1.0
    (rejected,) = [p for p in report.partitions if p.rejected]
    assert rejected.memory_budget == 0.8 and "random" in rejected.rejected and "a" in rejected.rejected
    assert stubs.budgets == [None]  # never planned


def test_only_budgets_below_the_users_are_searched():
    stubs = _Stubs({0.5: (["a"], []), 0.0: (["b"], ["a"])},
                   {0.5: (1.0, 5.0, True, 200), 0.0: (1.0, 0.0, True, 150)})
    with torch._functorch.config.patch(activation_memory_budget=0.5):
        report = _choose(stubs).report
    assert stubs.partitioned == [0.5, 0.0] and report.memory_budget == 0.0


def test_draws_random_reads_the_dropout_probability_of_attention():
    graph = fx.Graph()
    q = _placeholder(graph, "q", shape=(1, 1, 4, 8))
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    expected = {
        _node(graph, "drop", aten.native_dropout.default, (q, 0.1, True)): True,
        _node(graph, "rand", aten.rand_like.default, (q,)): True,
        _node(graph, "add", aten.add.Tensor, (q, q)): False,
        _node(graph, "sdpa_default", sdpa, (q, q, q)): False,  # dropout_p defaults to 0
        _node(graph, "sdpa_zero", sdpa, (q, q, q, 0.0)): False,
        _node(graph, "sdpa_arg", sdpa, (q, q, q, 0.1)): True,
    }
    keyword = _node(graph, "sdpa_kwarg", sdpa, (q, q, q))
    keyword.kwargs = {"dropout_p": 0.2}
    expected[keyword] = True
    assert {n.name: draws_random(n) for n in expected} == {n.name: v for n, v in expected.items()}


def _low_precision_joint() -> fx.GraphModule:
    """primal (bf16) -> mm (bf16, an extern kernel) -> to fp32 -> exp -> to bf16; a
    pointwise bf16 add -> to fp32 -> mul; a view; one backward op."""
    graph = fx.Graph()
    w = _placeholder(graph, "primals_1", torch.bfloat16, (4, 4))
    t = _placeholder(graph, "tangents_1", torch.bfloat16, (4, 4))
    mm = _node(graph, "mm", aten.mm.default, (w, w), torch.bfloat16, (4, 4))
    up = _node(graph, "up", aten._to_copy.default, (mm,), torch.float32, (4, 4))
    exp = _node(graph, "exp", aten.exp.default, (up,), torch.float32, (4, 4))
    _node(graph, "down", aten._to_copy.default, (exp,), torch.bfloat16, (4, 4))
    add = _node(graph, "add", aten.add.Tensor, (mm, w), torch.bfloat16, (4, 4))
    up2 = _node(graph, "up2", aten._to_copy.default, (add,), torch.float32, (4, 4))
    _node(graph, "mul", aten.mul.Tensor, (up2, up2), torch.float32, (4, 4))
    _node(graph, "from_primal", aten._to_copy.default, (w,), torch.float32, (4, 4))
    _node(graph, "view", aten.view.default, (add, [16]), torch.bfloat16, (16,))
    _node(graph, "grad", aten.mul.Tensor, (t, mm), torch.bfloat16, (4, 4))
    graph.output(())
    return fx.GraphModule(torch.nn.Module(), graph)


def test_low_precision_bans_keep_fused_rounding_out_of_recompute():
    joint = _low_precision_joint()
    assert uses_low_precision(joint)
    banned = low_precision_bans(joint, default_recomputed=set())
    # bf16 results (mm, down, add) and fp32 math on a fused bf16 value (up2) are banned;
    # fp32 math on stored values (up from the mm, exp, from_primal), views and the
    # backward are not
    assert banned == {"mm", "down", "add", "up2"}
    assert low_precision_bans(joint, default_recomputed={"add", "down"}) == {"mm", "up2"}


def test_low_precision_bans_ban_matmul_results_under_max_autotune():
    with torch._inductor.config.patch(max_autotune=True):
        banned = low_precision_bans(_low_precision_joint(), default_recomputed=set())
    assert "up" in banned and "from_primal" not in banned


def test_fp32_graphs_are_not_low_precision():
    graph = fx.Graph()
    x = _placeholder(graph, "primals_1")
    _node(graph, "relu", aten.relu.default, (x,))
    t = _placeholder(graph, "tangents_1", torch.bfloat16)
    _node(graph, "grad", aten.mul.Tensor, (t, t), torch.bfloat16)
    graph.output(())
    assert not uses_low_precision(fx.GraphModule(torch.nn.Module(), graph))


def test_copy_joint_is_rewritable_without_touching_the_original():
    joint = _low_precision_joint()
    duplicate = copy_joint(joint)
    node = next(n for n in duplicate.graph.nodes if n.name == "mm")
    node.meta["recompute"] = "x"
    duplicate.graph.erase_node(next(n for n in duplicate.graph.nodes if n.name == "grad"))
    assert "recompute" not in next(n for n in joint.graph.nodes if n.name == "mm").meta
    assert any(n.name == "grad" for n in joint.graph.nodes)
    assert [n.name for n in duplicate.graph.nodes if n.name != "grad"] == [
        n.name for n in joint.graph.nodes if n.name != "grad"
    ]


def test_copy_joint_warns_nothing_on_a_pytree_graph():
    # Joint graphs of modules carry a pytree codegen (in/out specs with LeafSpecs), whose
    # deep copy made torch warn "`isinstance(treespec, LeafSpec)` is deprecated" at every
    # compile (issue 30: make demo printed it).
    joint = make_fx(lambda xs: [x.sin() for x in xs])([torch.ones(2), torch.ones(3)])
    assert type(joint.graph._codegen).__name__ == "_PyTreeCodeGen"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        duplicate = copy_joint(joint)
    assert [str(w.message) for w in caught] == []
    assert duplicate.code == joint.code


def test_recomputed_nodes_are_forward_ops_the_backward_runs_again():
    fw, bw = _pair(["a"], ["b", "c"])
    assert recomputed_nodes(fw, bw) == {"b", "c"}


def test_share_counts_are_the_fewest_leading_options_covering_each_share():
    sizes = [50, 30, 10, 10]  # 100 bytes, in recompute order
    assert share_counts(sizes, (0.25, 0.5, 0.8, 0.9, 1.0)) == [1, 2, 3, 4]
    assert share_counts(sizes, (0.1, 0.5)) == [1]  # one count per share at most, no repeats
    assert share_counts([], (0.5, 1.0)) == []


def _priced(step):
    calls: list[int] = []

    def price(count: int) -> float:
        calls.append(count)
        return step(count)

    return price, calls


def test_refine_count_bisects_towards_the_best_count_between_two_shares():
    step = lambda count: abs(count - 13) + 100.0  # noqa: E731 - best at 13, between shares 8 and 28
    price, calls = _priced(step)
    scores = refine_count({0: step(0), 8: step(8), 28: step(28), 40: step(40)}, price, limit=6)
    assert min(scores, key=scores.get) == 13
    assert len(calls) <= 6 and len(set(calls)) == len(calls)  # never priced twice
    assert all(0 < c < 28 for c in calls)  # only between the best share's neighbours (8 is best)


def test_refine_count_stops_at_its_limit_and_prices_nothing_while_nothing_fits():
    price, calls = _priced(lambda count: float(count))
    refine_count({0: 50.0, 64: 10.0, 128: 90.0}, price, limit=3)
    assert len(calls) == 3
    price, calls = _priced(lambda count: 1.0)
    assert refine_count({0: math.inf, 8: math.inf}, price, limit=6) == {0: math.inf, 8: math.inf}
    assert calls == []


@settings(max_examples=200, deadline=None)
@given(best=st.integers(0, 200), slope_below=st.floats(0.01, 10), slope_above=st.floats(0.01, 10),
       coarse=st.lists(st.integers(1, 200), min_size=1, max_size=5, unique=True))
def test_refine_count_finds_the_minimum_of_a_falling_then_rising_step(best, slope_below, slope_above, coarse):
    """A step that falls (less stall) and then rises (more recompute) with the count:
    within 2 * log2(200) + 2 prices the bisection lands on its minimum."""
    def step(count: int) -> float:
        return 100.0 + (best - count) * slope_below if count <= best else 100.0 + (count - best) * slope_above

    price, calls = _priced(step)
    counts = sorted({0, 200, *coarse})
    scores = refine_count({c: step(c) for c in counts}, price, limit=2 * 8 + 2)
    assert min(scores.values()) == step(best)


def test_the_search_stops_at_its_work_bound_and_keeps_what_it_found():
    """The bound is planning work (trace accesses), never seconds: the same search on any
    machine, under any load (issue 43)."""
    pairs = {1.0: (["a", "b"], []), 0.8: (["a"], ["b"]), 0.5: (["x"], ["a", "b"]),
             0.2: (["y"], ["a", "b", "x"])}
    prices = {1.0: (1.0, 5.0, True, 200), 0.8: (1.5, 1.0, True, 150),
              0.5: (1.7, 0.0, True, 90), 0.2: (1.2, 0.0, True, 90)}
    choose = partial(choose_partition, JOINT, mode="auto", restrict_low_precision=False,
                     grid=(0.8, 0.5, 0.2))
    unbounded = _Stubs(pairs, prices, accesses=1000)
    assert not choose(unbounded.partition, unbounded.plan, bounded=False).report.work_bounded
    assert unbounded.partitioned == [1.0, 0.8, 0.5, 0.2]
    # Large plans and no floor to the bound: it may spend what the default partition's
    # plan took, one more partition, then stops.
    bounded = _Stubs(pairs, prices, accesses=1000)
    report = choose(bounded.partition, bounded.plan, min_work=0).report
    assert report.work_bounded and bounded.partitioned == [1.0, 0.8]
    assert report.partitions[0].memory_budget == 1.0  # the default is always planned
    # The same plans under the default floor (SEARCH_MIN_WORK): the whole grid.
    generous = _Stubs(pairs, prices, accesses=1000)
    assert not choose(generous.partition, generous.plan).report.work_bounded
    assert generous.partitioned == [1.0, 0.8, 0.5, 0.2]
    # The bound reads no clock: twice the same search, the same partitions and choice.
    again = _Stubs(pairs, prices, accesses=1000)
    assert choose(again.partition, again.plan, min_work=0).report == report
