"""The spliced backward's rules on the graphs of a tiny bf16 block (no Inductor here).

The graphs are AOTAutograd's own partitions of one small function: torch's default
partition and its ``activation_memory_budget=0`` partition, captured once per module.
Each test pins one invariant of :mod:`hyper_offload.compiler.recompute.splice`; the
spliced graphs also run on eager kernels and must give every gradient bit for bit.
(Exactness under Inductor is ``tests/compiler/test_recompute_numerics.py``.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition

# The spliced graphs run materialize/discard: their real kernels (run alone, this module
# would otherwise depend on another test having imported them first).
import hyper_offload.runtime.ops  # noqa: F401
from hyper_offload.compiler.recompute import splice as rs
from hyper_offload.compiler.recompute.candidates import copy_joint
from hyper_offload.compiler.recompute.rules import draws_random

aten = torch.ops.aten
DIM = 16


def _block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = F.layer_norm(x, (DIM,))
    u = F.gelu(h @ w1) * torch.sigmoid(h @ w1)
    return (torch.tanh(u @ w2) + x).float().square().sum()


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(8, DIM, generator=g).bfloat16().requires_grad_(),
        torch.randn(DIM, 2 * DIM, generator=g).bfloat16().requires_grad_(),
        torch.randn(2 * DIM, DIM, generator=g).bfloat16().requires_grad_(),
    ]


def _block_returning_a_saved_value(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_block``'s shape with ``y`` also returned: ``y`` is then both a user output and
    saved for backward (tanh's derivative reads it), so it stands in both parts of the
    forward's outputs."""
    h = F.layer_norm(x, (DIM,))
    u = F.gelu(h @ w1) * torch.sigmoid(h @ w1)
    y = torch.tanh(u @ w2)
    return (y + x).float().square().sum(), y


def _run(partition_fn: Any, fn: Any = _block) -> list[torch.Tensor]:
    """Outputs and input gradients of one step of ``fn`` with ``partition_fn`` (the
    backward runs from the sum of the outputs)."""
    inputs = _inputs()
    compiled = aot_function(fn, fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g,
                            partition_fn=partition_fn)
    outputs = compiled(*inputs)
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    sum(o.float().sum() for o in outputs).backward()
    return [*(o.detach() for o in outputs), *(i.grad for i in inputs)]


