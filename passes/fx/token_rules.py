"""Per-op rules of sequence tiling's analysis: given where each input's token dim is,
is an op of a Dynamo graph token-wise, and along which dim of its output?

An op is **token-wise** along output dim ``d`` when every slice of its output along
``d`` is computed from the same slice of its inputs' token dims alone (and from
arguments that have no token dim, whole): splitting the sequence into tiles and running
the op on each tile gives the untiled output's slices, one per tile. Pointwise ops,
linear layers, norms over the features, reshapes that keep the token dim, the
per-token loss are; attention, a reduction over the sequence, an op the table does not
know are not (``OpKind.MIXES``: a tile boundary). A sum or mean over the tokens
(``OpKind.TOKEN_SUM``: the loss) ends a tiled span: its tiles' partial sums are added.

Each rule reads only the graph (targets, arguments) and the values Dynamo recorded
(``meta["example_value"]``, else ``meta["val"]``): shapes, never data. A rule that
cannot prove token-wise-ness answers ``MIXES``; a wrong ``MIXES`` costs memory, a wrong
token-wise answer would change results, so every rule errs towards ``MIXES``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.nn.functional as F

__all__ = ["OpKind", "TokenAxis", "node_value", "rule_for"]


class OpKind(str, Enum):
    """What an op does to the tokens (module docstring)."""

    TOKENWISE = "tokenwise"
    TOKEN_SUM = "token_sum"
    FREE = "free"
    """No input has a token dim: computed once, never tiled (weights, tables, constants)."""
    MIXES = "mixes"


class TokenAxis(NamedTuple):
    """One node's answer. ``dim``: the dim of its value that enumerates tokens (None: it
    has none). ``cuts``: arguments without a token dim that a tile reads one slice of,
    as ``(argument node name, dim)`` (a table of ``T`` rows multiplied into the tokens).
    ``reduced``: the value depends on a sum over tokens (a loss and what is computed
    from it): a token-wise op reading it would mix tokens."""

    kind: OpKind
    dim: int | None = None
    cuts: tuple[tuple[str, int], ...] = ()
    reduced: bool = False

    def __repr__(self) -> str:
        text = self.kind.value + ("" if self.dim is None else f"@{self.dim}")
        if self.cuts:
            text += " cuts " + ",".join(f"{name}@{dim}" for name, dim in self.cuts)
        return text + (" reduced" if self.reduced else "")


MIXES = TokenAxis(OpKind.MIXES)
Axes = Mapping[fx.Node, TokenAxis]
Rule = Callable[[fx.Node, Axes], TokenAxis]


def node_value(node: Any) -> Any:
    """The value Dynamo (``example_value``) or a fake-tensor pass (``val``) recorded."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def _static_shape(value: Any) -> tuple[int, ...] | None:
    """The value's sizes when it is a tensor of plain-int sizes (tiling rewrites sizes)."""
    if not isinstance(value, torch.Tensor):
        return None
    shape = tuple(value.shape)
    return shape if all(isinstance(s, int) for s in shape) else None


def _token_input(node: fx.Node, axes: Axes, index: int = 0, name: str = "input") -> tuple[
        fx.Node, int, tuple[int, ...]] | None:
    """The argument at ``index`` when it carries a token dim, with its dim and shape."""
    arg = _arg(node, index, name)
    if not isinstance(arg, fx.Node) or arg not in axes:
        return None
    axis, shape = axes[arg], _static_shape(node_value(arg))
    if axis.dim is None or axis.reduced or shape is None:
        return None
    return arg, axis.dim, shape


def _free(arg: Any, axes: Axes) -> bool:
    """No token dim and no sum over tokens in it: read whole by every tile."""
    if not isinstance(arg, fx.Node):
        return True
    axis = axes.get(arg)
    return axis is None or (axis.dim is None and not axis.reduced)


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _pointwise(node: fx.Node, axes: Axes) -> TokenAxis:
    """Elementwise with broadcasting: token dims line up from the right; an argument
    without one broadcasts (size 1) or is cut (the token extent)."""
    out = _static_shape(node_value(node))
    if out is None:
        return MIXES
    dims, others = set(), []
    for arg in node.all_input_nodes:
        axis, shape = axes.get(arg), _static_shape(node_value(arg))
        if axis is None or not isinstance(node_value(arg), torch.Tensor):
            continue
        if axis.reduced or shape is None:
            return MIXES
        if axis.dim is None:
            others.append((arg, shape))
        elif shape[axis.dim] != 1:
            dims.add(len(out) - len(shape) + axis.dim)
    if len(dims) != 1:
        return MIXES
    dim = dims.pop()
    cuts = []
    for arg, shape in others:
        at = dim - (len(out) - len(shape))
        if at < 0 or shape[at] == 1:
            continue
        if shape[at] != out[dim]:
            return MIXES
        cuts.append((arg.name, at))
    return TokenAxis(OpKind.TOKENWISE, dim, tuple(cuts))


