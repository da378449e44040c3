"""Sequence tiling, the rewrite: split token-wise ops of a Dynamo graph into tiles along
the sequence, each recomputed in the backward.

    tiled = tile_graph(gm, axes, [TileUnit(span.nodes, tiles=8)])

For one unit (the nodes of one or more adjacent spans, :mod:`.tiling`) with input ``x``
(token dim 1) and output ``y``, the rewritten graph reads::

    split = torch.split(x, [l0, l1, ...], 1)       # recompute, tile 0's id
    x_t0 = split[0]                                # recompute, tile 0's id
    ...the unit's ops on x_t0...                   # recompute, tile 0's id
    x_t1 = split[1]                                # recompute, tile 1's id
    ...
    y = torch.cat([y_t0, y_t1, ...], 1)            # read by the ops after the unit

Every tile's op carries ``meta["recompute"] = MUST_RECOMPUTE`` and its tile's
``meta["ac_graph_id"]``: what ``torch.utils.checkpoint`` regions carry, and what
AOTAutograd copies onto each aten node it traces. The min-cut partitioner then saves
the unit's inputs only, recomputes each tile's ops in the backward, and orders the
backward as autograd would (``reordering_to_mimic_autograd_engine``): a tile's
intermediates are alive only while its own backward runs. Views and reshapes get
each tile's sizes; a sum over tokens adds its tiles' partial sums, a mean divides that
by the element count, an unweighted ``cross_entropy`` / ``nll_loss`` mean by the
count of targets not ignored.

**Not bit-exact.** Each tile's forward is the untiled one's rows for token-wise ops
(a kernel may still choose another blocking for fewer rows), but every sum over tokens
is reassociated: the weight gradients (autograd adds the tiles' contributions), a loss
mean, an embedding's gradient. ``hyper_offload.check`` measures the deviation.

Pure: returns a new GraphModule (the input is not modified); raises
:class:`~hyper_offload.errors.TilingError` when a unit cannot be tiled as one block.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

from hyper_offload.errors import TilingError

from .tiling import is_convex
from .token_rules import SIZED_VIEWS, OpKind, TokenAxis, node_value

__all__ = ["FIRST_GRAPH_ID", "TileUnit", "tile_graph", "tile_sizes"]

FIRST_GRAPH_ID = 1 << 24
"""The first ``ac_graph_id`` of a tile: above any id torch's checkpoint regions take."""

_TILE_META = ("example_value", "val", "tensor_meta")
_LOSSES = (F.cross_entropy, F.nll_loss)


class TileUnit(NamedTuple):
    """Nodes tiled as one block (graph order names), and into how many tiles."""

    nodes: tuple[str, ...]
    tiles: int


def tile_sizes(extent: int, tiles: int) -> list[int]:
    """``tiles`` tile lengths covering ``extent`` tokens, the first ones one longer."""
    base, extra = divmod(extent, tiles)
    return [base + (1 if i < extra else 0) for i in range(tiles)]


def tile_graph(
    gm: fx.GraphModule, axes: Mapping[str, TokenAxis], units: Sequence[TileUnit],
    *, first_graph_id: int = FIRST_GRAPH_ID,
) -> fx.GraphModule:
    """A copy of ``gm`` with every unit of ``units`` tiled (module docstring). New
    nodes' values are recorded as Dynamo records them (``example_value``), computed on
    the graph's own (fake) values."""
    graph = fx.Graph()
    graph.set_codegen(copy.deepcopy(gm.graph._codegen))
    graph.output(graph.graph_copy(gm.graph, {}))
    by_name = {node.name: node for node in graph.nodes}
    axes = dict(axes)  # a unit's joined outputs take their node's axis, for later units
    graph_id = first_graph_id
    for unit in units:
        if unit.tiles < 2:
            continue
        nodes = [by_name[name] for name in unit.nodes]
        _Unit(graph, nodes, axes, unit.tiles, graph_id).rewrite()
        _record_values(graph)  # the next unit sizes its tiles from them
        graph_id += unit.tiles
    graph.lint()
    tiled = fx.GraphModule(gm, graph)
    tiled.meta = dict(gm.meta)
    return tiled


