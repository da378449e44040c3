"""Op-granular recompute (issue 50 item 1): the spliced backward makes each recomputed
value right before the backward op that first needs it and lets it die after the last.

Before, a chain that needed another recomputed value materialized that value's shared
copy early and kept it to the value's own readers: in a Llama block, the MLP's backward
(first in the backward) recomputes ``h = x + attention(x)``, so the attention's output,
queries, keys and values were all held through the MLP backward (8B x 224K: +8 GB at
the floor). Now such a value is recomputed privately for the chain, unless it is
``held`` (recomputing it costs more than holding it: an attention output).

Structure on a small hand-written layer whose backward needs a recomputed value (``h``)
early for another's chain (``m``, whose reader comes first) and later for its own
readers; exactness with
``torch.equal`` on the eager kernels, aot_eager and Inductor (bf16, deterministic
algorithms) on a tiny Llama, every splice option recomputed.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn

import hyper_offload.runtime.ops  # noqa: F401 (materialize/discard real kernels)
from hyper_offload.compiler.recompute import splice as rs
from hyper_offload.compiler.recompute.candidates import copy_joint
from hyper_offload.compiler.recompute.rules import draws_random
from hyper_offload.passes.fx.cost_model import DeviceThroughput, node_seconds

from .compile_models import deterministic  # noqa: F401 (autouse)

MATERIALIZE = torch.ops.hyper_offload.materialize.default
GPU = DeviceThroughput(flops_per_s=400e12, bytes_per_s=2.6e12)
DIM = 8


def _layer(x: torch.Tensor, wa: torch.Tensor, wm: torch.Tensor) -> torch.Tensor:
    """An "attention" ``a`` feeding a residual ``h`` that the "MLP" ``m`` reads: the
    backward reads ``m`` first, whose chain needs ``h`` before ``h``'s own reader."""
    a = torch.tanh(x @ wa)
    h = x + a
    m = torch.sigmoid(h @ wm)
    return (m * h).sum()


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, DIM, generator=g).requires_grad_(),
            torch.randn(DIM, DIM, generator=g).requires_grad_(),
            torch.randn(DIM, DIM, generator=g).requires_grad_()]