def _unary(node: fx.Node, axes: Axes) -> TokenAxis:
    """Elementwise in its first argument; other arguments give a dtype or device only
    (``type_as(other)``, ``to(other)``)."""
    found = _token_input(node, axes, 0, "input")
    return MIXES if found is None else TokenAxis(OpKind.TOKENWISE, found[1])


def _dropout(node: fx.Node, axes: Axes) -> TokenAxis:
    """Pointwise when it draws nothing (``p == 0`` or eval); a recomputed random op would
    draw other numbers, so otherwise not tiled."""
    p, training = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", True)
    return _unary(node, axes) if p == 0 or training is False else MIXES


def _reduce_dims(node: fx.Node, ndim: int) -> set[int] | None:
    dim = _arg(node, 1, "dim", None)
    if dim is None:
        dim = node.kwargs.get("axis")
    if dim is None:
        return None
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    if not all(isinstance(d, int) for d in dims):
        return set()  # not understood: the rule answers MIXES
    return {_norm(d, ndim) for d in dims}


def _reduction(summing: bool) -> Rule:
    """A reduction over ``dim``: token-wise when the token dim is not reduced; a sum or
    mean over it (``summing``) is a TOKEN_SUM, any other reduction over it mixes."""
    def rule(node: fx.Node, axes: Axes) -> TokenAxis:
        found = _token_input(node, axes)
        if found is None or len(node.all_input_nodes) != 1:
            return MIXES
        _, dim, shape = found
        dims = _reduce_dims(node, len(shape))
        if dims is not None and not dims:
            return MIXES
        if dims is None or dim in dims:
            return TokenAxis(OpKind.TOKEN_SUM, reduced=True) if summing else MIXES
        keep = _arg(node, 2, "keepdim", False)
        return TokenAxis(OpKind.TOKENWISE, dim if keep else dim - sum(d < dim for d in dims))
    return rule


def _along(node: fx.Node, axes: Axes) -> TokenAxis:
    """An op along one dim that keeps the shape (softmax, cumsum): token-wise elsewhere."""
    found = _token_input(node, axes)
    if found is None or len(node.all_input_nodes) != 1:
        return MIXES
    along = _arg(node, 1, "dim")
    if not isinstance(along, int) or _norm(along, len(found[2])) == found[1]:
        return MIXES
    return TokenAxis(OpKind.TOKENWISE, found[1])


def _linear(node: fx.Node, axes: Axes) -> TokenAxis:
    """``linear(x, W, b)`` and ``x @ W``: token-wise over x's rows, W and b free."""
    found = _token_input(node, axes)
    weights = [a for a in node.all_input_nodes if a is not _arg(node, 0, "input")]
    if found is None or not all(_free(w, axes) for w in weights):
        return MIXES
    _, dim, shape = found
    if node.target in (torch.matmul, operator.matmul, "matmul", "__matmul__"):
        other = node_value(_arg(node, 1, "other"))
        if not isinstance(other, torch.Tensor) or other.ndim != 2:
            return MIXES
    return MIXES if dim == len(shape) - 1 else TokenAxis(OpKind.TOKENWISE, dim)


def _norm_layer(node: fx.Node, axes: Axes) -> TokenAxis:
    """``layer_norm`` / ``rms_norm`` over the trailing ``normalized_shape``."""
    found = _token_input(node, axes)
    weights = [a for a in node.all_input_nodes if a is not _arg(node, 0, "input")]
    normalized = _arg(node, 1, "normalized_shape")
    if found is None or not all(_free(w, axes) for w in weights) or normalized is None:
        return MIXES
    _, dim, shape = found
    count = len(normalized) if isinstance(normalized, (list, tuple)) else 1
    return TokenAxis(OpKind.TOKENWISE, dim) if dim < len(shape) - count else MIXES


def _embedding(node: fx.Node, axes: Axes) -> TokenAxis:
    found = _token_input(node, axes)
    if found is None or not _free(_arg(node, 1, "weight"), axes):
        return MIXES
    return TokenAxis(OpKind.TOKENWISE, found[1])


def _loss(node: fx.Node, axes: Axes) -> TokenAxis:
    """``cross_entropy`` / ``nll_loss`` of (N, C[, d...]) logits and (N[, d...]) targets,
    unweighted: per token with ``reduction="none"``, else a TOKEN_SUM (the mean is the
    sum over the counted targets divided by their count)."""
    logits, target = _token_input(node, axes), _token_input(node, axes, 1, "target")
    extra = [_arg(node, 2, "weight"), _arg(node, 3, "size_average"), _arg(node, 5, "reduce")]
    if logits is None or target is None or any(e is not None for e in extra):
        return MIXES
    dim, target_dim = logits[1], target[1]
    if dim == 1 or target_dim != (0 if dim == 0 else dim - 1):
        return MIXES
    reduction = _arg(node, 6, "reduction", "mean")
    if reduction == "none":
        return TokenAxis(OpKind.TOKENWISE, target_dim)
    return TokenAxis(OpKind.TOKEN_SUM, reduced=True) if reduction in ("mean", "sum") else MIXES