class _Unit:
    """One unit's rewrite: its boundary, its tiles, its outputs."""

    def __init__(self, graph: fx.Graph, nodes: list[fx.Node], axes: dict[str, TokenAxis],
                 tiles: int, graph_id: int) -> None:
        self.graph, self.nodes, self.axes, self.tiles = graph, nodes, axes, tiles
        self.inside = set(nodes)
        self.graph_id = graph_id
        where = f"tiling {nodes[0].name}..{nodes[-1].name}"
        if not is_convex(nodes):
            raise TilingError(f"{where}: a path leaves the unit and comes back into it, so its "
                              "tiles cannot run as one block. Fix: tile a span of tile_spans")
        kinds = {axes[n.name].kind for n in nodes}
        if not kinds <= {OpKind.TOKENWISE, OpKind.TOKEN_SUM}:
            raise TilingError(f"{where}: only token-wise ops and sums over tokens tile, the "
                              f"unit has {sorted(k.value for k in kinds)}")
        self.where = where
        self.outputs = [n for n in nodes if any(u not in self.inside for u in n.users)]
        self.order = {node: i for i, node in enumerate(graph.nodes)}

    def _cut_dim(self, consumer: fx.Node, arg: fx.Node) -> int | None:
        """Along which dim a tile reads ``arg`` for ``consumer`` (None: whole)."""
        axis = self.axes[arg.name]
        if axis.dim is not None:
            return axis.dim
        return dict(self.axes[consumer.name].cuts).get(arg.name)

    def _cursor(self) -> fx.Node:
        """Where the tiles go: before the unit's first node, or after its last input
        when an input is made later (the unit's later readers then move after it)."""
        boundary = [a for n in self.nodes for a in n.all_input_nodes if a not in self.inside]
        last_input = max(boundary, key=self.order.__getitem__, default=None)
        first = self.nodes[0]
        if last_input is None or self.order[last_input] < self.order[first]:
            return first
        return last_input.next

    def rewrite(self) -> None:
        cursor = self._cursor()
        early = self._readers_before(cursor)
        with self.graph.inserting_before(cursor):
            pieces = self._split_inputs()
            results = [self._tile(i, pieces) for i in range(self.tiles)]
            replaced = {out: self._join(out, results) for out in self.outputs}
        for out, joined in replaced.items():
            out.replace_all_uses_with(joined, delete_user_cb=lambda u: u not in self.inside)
            self.axes[joined.name] = self.axes[out.name]
        anchor = cursor.prev
        for node in early:  # after the tiles, in their order
            anchor.append(node)
            anchor = node
        for node in reversed(self.nodes):
            self.graph.erase_node(node)

    def _split_inputs(self) -> dict[tuple[fx.Node, int], list[fx.Node]]:
        """Each input read per tile, split once along its dim: (input, dim) -> pieces."""
        pieces: dict[tuple[fx.Node, int], list[fx.Node]] = {}
        for node in self.nodes:
            for arg in node.all_input_nodes:
                dim = None if arg in self.inside else self._cut_dim(node, arg)
                if dim is None or (arg, dim) in pieces:
                    continue
                sizes = tile_sizes(node_value(arg).shape[dim], self.tiles)
                split = self._tag(self.graph.call_function(torch.split, (arg, sizes, dim)), 0)
                pieces[(arg, dim)] = [
                    self._tag(self.graph.call_function(operator.getitem, (split, i)), i)
                    for i in range(self.tiles)]
        return pieces

    def _tag(self, node: fx.Node, tile: int) -> fx.Node:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = self.graph_id + tile
        return node

    def _tile(self, tile: int, pieces: Mapping[tuple[fx.Node, int], list[fx.Node]]
              ) -> dict[fx.Node, Any]:
        """Tile ``tile``'s copy of every node; a sum over tokens becomes this tile's
        partial sum, and a loss mean's count of targets not ignored is under
        ``(node, "count")``."""
        env: dict[Any, Any] = {}
        for node in self.nodes:
            def read(arg: fx.Node, node: fx.Node = node) -> fx.Node:
                if arg in env:
                    return env[arg]
                dim = self._cut_dim(node, arg)
                return arg if dim is None else pieces[(arg, dim)][tile]

            tiled = self.graph.node_copy(node, read)
            for key in _TILE_META:
                tiled.meta.pop(key, None)
            self._tag(tiled, tile)
            if node.target in SIZED_VIEWS:
                tiled.args = (tiled.args[0], self._tile_shape(node, tile))
                tiled.kwargs = {}
            if self.axes[node.name].kind is OpKind.TOKEN_SUM:
                env[(node, "count")] = self._as_partial_sum(node, tiled)
            env[node] = tiled
        return env

    def _tile_shape(self, node: fx.Node, tile: int) -> tuple[int, ...]:
        shape = list(node_value(node).shape)
        dim = self.axes[node.name].dim
        assert dim is not None
        shape[dim] = tile_sizes(shape[dim], self.tiles)[tile]
        return tuple(shape)

    def _as_partial_sum(self, node: fx.Node, tiled: fx.Node) -> fx.Node | None:
        """Make ``tiled`` (a copy of a sum over tokens) this tile's partial sum; for a
        loss mean, return the tile's count of targets not ignored (None otherwise)."""
        if node.target in _LOSSES:
            given = _loss_kwargs(node)
            tiled.args, tiled.kwargs = tiled.args[:2], {**given, "reduction": "sum"}
            if given.get("reduction", "mean") == "sum":
                return None
            counted = self.graph.call_function(torch.ne, (tiled.args[1], given.get(
                "ignore_index", -100)))
            return self.graph.call_method("sum", (counted,))
        if node.target in ("mean", torch.mean):
            tiled.target = "sum" if node.op == "call_method" else torch.sum
        return None

    def _join(self, out: fx.Node, results: list[dict[Any, Any]]) -> fx.Node:
        """The unit's value of ``out``: its tiles concatenated, or partial sums added
        (a mean: divided by its element count; a loss mean: by its targets counted)."""
        axis = self.axes[out.name]
        if axis.kind is OpKind.TOKENWISE:
            assert axis.dim is not None
            return self.graph.call_function(torch.cat, ([r[out] for r in results], axis.dim))
        total = _added(self.graph, [r[out] for r in results])
        if out.target in ("mean", torch.mean):
            source, value = node_value(out.all_input_nodes[0]), node_value(out)
            return self.graph.call_function(
                operator.truediv, (total, source.numel() // max(value.numel(), 1)))
        if results[0][(out, "count")] is None:
            return total
        count = _added(self.graph, [r[(out, "count")] for r in results])
        return self.graph.call_function(operator.truediv, (total, count))

    def _readers_before(self, cursor: fx.Node) -> list[fx.Node]:
        """Nodes before ``cursor`` that read the unit (through others too): placed
        between the unit's first node and its last input, they must follow the tiles."""
        reads: set[fx.Node] = set()
        for node in self.graph.nodes:
            if node is cursor:
                break
            if node not in self.inside and any(
                    a in self.inside or a in reads for a in node.all_input_nodes):
                reads.add(node)
        return [n for n in self.graph.nodes if n in reads]


def _added(graph: fx.Graph, parts: list[fx.Node]) -> fx.Node:
    """``parts`` added left to right (tile order)."""
    total = parts[0]
    for part in parts[1:]:
        total = graph.call_function(operator.add, (total, part))
    return total


def _loss_kwargs(node: fx.Node) -> dict[str, Any]:
    """A loss node's keyword arguments past (input, target), positional ones named."""
    names = ("weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    given = dict(zip(names, node.args[2:]))
    return {**given, **{k: v for k, v in node.kwargs.items() if k in names}}


def _record_values(graph: fx.Graph) -> None:
    """``example_value`` of every node that lacks one, computed from its arguments'
    values in their fake mode (real tensors compute for real)."""
    from torch._subclasses.fake_tensor import FakeTensor

    values = [node_value(n) for n in graph.nodes]
    mode = next((v.fake_mode for v in values if isinstance(v, FakeTensor)), None)
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method") or node_value(node) is not None:
            continue
        args = fx.node.map_arg(node.args, node_value)
        kwargs = fx.node.map_arg(node.kwargs, node_value)
        with mode if mode is not None else contextlib.nullcontext():
            if node.op == "call_method":
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                value = node.target(*args, **kwargs)
        node.meta["example_value"] = value
