"""Build an :class:`ActivationTrace` from AOTAutograd's forward and backward graphs
(:func:`build_fx_trace`: an :class:`~.fx_trace.FxTrace`, the trace with its map back onto
the graphs), and read the marks the lowering leaves on them.

The two graphs of one compiled region are laid end to end: every ``call_function``
node of the forward, then every one of the backward, is one op (``getitem`` nodes,
transfer ops and the views the lowering rebuilds on a reloaded base are not ops; they
name the storage of their source). Op names are
``"fw:<node>"`` / ``"bw:<node>"`` (``trace.FORWARD_GRAPH`` / ``BACKWARD_GRAPH``).

Storages (the trace's unit) come from fake-tensor metadata:

* every tensor an op returns is a new storage of ``numel x element_size`` bytes (at
  the sizes a plan assumes, :mod:`.sizes`), unless the op's schema says the result
  aliases an argument (views, in-place ops): then it is that argument's storage, and a
  mutated argument is a WRITE;
* placeholders of the forward (parameters, inputs) and non-saved placeholders of the
  backward (tangents) are not activations: they are not in the trace and never move,
  except forward placeholders the caller names *activation inputs* (the compile
  backend's step scope names a region's non-leaf tensor inputs: a block's input), which
  are storages whose first access is their first reader; likewise a saved activation
  that is also a model output moves only when the caller says so (``outputs_move``: in
  the step scope a region's output is the next region's input, dropped by the caller
  once that region has run, so the saved reference is what keeps it);
* a saved activation (a forward output the backward takes as a placeholder of the same
  name) is one storage across both graphs;
* a functional collective's ``wait_tensor`` reads its tensor inputs and writes its
  output (:mod:`..ir.trace_op`: the communication runs until then); a ``Work``-returning
  c10d op (which Dynamo graph-breaks on, but a hand-made graph may hold) writes every
  tensor it is given, its results are those tensors (no new storage), and a saved
  activation among them never moves (its communication ends at a wait no graph shows);
* model outputs (the first ``num_fwd_outputs`` forward outputs) and the backward's
  outputs (gradients) are ``retained``; gradients count 0 bytes: they are the
  optimizer's memory, sized by the parameters like the parameters themselves, not
  activations, and no plan can move them. The budget is an activation budget; the
  demo's measured activation peak leaves out the blocks that end the step as ``.grad``.

Offload policy (why the trace is "filled"): only the gap between a saved activation's
last forward access and its first backward access may be offloaded. A gap inside one
graph would make the lowering add a consumer that the inner compiler sees, which can
change what it materialises (an Inductor-fused bf16 value forced into memory rounds
differently). So every storage is recorded as READ by each op of its span inside a
graph (the bytes curve is unchanged: a storage is resident from its first to its last
access anyway), and the only gaps left are the cross-graph gaps of offloadable saved
activations. Which saved activations are offloadable is :mod:`.saved`'s rule: the
unit is the storage, so saved views move with their base (once per storage).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from ..ir.ops import DISK_OPS, TRANSFER_OPS
from ..ir.trace import (
    BACKWARD_GRAPH,
    FORWARD_GRAPH,
    AccessKind,
    ActivationTrace,
    StorageAccess,
    StorageId,
    TraceOp,
)
from ..ir.trace_op import PendingCollectives, returns_work, wait_accesses
from .cost_model import DeviceThroughput, node_seconds, tensor_bytes, throughput_for
from .fx_trace import FxTrace
from .saved import StorageBase, classify_saved

__all__ = [
    "REBUILT_VIEW_META",
    "RELOADED_AS_META",
    "build_fx_trace",
    "device_of",
    "fw_outputs",
    "is_rebuilt_view",
    "saved_output_names",
]

SAVED_NAMES_META = "hyper_offload_saved_names"
"""``node.meta`` key on a lowered forward's output node: per output, the name of the saved
activation it stands for (the backward placeholder keeps that name), None for outputs the
lowering left alone (every model output among them). Several saved views of one storage
all stand for its host copy."""

REBUILT_VIEW_META = "hyper_offload_rebuilt_view"
"""``node.meta`` key on a backward ``as_strided`` the lowering added: the saved view it
rebuilds on a reloaded base. Such a node is not an op (it aliases its source)."""

RELOADED_AS_META = "hyper_offload_reloaded_as"
"""``node.meta`` key on the backward node whose value the readers of a moved saved tensor
now get (the reload's wait, or the last step of its rebuild): the saved names it stands
for. :mod:`.lowering_check` requires its properties to equal the saved tensor's."""

_TRANSFER_OPS = frozenset((*TRANSFER_OPS, *DISK_OPS))


def fw_outputs(fw: fx.GraphModule) -> list[Any]:
    return list(fw.graph.find_nodes(op="output")[0].args[0])


def saved_output_names(fw: fx.GraphModule, num_fwd_outputs: int) -> list[str | None]:
    """Per saved output (every forward output after the first ``num_fwd_outputs``, which
    are the model's), the saved activation it stands for: its node name before lowering;
    a lowered output records it in ``SAVED_NAMES_META``. A model output stands for no
    saved tensor even where the same node is saved too (AOTAutograd then returns it
    twice): the caller gets it as the plain graph returns it."""
    output = fw.graph.find_nodes(op="output")[0]
    recorded = output.meta.get(SAVED_NAMES_META)
    nodes = fw_outputs(fw)
    names = [n.name if isinstance(n, fx.Node) else None for n in nodes]
    if recorded is not None:
        names = [name if name is not None else n for name, n in zip(recorded, names)]
    return names[num_fwd_outputs:]


def is_rebuilt_view(node: fx.Node) -> bool:
    """Whether ``node`` is a saved view the lowering rebuilt on a reloaded base."""
    return REBUILT_VIEW_META in node.meta


class _Builder:
    """Mutable state of one :func:`build_fx_trace` call."""

    def __init__(self, throughput: DeviceThroughput) -> None:
        self.throughput = throughput
        self.storage: dict[str, list[StorageId | None]] = {}  # qualified name -> per leaf
        self.sizes: dict[StorageId, int] = {}
        self.bases: dict[StorageId, StorageBase] = {}  # storage -> what created it
        self.exprs: dict[StorageId, Any] = {}  # storage -> its symbolic bytes
        self.ops: list[dict[StorageId, AccessKind]] = []
        self.names: list[str] = []
        self.durations: list[float] = []
        self.pending = PendingCollectives()  # an async collective's inputs live to its wait
        self.work_pinned: dict[StorageId, str] = {}  # storage -> why it never moves

    def new_storage(self, nbytes: int, base: StorageBase) -> StorageId:
        sid = len(self.sizes)
        self.sizes[sid] = nbytes
        self.bases[sid] = base
        expr = symbolic_bytes(base.value)
        if expr is not None:
            self.exprs[sid] = expr
        return sid

    def of(self, prefix: str, arg: Any) -> list[StorageId | None]:
        if isinstance(arg, fx.Node):
            return self.storage.get(f"{prefix}:{arg.name}", [None])
        return []

    def add_graph(self, prefix: str, graph: fx.Graph, placeholders: Mapping[str, StorageId]) -> None:
        for node in graph.nodes:
            qualified = f"{prefix}:{node.name}"
            if node.op == "placeholder":
                self.storage[qualified] = [placeholders.get(node.name)]
            elif node.op != "call_function":
                continue
            elif node.target is operator.getitem:
                source = self.storage.get(f"{prefix}:{node.args[0].name}", [])
                index = node.args[1]
                self.storage[qualified] = [source[index] if index < len(source) else None]
            elif node.target in _TRANSFER_OPS or is_rebuilt_view(node):
                self.storage[qualified] = self.of(prefix, node.args[0]) if node.args else [None]
            else:
                self.add_op(prefix, node, qualified)

    def add_op(self, prefix: str, node: fx.Node, qualified: str) -> None:
        if returns_work(node.target):
            self.add_work_op(prefix, node, qualified)
            return
        accesses: dict[StorageId, AccessKind] = {}
        schema = getattr(node.target, "_schema", None)
        alias_arg: dict[Any, list[StorageId | None]] = {}
        flat_args = list(node.args) + list(node.kwargs.values())
        arguments = list(schema.arguments) if schema is not None else []
        for position, arg in enumerate(flat_args):
            leaves = _node_leaves(arg)
            sids = [s for leaf in leaves for s in self.of(prefix, leaf)]
            info = _arg_alias(arguments, node, position)
            if info is not None:
                alias_arg[frozenset(info.before_set)] = sids
            write = info is not None and info.is_write
            for sid in sids:
                if sid is not None:
                    if write or accesses.get(sid) is AccessKind.WRITE:
                        accesses[sid] = AccessKind.WRITE
                    else:
                        accesses[sid] = AccessKind.READ
        out_sids: list[StorageId | None] = []
        values = _value_leaves(node.meta.get("val"))
        returns = list(schema.returns) if schema is not None else []
        for index, value in enumerate(values):
            alias_set = _return_alias(arguments, returns, index)
            if alias_set and alias_set in alias_arg:
                aliased = alias_arg[alias_set]
                out_sids.append(aliased[0] if aliased else None)
                continue
            if not isinstance(value, torch.Tensor):
                out_sids.append(None)
                continue
            base = StorageBase(node.name, index, value)
            sid = self.new_storage(tensor_bytes(value, qualified), base)
            accesses[sid] = AccessKind.WRITE
            out_sids.append(sid)
        self.storage[qualified] = out_sids or [None]
        reads = [sid for sid, kind in accesses.items() if kind is AccessKind.READ]
        self.pending.issued(node.target, reads, [s for s in out_sids if s is not None])
        wait_accesses(
            self.pending, node.target, reads, accesses, AccessKind.READ, AccessKind.WRITE
        )
        self.ops.append(accesses)
        self.names.append(qualified)
        self.durations.append(node_seconds(node, self.throughput))

    def add_work_op(self, prefix: str, node: fx.Node, qualified: str) -> None:
        """A ``Work``-returning op: WRITEs every tensor it is given and pins it (the
        communication ends at a ``Work.wait()``, no op); its results alias them."""
        accesses: dict[StorageId, AccessKind] = {}
        by_key: dict[int, StorageId] = {}  # fake storage -> storage id
        for leaf in _node_leaves(list(node.args) + list(node.kwargs.values())):
            value, sids = leaf.meta.get("val"), self.of(prefix, leaf)
            for sid in sids:
                if sid is not None:
                    accesses[sid] = AccessKind.WRITE
                    self.work_pinned[sid] = f"used by {node.target}, which returns a c10d Work"
            if isinstance(value, torch.Tensor) and sids and sids[0] is not None:
                by_key[value.untyped_storage()._cdata] = sids[0]
        out: list[StorageId | None] = []
        for value in _value_leaves(node.meta.get("val")):  # (Tensor or Tensor[], Work)
            first = value[0] if isinstance(value, (list, tuple)) and value else value
            aliased = isinstance(first, torch.Tensor)
            out.append(by_key.get(first.untyped_storage()._cdata) if aliased else None)
        self.storage[qualified] = out or [None]
        self.ops.append(accesses)
        self.names.append(qualified)
        self.durations.append(node_seconds(node, self.throughput))


def symbolic_bytes(value: Any) -> Any | None:
    """``value``'s bytes as a sympy expression of its sizes' symbols, or None when they
    are a number (a static size)."""
    if not isinstance(value, torch.Tensor):
        return None
    numel = value.numel()
    if not isinstance(numel, torch.SymInt) or not numel.node.expr.free_symbols:
        return None
    return numel.node.expr * value.element_size()


def _node_leaves(arg: Any) -> list[fx.Node]:
    if isinstance(arg, fx.Node):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [leaf for item in arg for leaf in _node_leaves(item)]
    return []


def _value_leaves(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _return_alias(arguments: Sequence[Any], returns: Sequence[Any], index: int) -> frozenset[str]:
    """The alias set result ``index`` shares with an argument (empty: a new storage).

    A single list return (``split``, ``unbind``: ``Tensor(a -> *) self -> Tensor(a)[]``)
    carries its elements' annotation on the list type, which the Python schema does not
    expose; the argument's ``-> *`` (it aliases the elements of an output list) says it."""
    if len(returns) == 1 and isinstance(returns[0].type, torch.ListType):
        for argument in arguments:
            info = argument.alias_info
            if info is not None and "*" in info.after_set and info.before_set:
                return frozenset(info.before_set)
        return frozenset()
    info = returns[index].alias_info if index < len(returns) else None
    return frozenset(info.before_set) if info is not None else frozenset()


def _arg_alias(arguments: Sequence[Any], node: fx.Node, position: int) -> Any:
    """Alias info of the schema argument at ``position`` (args, then kwargs by name)."""
    if position < len(node.args):
        return arguments[position].alias_info if position < len(arguments) else None
    name = list(node.kwargs)[position - len(node.args)]
    for argument in arguments:
        if argument.name == name:
            return argument.alias_info
    return None


def build_fx_trace(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    budget_bytes: int = 0,
    throughput: DeviceThroughput | None = None,
    d2h_bandwidth_gbps: float = 16.0,
    h2d_bandwidth_gbps: float = 16.0,
    activation_inputs: frozenset[str] = frozenset(),
    outputs_move: bool = False,
    may_move: frozenset[str] | None = None,
) -> FxTrace:
    """The trace of one region (see the module docstring). Accepts lowered graphs too:
    transfer ops are not ops and alias their source, so a correct lowering yields the
    same trace as the graphs it came from. ``activation_inputs`` names forward
    placeholders that are activations; ``outputs_move``: a saved activation that is also
    a model output may move (see below); ``may_move``: the saved tensors that may move
    (None: all), a storage only when every saved tensor on it may."""
    outputs = fw_outputs(fw)
    device = device_of(outputs)
    builder = _Builder(throughput or throughput_for(device))
    inputs = _input_storages(builder, fw.graph, activation_inputs)
    builder.add_graph(FORWARD_GRAPH, fw.graph, inputs)
    num_fw_ops, num_fw_storages = len(builder.ops), len(builder.sizes)
    saved_nodes = _saved_nodes(fw, bw, outputs, num_fwd_outputs)
    saved_storage = {
        n.name: builder.storage.get(f"{FORWARD_GRAPH}:{n.name}", [None])[0] for n in saved_nodes
    }
    builder.add_graph(
        BACKWARD_GRAPH, bw.graph, {k: v for k, v in saved_storage.items() if v is not None}
    )
    model_outputs = {
        sid
        for node in outputs[:num_fwd_outputs]
        for sid in builder.of(FORWARD_GRAPH, node)
        if sid is not None
    }
    grads = {
        sid
        for node in _node_leaves(bw.graph.find_nodes(op="output")[0].args[0])
        for sid in builder.of(BACKWARD_GRAPH, node)
        if sid is not None
    }
    for sid in grads - model_outputs:
        builder.sizes[sid] = 0  # the optimizer's memory, not activations (see above)
    written = {sid for accesses in builder.ops[:num_fw_ops] for sid, kind in accesses.items()
               if kind is AccessKind.WRITE}
    saved = classify_saved(
        fw.graph, saved_nodes, storage_of=saved_storage, sizes=builder.sizes,
        bases={sid: base for sid, base in builder.bases.items() if sid < num_fw_storages},
        model_outputs=set() if outputs_move else model_outputs,
        pinned={**_held_back(saved_nodes, saved_storage, may_move),
                **{sid: "a graph input the forward writes in place"
                   for sid in inputs.values() if sid in written}, **builder.work_pinned},
    )
    offloadable = {s.storage for s in saved if s.offloadable}
    ops = _filled_ops(builder.ops, num_fw_ops, offloadable)
    trace = ActivationTrace(
        ops=tuple(
            TraceOp(name, tuple(StorageAccess(s, k) for s, k in accesses.items()),
                    duration_s=duration)
            for name, accesses, duration in zip(builder.names, ops, builder.durations)
        ),
        storage_sizes=builder.sizes,
        budget_bytes=budget_bytes,
        retained=frozenset(model_outputs | grads),
        d2h_bandwidth_gbps=d2h_bandwidth_gbps,
        h2d_bandwidth_gbps=h2d_bandwidth_gbps,
    )
    node_storage = {name: sids[0] for name, sids in builder.storage.items() if sids and sids[0] is not None}
    exprs = {sid: expr for sid, expr in builder.exprs.items() if builder.sizes[sid]}
    return FxTrace(
        trace, tuple(builder.names), num_fw_ops, tuple(saved), node_storage, device,
        num_fwd_outputs, frozenset(inputs), outputs_move, may_move=may_move,
        storage_exprs=exprs,
        own_operands=tuple(tuple(sorted(accesses)) for accesses in builder.ops),
    )


def _held_back(
    saved_nodes: Sequence[fx.Node], storage_of: Mapping[str, StorageId | None],
    may_move: frozenset[str] | None,
) -> dict[StorageId, str]:
    """The storages of saved tensors outside ``may_move``, with why they stay."""
    if may_move is None:
        return {}
    return {
        sid: f"{node.name} is not among the saved tensors the caller lets move (move_only)"
        for node in saved_nodes
        if node.name not in may_move and (sid := storage_of.get(node.name)) is not None
    }


def _saved_nodes(
    fw: fx.GraphModule, bw: fx.GraphModule, outputs: Sequence[Any], num_fwd_outputs: int
) -> list[fx.Node]:
    """The forward nodes the backward takes as saved tensors. A lowered forward returns
    a wait node in place of each saved activation; this names the activation itself
    (found by its saved name), so a lowering's trace is unchanged."""
    bw_placeholders = {n.name for n in bw.graph.find_nodes(op="placeholder")}
    fw_nodes = {n.name: n for n in fw.graph.nodes}
    return [
        fw_nodes.get(name, node)
        for name, node in zip(saved_output_names(fw, num_fwd_outputs), outputs[num_fwd_outputs:])
        if isinstance(node, fx.Node) and name in bw_placeholders
        and isinstance(node.meta.get("val"), torch.Tensor)
    ]


def _input_storages(
    builder: _Builder, fw: fx.Graph, activation_inputs: frozenset[str]
) -> dict[str, StorageId]:
    """A storage for each forward placeholder named in ``activation_inputs``: a graph
    input the caller knows to be an activation (the step scope's rule, module docstring
    of :mod:`.saved`); it exists before the region runs, so no op creates it and its first
    access is its first reader."""
    storages = {}
    for node in fw.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if node.name in activation_inputs and isinstance(value, torch.Tensor):
            base = StorageBase(node.name, 0, value)
            storages[node.name] = builder.new_storage(tensor_bytes(value, f"fw:{node.name}"), base)
    return storages


def device_of(outputs: Iterable[Any]) -> torch.device:
    for node in outputs:
        value = node.meta.get("val") if isinstance(node, fx.Node) else None
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _filled_ops(
    ops: Sequence[dict[StorageId, AccessKind]], num_fw_ops: int, offloadable: set[StorageId]
) -> list[dict[StorageId, AccessKind]]:
    """Each storage READ by every op of its span inside each graph; offloadable saved
    activations keep the one gap between the graphs (see the module docstring)."""
    first: dict[StorageId, int] = {}
    last: dict[StorageId, int] = {}
    last_fw: dict[StorageId, int] = {}
    first_bw: dict[StorageId, int] = {}
    for index, accesses in enumerate(ops):
        for sid in accesses:
            first.setdefault(sid, index)
            last[sid] = index
            if index < num_fw_ops:
                last_fw[sid] = index
            else:
                first_bw.setdefault(sid, index)
    filled = [dict(accesses) for accesses in ops]
    for sid, start in first.items():
        if sid in offloadable and sid in last_fw and sid in first_bw:
            spans = ((start, last_fw[sid]), (first_bw[sid], last[sid]))
        else:
            spans = ((start, last[sid]),)
        for lo, hi in spans:
            for index in range(lo, hi + 1):
                filled[index].setdefault(sid, AccessKind.READ)
    return filled
