"""Sequence tiling's analysis (``passes.fx.tiling``, ``passes.fx.token_rules``) on
hand-built graphs: which ops are token-wise along which dim, what is not, and the spans."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

from hyper_offload.passes.fx.tiling import (
    OpKind, is_convex, sequence_length, tile_spans, token_axes,
)

from .tiling_graphs import D, H, T, V, head_and_loss, mlp_block, traced, weights


def _axes(fn, *inputs, seeds=None):
    gm = traced(fn, *inputs)
    return gm, {name: repr(axis) for name, axis in token_axes(gm.graph, T, seeds).items()}


def test_an_mlp_block_is_token_wise_along_the_sequence_at_every_op():
    w = weights()
    gm, axes = _axes(mlp_block, torch.randn(1, T, D), *(
        w[k] for k in ("w1", "w3", "w2", "norm")))
    ops = [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert {axes[name] for name in ops} == {"tokenwise@1"}
    assert axes["w1"] == "free" and axes["norm"] == "free"  # weights: read whole by every tile


def test_the_token_dim_follows_reshapes_transposes_and_indexing():
    def heads(x):
        q = x.view(1, T, 2, 3).transpose(1, 2)    # (1, heads, T, 3)
        return q[:, :, :, :2].reshape(1, 2, T * 2).unsqueeze(0), q.flatten(0, 1).permute(1, 0, 2)

    _, axes = _axes(heads, torch.randn(1, T, D))
    assert axes["view"] == "tokenwise@1" and axes["transpose"] == "tokenwise@2"
    assert axes["getitem"] == "tokenwise@2"
    assert axes["reshape"] == "mixes"  # T merged with the feature dim: rows are not tokens
    assert axes["flatten"] == "tokenwise@1" and axes["permute"] == "tokenwise@0"


def test_merging_the_batch_into_the_tokens_is_token_wise_only_for_one_sequence():
    one, two = torch.randn(1, T, D), torch.randn(2, T, D)
    assert _axes(lambda x: x.flatten(0, 1), one)[1]["flatten"] == "tokenwise@0"
    assert _axes(lambda x: x.flatten(0, 1), two)[1]["flatten"] == "mixes"


def test_a_table_of_one_row_per_token_is_cut_and_broadcast_values_are_read_whole():
    def rope(x, cos, scale):
        return x * cos + x * scale

    _, axes = _axes(rope, torch.randn(1, 2, T, 4), torch.randn(T, 4), torch.randn(1, 4),
                    seeds={"x": 2, "cos": None, "scale": None})
    assert axes["mul"] == "tokenwise@2 cuts cos@0"
    assert axes["mul_1"] == "tokenwise@2"


def test_reductions_over_the_features_are_token_wise_over_the_tokens_they_are_not():
    def reduce(x):
        return x.mean(-1, keepdim=True), x.sum(2), x.sum(1), x.amax(1), x.softmax(-1), x.softmax(1)

    _, axes = _axes(reduce, torch.randn(1, T, D))
    assert axes["mean"] == "tokenwise@1" and axes["sum_1"] == "tokenwise@1"
    assert axes["sum_2"] == "token_sum reduced"  # a sum over tokens: tiles' sums add up
    assert axes["amax"] == "mixes"               # a max over tokens has no partial form
    assert axes["softmax"] == "tokenwise@1" and axes["softmax_1"] == "mixes"


def test_a_value_computed_from_a_sum_over_tokens_mixes_tokens_when_read_per_token():
    _, axes = _axes(lambda x: x - x.mean(1, keepdim=True), torch.randn(1, T, D))
    assert axes["mean"] == "token_sum reduced"
    assert axes["sub"] == "mixes"


def test_attention_mixes_tokens_and_its_output_rows_are_tokens():
    def attend(q, k, v, w):
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(y.transpose(1, 2).reshape(1, T, 4), w)

    _, axes = _axes(attend, *(torch.randn(1, 2, T, 2) for _ in range(3)), torch.randn(D, 4),
                    seeds={"q": 2, "k": 2, "v": 2, "w": None})
    assert axes["scaled_dot_product_attention"] == "mixes@2"
    assert axes["transpose"] == "tokenwise@1" and axes["linear"] == "tokenwise@1"


def test_losses_per_token_sum_over_tokens_and_weighted_means_are_not_tiled():
    logits, targets = torch.randn(T, 10), torch.randint(0, 10, (T,))
    classes = torch.ones(10)

    def losses(logits, targets, classes):
        return (F.cross_entropy(logits, targets), F.cross_entropy(logits, targets, reduction="none"),
                F.cross_entropy(logits, targets, weight=classes), F.nll_loss(logits, targets,
                                                                              reduction="sum"))

    _, axes = _axes(losses, logits, targets, classes, seeds={"logits": 0, "targets": 0})
    assert axes["cross_entropy"] == "token_sum reduced"
    assert axes["cross_entropy_1"] == "tokenwise@0"
    assert axes["cross_entropy_2"] == "mixes"
    assert axes["nll_loss"] == "token_sum reduced"


def test_random_ops_and_unknown_ops_are_not_tiled():
    def ops(x):
        return F.dropout(x, 0.1, True), F.dropout(x, 0.0, True), torch.cumprod(x, 2), x.add_(1)

    _, axes = _axes(ops, torch.randn(1, T, D))
    assert axes["dropout"] == "mixes" and axes["dropout_1"] == "tokenwise@1"
    assert axes["cumprod"] == "mixes" and axes["add_"] == "mixes"


def test_a_weight_with_a_token_dim_makes_its_linear_mix():
    _, axes = _axes(lambda x, w: F.linear(x, w), torch.randn(1, T, D), torch.randn(T, D))
    assert axes["w"] == "free@0" and axes["linear"] == "mixes"  # seeded by its extent
    _, axes = _axes(lambda x, w: F.linear(x, w), torch.randn(1, T, D), torch.randn(T, D),
                    seeds={"x": 1, "w": None})
    assert axes["linear"] == "tokenwise@1"


def test_spans_are_cut_at_the_residual_stream_never_at_the_logits():
    w = weights()

    def model(x, w1, w3, w2, norm, head, targets):
        x = mlp_block(x, w1, w3, w2, norm)
        x = mlp_block(x, w1, w3, w2, norm)
        return head_and_loss(x, head, targets)

    gm = traced(model, torch.randn(1, T, D), *(
        w[k] for k in ("w1", "w3", "w2", "norm", "head")), torch.randint(0, V, (1, T)))
    axes = token_axes(gm.graph, T)
    spans = tile_spans(gm.graph, axes)
    assert [(s.nodes[0], s.inputs, s.outputs) for s in spans] == [
        ("float_1", ("x",), ("add_1",)), ("float_2", ("add_1",), ("add_3",)),
        ("linear_6", ("add_3", "targets"), ("cross_entropy",)),
    ]
    first, second, loss = spans
    assert first.signature == second.signature != loss.signature  # one MLP per "layer"
    assert "linear x3" in first.ops and loss.ops == "linear, float, flatten x2, cross_entropy"
    assert all(axes[n].kind in (OpKind.TOKENWISE, OpKind.TOKEN_SUM) for s in spans for n in s.nodes)


def test_a_span_that_a_path_leaves_and_reenters_is_not_convex():
    def detour(x, w):
        h = F.linear(x, w)
        mixed = torch.cumprod(h, 1)          # not token-wise: outside any span
        return F.linear(h + mixed, w.t())

    gm = traced(detour, torch.randn(1, T, D), torch.randn(H, D))
    nodes = {n.name: n for n in gm.graph.nodes}
    assert not is_convex([nodes["linear"], nodes["add"]])
    assert is_convex([nodes["add"], nodes["linear_1"]])
    spans = tile_spans(gm.graph, token_axes(gm.graph, T, {"x": 1, "w": None}))
    assert all(not {"linear", "add"} <= set(s.nodes) for s in spans)


def test_the_sequence_length_comes_from_attention_tokens_or_hidden_states():
    attend = traced(lambda q: F.scaled_dot_product_attention(q, q, q), torch.randn(1, 2, 5, 4))
    tokens = traced(lambda ids, x: x[:, : ids.shape[1]], torch.zeros(1, 7, dtype=torch.long),
                    torch.randn(1, 9, 3))
    hidden = traced(lambda x: x * 2, torch.randn(1, 11, 3))
    flat = traced(lambda x: x * 2, torch.randn(4, 3))
    assert [sequence_length(g.graph) for g in (attend, tokens, hidden, flat)] == [5, 7, 11, None]


@pytest.mark.parametrize("op", [operator.add, operator.mul, torch.maximum])
def test_pointwise_ops_broadcast_size_one_dims_and_mix_tokens_on_two_token_dims(op):
    x = torch.randn(1, T, D)
    _, axes = _axes(lambda a, b: op(a, b), x, torch.randn(1, 1, D), seeds={"a": 1, "b": None})
    assert list(axes.values())[2] == "tokenwise@1"
    _, axes = _axes(lambda a, b: op(a, b), x, torch.randn(T, 1, D), seeds={"a": 1, "b": 0})
    assert list(axes.values())[2] == "mixes"  # (T, T, D): two dims of tokens