def _partitions(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> dict[float, Any]:
    graphs = {}
    for budget in (1.0, 0.0):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            graphs[budget] = min_cut_rematerialization_partition(
                copy_joint(joint), joint_inputs, **kwargs)
    return graphs


def _splice_all(graphs: dict[float, Any], held: frozenset[str] | None = None) -> Any:
    (fw, bw), (_, zero_bw) = graphs[1.0], graphs[0.0]
    options = rs.splice_options(fw, bw, zero_bw, unrepeatable=draws_random,
                                seconds=lambda n: 1e-6)
    return rs.splice(fw, bw, zero_bw, options, held if held is not None else frozenset())


class _Capture:
    def __init__(self, held: frozenset[str] | None = None) -> None:
        self.held, self.graphs, self.spliced = held, {}, None

    def __call__(self, joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        self.graphs = _partitions(joint, joint_inputs, **kwargs)
        self.spliced = _splice_all(self.graphs, self.held)
        return self.spliced


def _run(partition_fn: Any) -> list[torch.Tensor]:
    inputs = _inputs()
    compiled = aot_function(_layer, fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g,
                            partition_fn=partition_fn)
    loss = compiled(*inputs)
    loss.backward()
    return [loss.detach(), *(i.grad for i in inputs)]


@pytest.fixture(scope="module")
def layer() -> _Capture:
    captured = _Capture()
    _run(captured)
    return captured


def _roles(spliced_bw: fx.GraphModule) -> tuple[list[fx.Node], set[fx.Node]]:
    """The backward's ops in order, and those a recompute made (chain nodes, barriers)."""
    ops = [n for n in spliced_bw.graph.nodes if n.op != "placeholder"]
    made = {n for n in ops if n.target is MATERIALIZE or "_recomputed" in n.name}
    return ops, made


def test_each_recomputed_value_is_made_right_before_its_first_use_and_dead_after_its_last(layer):
    ops, made = _roles(layer.spliced[1])
    index = {n: i for i, n in enumerate(ops)}
    for node in made:
        # the default backward's op it was made for: the next one in the graph
        target = next(n for n in ops[index[node]:] if n not in made)
        readers = [u for u in node.users if u not in made and u.op != "output"]
        if node.target is MATERIALIZE and readers:  # a recomputed value's shared copy
            assert min(index[u] for u in readers) == index[target], node  # its first use
            last = max(index[u] for u in readers)
            assert all(index[u] <= last for u in node.users), node  # dead after its last
        else:  # a chain's node, or a private copy: dies by the op it was made for
            assert all(index[u] <= index[target] for u in node.users), node


def test_a_value_a_chain_needs_before_its_first_reader_is_recomputed_privately(layer):
    ops, made = _roles(layer.spliced[1])
    barriers = [n for n in made if n.target is MATERIALIZE]
    private = [b for b in barriers if all(u in made for u in b.users)]
    assert private, "no chain needed a value early: the rule is untested"
    shared = {b.args[0].name for b in barriers if b not in private}
    for copy in private:  # recomputed again for its own readers, later
        assert copy.args[0].name.split("_recomputed")[0] in {s.split("_recomputed")[0]
                                                            for s in shared}


def test_a_held_value_is_recomputed_once_and_kept_for_its_readers():
    held = _Capture(held=frozenset({"add"}))  # h
    _run(held)
    _, made = _roles(held.spliced[1])
    barriers = [n for n in made if n.target is MATERIALIZE]
    h = [b for b in barriers if b.args[0].name.startswith("add_recomputed")]
    assert len(h) == 1 and any(u not in made for u in h[0].users)  # one copy, shared
    assert any(u in made for u in h[0].users)  # made early, for the chain of m


@pytest.mark.parametrize("held", [frozenset(), frozenset({"add"})], ids=["private", "held"])
def test_op_granular_graphs_give_every_gradient_bit_for_bit(held):
    expected = _run(min_cut_rematerialization_partition)
    got = _run(_Capture(held))
    assert [torch.equal(a, b) for a, b in zip(expected, got)] == [True] * len(expected)


class _SpliceEverything(CustomPartitionerFn):
    """Inductor's partitioner hook: the default partition with every splice option
    recomputed, op by op, those that cost more than a reload held (``held_options``, ops
    priced as a GPU, 16 GB/s: at these sizes none is)."""

    def __init__(self) -> None:
        self.private = 0

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        graphs = _partitions(gm, joint_inputs, **kwargs)
        (fw, bw), (_, zero_bw) = graphs[1.0], graphs[0.0]
        options = rs.splice_options(fw, bw, zero_bw, unrepeatable=draws_random,
                                    seconds=partial(node_seconds, throughput=GPU))
        fw, bw = rs.splice(fw, bw, zero_bw, options, rs.held_options(options, 16.0))
        _, made = _roles(bw)
        self.private += sum(n.target is MATERIALIZE and all(u in made for u in n.users)
                            for n in made)
        return fw, bw

    def uuid(self) -> Any:
        return "test_splice_granular"


def _llama_step(backend: Any) -> list[torch.Tensor]:
    from examples.llama_model import Llama, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab=64, dim=32, layers=1, heads=4, kv_heads=2, hidden=64,
                         max_seq_len=32)
    model = Llama(config).to(torch.bfloat16)
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    loss = torch.compile(model, backend=backend)(tokens, tokens)
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


def _inductor_with(partitioner: CustomPartitionerFn) -> Any:
    def compile_(gm: fx.GraphModule, inputs: Any) -> Any:
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx

        with config.patch(custom_partitioner_fn=partitioner):
            return compile_fx(gm, inputs)

    return compile_


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_tiny_llama_recomputed_op_by_op_is_bit_exact(inner):
    """A one-layer Llama in bf16, every value the splice can recompute recomputed (queries and keys read by
    attention alone included), against plain compile of the same inner compiler."""
    from torch._dynamo.backends.common import aot_autograd

    expected = _llama_step(inner)
    partitioner = _SpliceEverything()
    if inner == "inductor":
        backend = _inductor_with(partitioner)
    else:
        backend = aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g,
                               partition_fn=partitioner)
    got = _llama_step(backend)
    assert partitioner.private > 0  # a chain recomputed a value privately
    differ = [i for i, (a, b) in enumerate(zip(expected, got)) if not torch.equal(a, b)]
    assert not differ, f"{len(differ)} of {len(expected)} values differ (0 = the loss)"


