"""Sequence tiling, the analysis: which ops of a Dynamo graph are token-wise along which
dim, and the spans of them the compile door may split into tiles.

    axes = token_axes(gm.graph, seq_len=4096)       # {node name: TokenAxis}
    spans = tile_spans(gm.graph, axes)              # (Span, ...), graph order

A Llama block's graph reads (``tokenwise@1`` is an op token-wise along dim 1 of its
output, ``mixes@2`` attention, whose output rows are tokens along dim 2)::

    x_1 = x + linear_3              tokenwise@1   } span 1: o_proj and the residual
    float_6 = x_1.float()           tokenwise@1   }
    ...                                           } span 2: RMSNorm, SwiGLU MLP,
    linear_4 = linear(mul_11, w1)   tokenwise@1   }   residual (inputs x_1; output x_2)
    ...
    x_2 = x_1 + linear_6            tokenwise@1   }

The graph is Dynamo's (torch functions and methods, before AOTAutograd): a tiled span
rewritten there (:mod:`.tiling_rewrite`) has its backward derived by autograd, tile by
tile. A **segment** is a connected set of token-wise ops (and sums over tokens); a
**span** is a piece of a segment between two values that alone carry everything later
ops of the segment read (a cut: the residual stream between a Transformer's MLP and its
attention projections): tiling one span recomputes only its own ops. Only *convex* spans
are returned: no path leaves the span and comes back into it (else its tiles could not
run as one block).

Pure: reads node targets, arguments and recorded values (shapes), changes nothing.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.fx as fx

from .token_rules import MIXES, OpKind, TokenAxis, node_value, rule_for

__all__ = [
    "OpKind", "Span", "TokenAxis", "is_convex", "op_name", "sequence_length", "tile_spans",
    "token_axes",
]

_ATTENTION = torch.nn.functional.scaled_dot_product_attention


class Span(NamedTuple):
    """Token-wise ops that may be tiled together (module docstring).

    ``nodes``: graph order; ``inputs``: values from outside the span with a token dim
    (each tile reads its slice); ``outputs``: span values read after it (concatenated
    from the tiles, or for a sum over tokens, added); ``segment``: the connected set of
    token-wise ops it is a piece of; ``signature``: its ops, sizes and dtypes (the same
    span of every layer of a model shares it)."""

    index: int
    segment: int
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    ops: str
    signature: str

    def __repr__(self) -> str:
        return (f"Span({self.index}: {self.nodes[0]}..{self.nodes[-1]}, {len(self.nodes)} op(s): "
                f"{self.ops}; in {', '.join(self.inputs)}; out {', '.join(self.outputs)})")


def op_name(node: fx.Node) -> str:
    """A readable name of ``node``'s op (``linear``, ``view``, ``add``)."""
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def token_axes(
    graph: fx.Graph, seq_len: int, seeds: Mapping[str, int] | None = None
) -> dict[str, TokenAxis]:
    """Every node's :class:`TokenAxis`, by name. ``seeds``: the graph inputs that carry
    tokens, ``{placeholder name: token dim}``; default every placeholder with exactly one
    dim of extent ``seq_len`` (a parameter that happens to have one only makes fewer ops
    token-wise: a weight must have no token dim)."""
    axes: dict[fx.Node, TokenAxis] = {}
    for node in graph.nodes:
        axes[node] = _axis(node, axes, seq_len, seeds)
    return {node.name: axis for node, axis in axes.items()}


def _axis(node: fx.Node, axes: Mapping[fx.Node, TokenAxis], seq_len: int,
          seeds: Mapping[str, int] | None) -> TokenAxis:
    if node.op == "placeholder":
        return _seed(node, seq_len, seeds)
    if node.op not in ("call_function", "call_method"):
        return TokenAxis(OpKind.FREE)
    inputs = [axes[a] for a in node.all_input_nodes]
    if all(a.dim is None for a in inputs):  # nothing per token: computed once
        return TokenAxis(OpKind.FREE, reduced=any(a.reduced for a in inputs))
    rule = rule_for(node)
    if rule is None:
        return MIXES
    try:
        return rule(node, axes)
    except (TypeError, ValueError, IndexError, AttributeError):  # arguments it cannot read
        return MIXES


def _seed(node: fx.Node, seq_len: int, seeds: Mapping[str, int] | None) -> TokenAxis:
    if seeds is not None:
        dim = seeds.get(node.name)
        return TokenAxis(OpKind.FREE, dim)
    value = node_value(node)
    if not isinstance(value, torch.Tensor):
        return TokenAxis(OpKind.FREE)
    dims = [d for d, extent in enumerate(value.shape) if extent == seq_len]
    return TokenAxis(OpKind.FREE, dims[0] if len(dims) == 1 else None)


