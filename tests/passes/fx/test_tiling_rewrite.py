"""Sequence tiling's rewrite (``passes.fx.tiling_rewrite``): the tiled graph computes
what the untiled one does, tags every tile for recompute, and after AOTAutograd's
min-cut partition saves the unit's inputs only and runs one tile's backward at a time."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

from hyper_offload.errors import TilingError
from hyper_offload.passes import required_bytes
from hyper_offload.passes.fx.graph_trace import build_fx_trace
from hyper_offload.passes.fx.tiling import tile_spans, token_axes
from hyper_offload.passes.fx.tiling_rewrite import FIRST_GRAPH_ID, TileUnit, tile_graph, tile_sizes

from .tiling_graphs import D, T, V, head_and_loss, mlp_block, traced, weights


def _tiled(gm: fx.GraphModule, tiles: int, seq_len: int = T) -> fx.GraphModule:
    """``gm`` with all its spans tiled as one unit (they are adjacent in these graphs)."""
    axes = token_axes(gm.graph, seq_len)
    nodes = tuple(name for span in tile_spans(gm.graph, axes) for name in span.nodes)
    assert nodes, "the graph has a span to tile"
    return tile_graph(gm, axes, [TileUnit(nodes, tiles)])


def _mlp_inputs():
    w = weights()
    return torch.randn(1, T, D), w["w1"], w["w3"], w["w2"], w["norm"]


def test_tile_sizes_cover_the_sequence_longest_first():
    assert tile_sizes(8, 3) == [3, 3, 2]
    assert tile_sizes(8, 8) == [1] * 8
    assert sum(tile_sizes(131072, 7)) == 131072


def test_a_tiled_mlp_computes_the_same_rows_and_tags_every_tile_for_recompute():
    inputs = _mlp_inputs()
    gm = traced(mlp_block, *inputs)
    tiled = _tiled(gm, 3)
    torch.testing.assert_close(tiled(*inputs), gm(*inputs), rtol=0, atol=1e-6)
    ops = [n for n in tiled.graph.nodes if n.op in ("call_function", "call_method")]
    tagged = [n for n in ops if "recompute" in n.meta]
    assert {n.meta["recompute"] for n in tagged} == {CheckpointPolicy.MUST_RECOMPUTE}
    assert {n.meta["ac_graph_id"] for n in tagged} == {FIRST_GRAPH_ID + i for i in range(3)}
    untagged = [n for n in ops if "recompute" not in n.meta]
    assert [n.target for n in untagged] == [torch.cat]  # the unit's one output
    linears = [n for n in tagged if n.target is F.linear]
    assert [tuple(n.meta["example_value"].shape) for n in linears[::3]] == [
        (1, 3, 12), (1, 3, 12), (1, 2, 12)]  # w1 of each tile, on its own rows


def test_views_get_each_tiles_sizes():
    def heads(x):
        return x.view(1, T, 2, 3).transpose(1, 2).reshape(1, 2, T, 3) * 2

    x = torch.randn(1, T, 6)
    gm = traced(heads, x)
    tiled = _tiled(gm, 3)
    torch.testing.assert_close(tiled(x), gm(x), rtol=0, atol=0)
    views = [n for n in tiled.graph.nodes if n.target in ("view", "reshape")]
    assert [n.args[1] for n in views] == [  # tile by tile: 3, 3 and 2 tokens
        (1, 3, 2, 3), (1, 2, 3, 3), (1, 3, 2, 3), (1, 2, 3, 3), (1, 2, 2, 3), (1, 2, 2, 3)]
    assert sum(n.target is torch.cat for n in tiled.graph.nodes) == 1


def test_a_tiled_mean_cross_entropy_divides_by_the_targets_not_ignored():
    w = weights()
    x, targets = torch.randn(1, T, D), torch.randint(0, V, (1, T))
    targets[0, 1] = targets[0, 6] = -100  # skipped by the mean (two tiles hold one each)
    gm = traced(head_and_loss, x, w["head"], targets)
    tiled = _tiled(gm, 4)
    torch.testing.assert_close(tiled(x, w["head"], targets), gm(x, w["head"], targets),
                               rtol=1e-6, atol=0)
    losses = [n for n in tiled.graph.nodes if n.target is F.cross_entropy]
    assert len(losses) == 4 and all(n.kwargs["reduction"] == "sum" for n in losses)


def test_means_and_sums_over_tokens_add_the_tiles_partial_sums():
    def reduce(x):
        return (x * 3).mean(), x.sum(1) + 1

    x = torch.randn(1, T, D, dtype=torch.float64)
    gm = traced(reduce, x)
    tiled = _tiled(gm, 4)
    for got, want in zip(tiled(x), gm(x)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert sum(n.target == "sum" for n in tiled.graph.nodes) == 8  # no mean left


def test_a_unit_a_path_leaves_and_reenters_is_refused():
    def detour(x, w):
        h = F.linear(x, w)
        return F.linear(h + torch.cumprod(h, 1), w.t())

    gm = traced(detour, torch.randn(1, T, D), torch.randn(12, D))
    axes = token_axes(gm.graph, T, {"x": 1, "w": None})
    with pytest.raises(TilingError, match=r"tiling linear\.\.add: a path leaves the unit"):
        tile_graph(gm, axes, [TileUnit(("linear", "add"), 2)])


def test_the_input_graph_is_not_modified():
    inputs = _mlp_inputs()
    gm = traced(mlp_block, *inputs)
    before = gm.code
    _tiled(gm, 2)
    assert gm.code == before
    assert not any("recompute" in n.meta for n in gm.graph.nodes)


def _partition(gm: fx.GraphModule, inputs) -> tuple[fx.GraphModule, fx.GraphModule, int]:
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    kept = {}

    def partition(joint, joint_inputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        kept.update(fw=fw, bw=bw, outputs=kwargs["num_fwd_outputs"])
        return fw, bw

    def keep(graph, _):
        return make_boxed_func(graph.forward)

    compiled = aot_module_simplified(gm, list(inputs), fw_compiler=keep, bw_compiler=keep,
                                     partition_fn=partition)
    compiled(*inputs)[0].sum().backward()
    return kept["fw"], kept["bw"], kept["outputs"]


def _floor(fw: fx.GraphModule, bw: fx.GraphModule, outputs: int) -> int:
    """The most bytes an op of the two graphs keeps on the device with everything
    movable moved (the compile door's floor of a region)."""
    trace = build_fx_trace(fw, bw, num_fwd_outputs=outputs).trace
    return max(required_bytes(trace))


def _storage(node: fx.Node) -> int | None:
    value = node.meta.get("val")
    return id(value.untyped_storage()) if isinstance(value, torch.Tensor) else None


def _tiles_alive_at_once(graph: fx.Graph) -> int:
    """The most tiles whose recomputed values (not views of the graph's inputs) are
    alive at one point of ``graph``."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    inputs = {_storage(n) for n in nodes if n.op == "placeholder"}
    recomputed = [n for n in nodes if "ac_graph_id" in n.meta and n.op == "call_function"
                  and _storage(n) not in inputs | {None}]
    return max(len({n.meta["ac_graph_id"] for n in recomputed
                    if position[n] <= i < max((position[u] for u in n.users), default=0)})
               for i in range(len(nodes)))


def test_after_the_min_cut_partition_only_inputs_are_saved_and_one_tile_runs_at_a_time():
    def block(x, w1, w3, w2, norm):
        return (mlp_block(x, w1, w3, w2, norm),)  # AOTAutograd on a graph: tuple outputs

    tokens = 64  # the activations outweigh the weights, as at long context
    inputs = [t.requires_grad_() for t in (torch.randn(1, tokens, D), *_mlp_inputs()[1:])]
    gm = traced(block, *inputs)
    plain_fw, plain_bw, outputs = _partition(gm, inputs)
    tiled_fw, tiled_bw, outputs = _partition(_tiled(gm, 4, tokens), inputs)
    saved = tiled_fw.graph.find_nodes(op="output")[0].args[0][outputs:]
    assert all(n.op == "placeholder" or (n.target is torch.ops.aten.t.default
                                         and n.args[0].op == "placeholder") for n in saved)
    assert any(n.op == "call_function" and n.target is not torch.ops.aten.t.default
               for n in plain_fw.graph.find_nodes(op="output")[0].args[0][outputs:])
    assert _tiles_alive_at_once(tiled_bw.graph) == 1
    assert _floor(tiled_fw, tiled_bw, outputs) < 0.75 * _floor(plain_fw, plain_bw, outputs)