def _reshape(node: fx.Node, axes: Axes) -> TokenAxis:
    """A view or reshape keeps the token dim when the sizes before it multiply to the
    same number and its extent is unchanged (then row ``t`` of the output is row ``t``
    of the input). The rewrite gives each tile its own sizes."""
    found, out = _token_input(node, axes), _static_shape(node_value(node))
    if found is None or out is None:
        return MIXES
    _, dim, shape = found
    if node.target == "unflatten" and _norm(_arg(node, 1, "dim"), len(shape)) == dim:
        return MIXES
    before = math.prod(shape[:dim])
    for at, extent in enumerate(out):
        if extent == shape[dim] and math.prod(out[:at]) == before:
            return TokenAxis(OpKind.TOKENWISE, at)
    return MIXES


def _dims_args(node: fx.Node) -> list[Any]:
    args = list(node.args[1:])
    return list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else args


def _transpose(node: fx.Node, axes: Axes) -> TokenAxis:
    found = _token_input(node, axes)
    if found is None:
        return MIXES
    _, dim, shape = found
    if node.target in ("permute", torch.permute):
        order = [_norm(d, len(shape)) for d in _dims_args(node)]
        return TokenAxis(OpKind.TOKENWISE, order.index(dim)) if dim in order else MIXES
    if node.target in ("t", torch.t):
        return TokenAxis(OpKind.TOKENWISE, len(shape) - 1 - dim)
    first, second = (_norm(d, len(shape)) for d in (_arg(node, 1, "dim0"), _arg(node, 2, "dim1")))
    swapped = {first: second, second: first}
    return TokenAxis(OpKind.TOKENWISE, swapped.get(dim, dim))


def _expand(node: fx.Node, axes: Axes) -> TokenAxis:
    """New leading dims or size-1 dims broadcast; the token dim keeps its extent."""
    found, out = _token_input(node, axes), _static_shape(node_value(node))
    if found is None or out is None:
        return MIXES
    _, dim, shape = found
    at = len(out) - len(shape) + dim
    return TokenAxis(OpKind.TOKENWISE, at) if out[at] == shape[dim] else MIXES


def _split(node: fx.Node, axes: Axes) -> TokenAxis:
    """``chunk`` / ``split`` / ``unbind`` along another dim: each piece keeps the token
    dim (the tuple's axis is its items')."""
    found = _token_input(node, axes)
    if found is None or len(node.all_input_nodes) != 1:
        return MIXES
    _, dim, shape = found
    unbind = node.target in ("unbind", torch.unbind)
    along = _arg(node, 1, "dim", 0) if unbind else _arg(node, 2, "dim", 0)
    if not isinstance(along, int) or _norm(along, len(shape)) == dim:
        return MIXES
    return TokenAxis(OpKind.TOKENWISE, dim - 1 if unbind and _norm(along, len(shape)) < dim else dim)


def _cat(node: fx.Node, axes: Axes) -> TokenAxis:
    """``cat`` / ``stack`` along another dim of token-wise (or cut) tensors."""
    tensors, out = _arg(node, 0, "tensors"), _static_shape(node_value(node))
    stack = node.target is torch.stack
    if not isinstance(tensors, (list, tuple)) or out is None:
        return MIXES
    along = _norm(_arg(node, 1, "dim", 0), len(out))
    dims, cuts = set(), []
    for arg in tensors:
        axis, shape = axes.get(arg), _static_shape(node_value(arg))
        if axis is None or axis.reduced or shape is None:
            return MIXES
        if axis.dim is not None:
            dims.add(axis.dim + (1 if stack and along <= axis.dim else 0))
        else:
            cuts.append((arg, shape))
    if len(dims) != 1 or along in dims:
        return MIXES
    dim = dims.pop()
    at = dim - (1 if stack and along < dim else 0)
    if any(shape[at] != out[dim] for _, shape in cuts):
        return MIXES
    return TokenAxis(OpKind.TOKENWISE, dim, tuple((arg.name, at) for arg, _ in cuts))