def sequence_length(graph: fx.Graph) -> int | None:
    """The sequence length a graph runs at, inferred: the query rows of its attention,
    else the last dim of its integer inputs (token ids, targets), else dim -2 of its
    3-d floating inputs (hidden states); None when none of them says."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _ATTENTION:
            query = node_value(node.args[0]) if node.args else None
            if isinstance(query, torch.Tensor) and query.ndim >= 2:
                return int(query.shape[-2])
    placeholders = [node_value(n) for n in graph.find_nodes(op="placeholder")]
    tensors = [v for v in placeholders if isinstance(v, torch.Tensor)]
    for value in tensors:
        if not value.is_floating_point() and not value.is_complex() and value.ndim >= 1:
            return int(value.shape[-1])
    counts = collections.Counter(int(v.shape[-2]) for v in tensors
                                 if v.is_floating_point() and v.ndim == 3)
    return counts.most_common(1)[0][0] if counts else None


def _segments(graph: fx.Graph, axes: Mapping[str, TokenAxis]) -> list[list[fx.Node]]:
    """Connected sets of token-wise ops and sums over tokens, each in graph order."""
    member = [n for n in graph.nodes
              if axes[n.name].kind in (OpKind.TOKENWISE, OpKind.TOKEN_SUM)]
    parent = {n: n for n in member}

    def root(node: fx.Node) -> fx.Node:
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for node in member:
        for arg in node.all_input_nodes:
            if arg in parent:
                parent[root(arg)] = root(node)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in member:
        groups.setdefault(root(node), []).append(node)
    return list(groups.values())


def _per_token(node: fx.Node, axes: Mapping[str, TokenAxis]) -> float:
    """Bytes of ``node``'s value per token (inf without a token dim)."""
    value, dim = node_value(node), axes[node.name].dim
    if not isinstance(value, torch.Tensor) or dim is None or not value.shape[dim]:
        return float("inf")
    return value.numel() * value.element_size() / value.shape[dim]


def _floating(node: fx.Node) -> bool:
    value = node_value(node)
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _pieces(segment: list[fx.Node], axes: Mapping[str, TokenAxis]) -> list[list[fx.Node]]:
    """``segment`` cut after every position where one tensor alone carries what later
    ops of the segment read (a floating token input from outside, the residual stream
    entering a graph, counts from its first read to its last: so the first layer is cut
    as the others; token ids do not count),
    and carries no more bytes per token than the segment's widest floating token input
    (or, where only token ids enter, its first floating value): a cut's value is what the
    next span saves, the residual stream, not the logits."""
    position = {node: i for i, node in enumerate(segment)}
    outside = {a for n in segment for a in n.all_input_nodes
               if a not in position and axes[a.name].dim is not None}
    carried = {a for a in outside if _floating(a)}
    # The residual stream's width: what enters as floating point, else (token ids enter)
    # the segment's first floating value (the embedding).
    widest = max((_per_token(a, axes) for a in carried), default=0.0) or next(
        (_per_token(n, axes) for n in segment if _floating(n)), 0.0)
    last_use = {
        node: max((position[u] for u in node.users if u in position), default=-1)
        for node in (*segment, *outside)
    }
    pieces, current, live = [], [], set()
    for i, node in enumerate(segment):
        current.append(node)
        live.add(node)
        live.update(a for a in node.all_input_nodes if a in carried)
        live = {v for v in live if last_use[v] > i}
        if len(live) == 1 and _per_token(next(iter(live)), axes) <= widest:
            pieces.append(current)
            current = []
    if current:
        pieces.append(current)
    return pieces


def is_convex(nodes: Sequence[fx.Node]) -> bool:
    """No path from a node of ``nodes`` through others comes back into ``nodes``."""
    inside = set(nodes)
    frontier = [u for n in nodes for u in n.users if u not in inside]
    seen: set[fx.Node] = set()
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user in inside:
                return False
            frontier.append(user)
    return True


def tile_spans(graph: fx.Graph, axes: Mapping[str, TokenAxis]) -> tuple[Span, ...]:
    """The convex spans of every segment (module docstring), in graph order."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    spans: list[Span] = []
    for number, segment in enumerate(_segments(graph, axes)):
        for piece in _pieces(segment, axes):
            span = _span(len(spans), number, piece, axes)
            if span is not None:
                spans.append(span)
    by_name = {node.name: node for node in order}
    spans.sort(key=lambda s: order[by_name[s.nodes[0]]])
    return tuple(s._replace(index=i) for i, s in enumerate(spans))


def _span(index: int, segment: int, nodes: list[fx.Node],
          axes: Mapping[str, TokenAxis]) -> Span | None:
    """The span of ``nodes``, or None when it cannot be tiled as one block: not convex,
    or a value leaving it that is neither token-wise nor a sum over tokens (a tuple)."""
    inside = set(nodes)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    if not is_convex(nodes) or not outputs or any(
            not isinstance(node_value(n), torch.Tensor) for n in outputs):
        return None
    inputs = sorted({a.name for n in nodes for a in n.all_input_nodes
                     if a not in inside and axes[a.name].dim is not None})
    names = collections.Counter(op_name(n) for n in nodes)
    ops = ", ".join(f"{name} x{count}" if count > 1 else name for name, count in names.items())
    signature = ";".join(
        f"{op_name(n)}:{tuple(getattr(node_value(n), 'shape', ()))}:"
        f"{getattr(node_value(n), 'dtype', None)}" for n in nodes)
    return Span(index, segment, tuple(n.name for n in nodes), tuple(inputs),
                tuple(n.name for n in outputs), ops, signature)