class Partitions:
    """torch's default and budget-0 partitions of the same joint graph."""

    def __init__(self) -> None:
        self.graphs: dict[float, tuple[fx.GraphModule, fx.GraphModule]] = {}

    def __call__(self, joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        for budget in (1.0, 0.0):
            with torch._functorch.config.patch(activation_memory_budget=budget):
                self.graphs[budget] = min_cut_rematerialization_partition(
                    copy_joint(joint), joint_inputs, **kwargs)
        return self.graphs[1.0]


@pytest.fixture(scope="module")
def partitions() -> Partitions:
    captured = Partitions()
    _run(captured)
    return captured


@pytest.fixture(scope="module")
def partitions_with_saved_output() -> Partitions:
    captured = Partitions()
    _run(captured, _block_returning_a_saved_value)
    return captured


def _options(p: Partitions, **kwargs: Any) -> tuple[rs.SpliceOption, ...]:
    (fw, bw), (_, zero_bw) = p.graphs[1.0], p.graphs[0.0]
    return rs.splice_options(fw, bw, zero_bw, unrepeatable=kwargs.pop("unrepeatable", draws_random),
                             seconds=lambda n: 1e-6, **kwargs)


def _saved(bw: fx.GraphModule) -> list[str]:
    return [n.name for n in rs._saved_inputs(bw)]


def test_options_are_saved_values_recomputed_from_saved_values_or_inputs(partitions):
    options = _options(partitions)
    assert options, "budget 0 recomputes something the default partition saves"
    fw, bw = partitions.graphs[1.0]
    saved = set(_saved(bw))
    zero = {n.name: n for n in partitions.graphs[0.0][1].graph.nodes}
    for option in options:
        assert option.name in saved and option.chain[-1] == option.name
        inside = set(option.chain)
        leaves = {i.name for n in option.chain for i in zero[n].all_input_nodes} - inside
        # every chain starts where plain compile reads from memory: a saved value or an input
        assert all(leaf in saved or rs.is_primal(zero[leaf]) for leaf in leaves), option
        # and no chain runs through another saved value (it would skip that value's rounding)
        assert not (inside - {option.name}) & saved, option
        assert option.nbytes > 0 and option.seconds > 0


def test_a_chain_that_draws_random_numbers_is_no_option(partitions):
    assert _options(partitions) and not _options(partitions, unrepeatable=lambda n: True)


def test_recompute_order_puts_most_bytes_per_second_first():
    cheap = rs.SpliceOption("a", ("a",), nbytes=100, seconds=1.0)
    dear = rs.SpliceOption("b", ("b",), nbytes=100, seconds=4.0)
    big = rs.SpliceOption("c", ("c",), nbytes=1000, seconds=4.0)
    assert [o.name for o in rs.recompute_order([dear, cheap, big])] == ["c", "a", "b"]


def _node(graph: fx.Graph, name: str, target: Any, args: tuple, dtype: torch.dtype) -> fx.Node:
    node = graph.create_node("call_function", target, args, name=name)
    node.meta["val"] = torch.empty(4, dtype=dtype, device="meta")
    return node


@pytest.mark.parametrize("dtype,forward_user,target,expected", [
    (torch.bfloat16, True, aten.relu.default, True),
    (torch.float16, True, aten.relu.default, True),
    (torch.float32, True, aten.relu.default, False),  # fp32 is never rounded
    (torch.bfloat16, False, aten.relu.default, False),  # only saved: nothing to round for
    (torch.bfloat16, True, aten.mm.default, False),  # not pointwise: stored as computed
])
def test_saved_values_inductor_rounds_for_forward_users_are_no_option(dtype, forward_user, target, expected):
    graph = fx.Graph()
    x = graph.placeholder("x")
    value = _node(graph, "value", target, (x,) if target is aten.relu.default else (x, x), dtype)
    outputs = [value]
    if forward_user:
        outputs.append(_node(graph, "user", aten.neg.default, (value,), dtype))
    graph.output(tuple(outputs))
    assert rs.rounded_for_forward_users(value) is expected


def _spliced(p: Partitions, options: tuple[rs.SpliceOption, ...]):
    (fw, bw), (_, zero_bw) = p.graphs[1.0], p.graphs[0.0]
    return rs.splice(fw, bw, zero_bw, options)


def _recompute_nodes(spliced: fx.GraphModule) -> tuple[list[fx.Node], list[fx.Node]]:
    """The spliced backward's chain nodes and its barriers (materialize copies)."""
    ops = [n for n in spliced.graph.nodes if n.op != "placeholder"]
    barriers = [n for n in ops if n.target is torch.ops.hyper_offload.materialize.default]
    return [n for n in ops if "_recomputed" in n.name], barriers


def test_the_spliced_backward_runs_the_default_backward_node_for_node(partitions):
    options = _options(partitions)
    _, bw = partitions.graphs[1.0]
    _, spliced = _spliced(partitions, options)
    chain, barriers = _recompute_nodes(spliced)
    ops = [n for n in spliced.graph.nodes if n.op != "placeholder"]
    rest = [n for n in ops if n not in barriers and n not in chain]
    assert [n.name for n in rest] == [n.name for n in bw.graph.nodes if n.op != "placeholder"]
    # each recomputed value reaches the default backward's nodes through one barrier (one
    # rounding store), never straight from its chain; other barriers serve chains only
    dropped = {o.name for o in options}
    shared = {b for b in barriers if any(u in rest for u in b.users)}
    assert sorted(b.args[0].name.removesuffix("_recomputed").rsplit("_recomputed", 1)[0]
                  for b in shared) == sorted(dropped)
    for node in rest:
        assert not {i.name for i in node.all_input_nodes} & dropped, node
        assert all(i in barriers for i in node.all_input_nodes if i in chain or i in barriers)
    assert any(u in chain for b in barriers for u in b.users), (
        "no chain reads another recomputed value: the rule is untested")


def test_the_forward_discards_each_dropped_value_right_after_its_producer(partitions):
    options = _options(partitions)
    fw, _ = partitions.graphs[1.0]
    spliced_fw, _ = _spliced(partitions, options)
    nodes = list(spliced_fw.graph.nodes)
    discards = [n for n in nodes if n.target is torch.ops.hyper_offload.discard.default]
    assert sorted(d.args[0].name for d in discards) == sorted(o.name for o in options)
    for discard in discards:
        # before any consumer is lowered: Inductor realizes the value where plain compile does
        assert nodes[nodes.index(discard) - 1] is discard.args[0]
    (out,) = spliced_fw.graph.find_nodes(op="output")
    (plain_out,) = fw.graph.find_nodes(op="output")
    assert len(out.args[0]) == len(plain_out.args[0]) + _added_inputs(partitions, options)
    if "desc" in plain_out.meta:  # which outputs are saved for backward, one per output
        assert len(out.meta["desc"]) == len(out.args[0])


def _added_inputs(p: Partitions, options: tuple[rs.SpliceOption, ...]) -> int:
    _, spliced_bw = _spliced(p, options)
    _, bw = p.graphs[1.0]
    return len(spliced_bw.graph.find_nodes(op="placeholder")) - len(bw.graph.find_nodes(op="placeholder"))


def _splicing(choose: Any) -> Any:
    """A partition function: this joint graph's default partition with the options
    ``choose`` picks (from this graph's own options) recomputed by the spliced backward."""

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        fresh = Partitions()
        fresh(joint, joint_inputs, **kwargs)
        return _spliced(fresh, choose(_options(fresh)))

    return partition


@pytest.mark.parametrize("share", [0.3, 1.0])
def test_spliced_graphs_give_every_gradient_bit_for_bit(partitions, share):
    options = rs.recompute_order(_options(partitions))
    chosen = options[: max(1, round(len(options) * share))]
    expected = _run(lambda joint, inputs, **kw: min_cut_rematerialization_partition(joint, inputs, **kw))

    names = {o.name for o in chosen}
    got = _run(_splicing(lambda options: tuple(o for o in options if o.name in names)))
    assert [torch.equal(a, b) for a, b in zip(expected, got)] == [True] * len(expected)


def test_under_max_autotune_no_chain_runs_a_matmul(partitions):
    matmuls = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    zero = {n.name: n for n in partitions.graphs[0.0][1].graph.nodes}
    plain = _options(partitions)
    assert any(zero[n].target in matmuls for o in plain for n in o.chain)  # the test can fail
    tuned = _options(partitions, templates=True)
    assert tuned and not any(zero[n].target in matmuls for o in tuned for n in o.chain)
    assert {o.name for o in tuned} < {o.name for o in plain}


def test_a_saved_value_that_is_also_a_user_output_keeps_both_places(partitions_with_saved_output):
    """AOTAutograd reads the forward's outputs by position: user outputs first, then what
    the backward's placeholders receive. A saved value that is also a user output must
    not move where saving begins (regression: HF GPT-2 in bf16 failed to compile)."""
    p = partitions_with_saved_output
    options = _options(p)
    fw, bw = p.graphs[1.0]
    spliced_fw, spliced_bw = _spliced(p, options)
    (plain_out,) = fw.graph.find_nodes(op="output")
    (out,) = spliced_fw.graph.find_nodes(op="output")
    inputs = [n for n in spliced_bw.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
    users = len(out.args[0]) - len(inputs)
    assert _added_inputs(p, options) > 0  # the chains start from inputs saved for them
    user_names = [o.name for o in plain_out.args[0][:users]]
    assert "tanh" in user_names and "tanh" in _saved(bw)  # the case this test is about
    assert [o.name for o in out.args[0][:users]] == user_names
    dropped = {o.name for o in options}
    for value, placeholder in zip(out.args[0][users:], inputs):
        if placeholder.name in dropped:
            assert value.target is torch.ops.hyper_offload.discard.default
            assert value.args[0].name == placeholder.name
        else:
            assert value.name == placeholder.name
    expected = _run(min_cut_rematerialization_partition, _block_returning_a_saved_value)

    got = _run(_splicing(lambda options: options), _block_returning_a_saved_value)
    assert [torch.equal(a, b) for a, b in zip(expected, got)] == [True] * len(expected)