def _getitem(node: fx.Node, axes: Axes) -> TokenAxis:
    """An item of a token-wise tuple, or basic indexing that keeps the token dim whole."""
    source, index = node.args
    if isinstance(node_value(source), (list, tuple)):
        axis = axes.get(source)
        return axis._replace(cuts=()) if axis is not None and axis.kind is OpKind.TOKENWISE else MIXES
    found = _token_input(node, axes)
    if found is None:
        return MIXES
    _, dim, shape = found
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(i is Ellipsis for i in items) > 1 or any(
            not (isinstance(i, (int, slice)) or i is None or i is Ellipsis) for i in items):
        return MIXES
    if Ellipsis in items:
        at = items.index(Ellipsis)
        fill = len(shape) - sum(i is not None for i in items if i is not Ellipsis)
        items[at:at + 1] = [slice(None)] * fill
    items += [slice(None)] * (len(shape) - sum(i is not None for i in items))
    source_dim = out_dim = 0
    for item in items:
        if item is None:
            out_dim += 1
            continue
        if source_dim == dim:
            whole = isinstance(item, slice) and item == slice(None)
            return TokenAxis(OpKind.TOKENWISE, out_dim) if whole else MIXES
        source_dim += 1
        out_dim += isinstance(item, slice)
    return MIXES


def _attention(node: fx.Node, axes: Axes) -> TokenAxis:
    """Attention mixes tokens; its output's rows are the query's tokens (a tile
    boundary that later token-wise ops read as their input)."""
    found = _token_input(node, axes, 0, "query")
    if found is not None and found[1] == len(found[2]) - 2:
        return TokenAxis(OpKind.MIXES, found[1])
    return MIXES


_POINTWISE_FUNCTIONS = (
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.rsqrt, torch.sqrt, torch.exp,
    torch.log, torch.tanh, torch.sigmoid, torch.abs, torch.pow, torch.where, torch.clamp,
    torch.maximum, torch.minimum, torch.erf, torch.sin, torch.cos, torch.square,
    torch.reciprocal, torch.masked_fill, F.silu, F.gelu, F.relu, F.tanh, F.sigmoid, F.softplus,
    F.leaky_relu, F.mish, F.elu, F.hardswish, F.hardtanh, F.relu6,
)
_POINTWISE_METHODS = (
    "add", "sub", "mul", "div", "pow", "neg", "rsqrt", "sqrt", "exp", "log", "tanh", "sigmoid",
    "abs", "clamp", "square", "reciprocal", "masked_fill", "sin", "cos", "relu", "erf",
    "__add__", "__sub__", "__mul__", "__truediv__", "__radd__", "__rmul__", "__rsub__",
)
_UNARY = ("float", "half", "bfloat16", "double", "to", "type_as", "type", "contiguous", "clone",
          "detach", torch.clone, torch.detach)

RULES: dict[Any, Rule] = {
    **dict.fromkeys(_POINTWISE_FUNCTIONS + _POINTWISE_METHODS, _pointwise),
    **dict.fromkeys(_UNARY, _unary),
    F.dropout: _dropout,
    **dict.fromkeys((torch.sum, torch.mean, "sum", "mean"), _reduction(summing=True)),
    **dict.fromkeys((torch.amax, torch.amin, torch.logsumexp, torch.var, torch.std, "amax", "amin",
                     "logsumexp", "var", "std"), _reduction(summing=False)),
    **dict.fromkeys((F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.cumsum,
                     "softmax", "log_softmax", "cumsum"), _along),
    **dict.fromkeys((F.linear, torch.matmul, operator.matmul, "matmul", "__matmul__"), _linear),
    **dict.fromkeys((F.layer_norm, F.rms_norm, torch.layer_norm, torch.rms_norm), _norm_layer),
    F.embedding: _embedding,
    **dict.fromkeys((F.cross_entropy, F.nll_loss), _loss),
    **dict.fromkeys(("view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze",
                     torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze), _reshape),
    **dict.fromkeys(("transpose", "permute", "t", "swapaxes", torch.transpose, torch.permute,
                     torch.t, torch.swapaxes), _transpose),
    "expand": _expand,
    **dict.fromkeys(("chunk", "split", "unbind", torch.chunk, torch.split, torch.unbind), _split),
    **dict.fromkeys((torch.cat, torch.concat, torch.stack), _cat),
    operator.getitem: _getitem,
    F.scaled_dot_product_attention: _attention,
}
"""Op -> rule: a callable for ``call_function`` nodes, a method name for
``call_method`` ones. Anything else with a token-dim input mixes tokens."""

SIZED_VIEWS = frozenset({"view", "reshape", "expand", torch.reshape})
"""Ops whose arguments spell the output's sizes: the rewrite gives each tile its own."""


def rule_for(node: fx.Node) -> Rule | None:
    """The rule of ``node``'s op (None: unknown, it mixes tokens)."""
    if node.op not in ("call_function", "call_method"):
        return None
    try:
        return RULES.get(node.target)
    except TypeError:  # an unhashable target
        return None