def test_where_nothing_fits_the_search_cuts_the_backward_where_it_peaks():
    """The last resort of the splice search
    (:func:`hyper_offload.compiler.recompute.candidates.splice_candidates`):
    when no candidate meets the budget, every option recomputed with a stage barrier at
    the backward op where that plan peaks, so that no value recomputed before it is alive
    there: a held value a chain needs early is recomputed privately instead. Here every
    option counts as held (1 us per op, a few bytes), every plan "peaks" at the op whose
    chain needs ``h`` early, and only a backward with a private copy "fits"."""
    from types import SimpleNamespace

    from hyper_offload.compiler.recompute import candidates

    captured: dict[str, Any] = {}

    def grab(joint: fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        captured.update(joint=copy_joint(joint), inputs=inputs, kwargs=kwargs)
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    _run(grab)

    def partition(joint: fx.GraphModule) -> Any:
        return min_cut_rematerialization_partition(joint, captured["inputs"], **captured["kwargs"])

    def plan(fw: fx.GraphModule, bw: fx.GraphModule, budget: Any) -> Any:
        ops, made = _roles(bw)
        private = any(n.target is MATERIALIZE and all(u in made for u in n.users) for n in made)
        names = [f"bw:{n.name}" for n in ops if n not in made]
        resident = [int(name == "bw:mul_1") for name in names]  # m's reader: h needed early
        return SimpleNamespace(
            feasible=private, budget_bytes=0,
            check=SimpleNamespace(bytes_d2h=0, resident_bytes=resident),
            fx_trace=SimpleNamespace(peak_without_offload=0, op_nodes=names))

    def score(planned: Any) -> candidates.PlanScore:
        return candidates.PlanScore(1.0, 0.0, planned.feasible, 0)

    fw, bw = partition(copy_joint(captured["joint"]))
    default_plan = plan(fw, bw, None)
    default = candidates.Candidate(candidates.partition_report(1.0, default_plan, 0, score), fw, bw,
                                default_plan)
    found = candidates.splice_candidates(captured["joint"], partition, plan, default, 1.0,
                                  seconds=lambda n: 1e-6, score=score, reload_gbps=lambda g: 16.0)
    assert [c.report.feasible for c in found] == [False, True]  # every option; the last resort
    assert found[1].report.spliced == found[0].report.spliced  # both recompute every option


def test_a_stage_barrier_keeps_early_copies_off_its_op(layer):
    """No chain value or private copy made before the barrier op is alive while it runs,
    and a held value a chain needs before the barrier is recomputed privately there
    rather than held across it."""
    (fw, bw), (_, zero_bw) = layer.graphs[1.0], layer.graphs[0.0]
    options = rs.splice_options(fw, bw, zero_bw, unrepeatable=draws_random, seconds=lambda n: 1e-6)
    every = frozenset(o.name for o in options)  # all held
    _, cut = rs.splice(fw, bw, zero_bw, options, every, barriers={"mul_1"})
    ops, made = _roles(cut)
    index = {n: i for i, n in enumerate(ops)}
    (barrier,) = [n for n in ops if n.name == "mul_1"]
    for node in made:
        shared = any(u not in made for u in node.users)  # a value's copy for its own readers
        if index[node] < index[barrier] and not shared:
            assert all(index[u] <= index[barrier] for u in node.users), node
    _, whole = rs.splice(fw, bw, zero_bw, options, every)
    private = [n for n in made if n.target is MATERIALIZE and all(u in made for u in n.users)]
    assert private and not [n for n in _roles(whole)[1] if n.target is MATERIALIZE
                            and all(u in _roles(whole)[1] for u in n.users)]
