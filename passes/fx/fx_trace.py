"""The record of one compiled region's trace: :class:`FxTrace`, an :class:`ActivationTrace`
plus how it maps back onto the forward and backward graphs, and the queries the planner,
the lowering and the reports ask of it (what may move, what stays, what an op holds, the
trace at other sizes, the region as the step model sees it).

:func:`floor_detail` answers the floor report's query: what is on the device at one op of
the region's floor, the op's own operands and the largest other values alive there, each
named by the node that made it and how it got there. The floor is the region's plan with
everything movable moved: a saved activation is on the device from its first backward
reader to its last, any other value from the op that makes it to its last reader.

:func:`.graph_trace.build_fx_trace` builds the record; this module only reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import fx

from ..analysis.liveness import resident_bytes_without_offload
from ..ir.ops import MATERIALIZE
from ..ir.schedule import ResidencySchedule
from ..ir.trace import FORWARD_GRAPH, AccessKind, ActivationTrace, StorageId
from ..plan.step.model import RegionFloor
from .saved import SavedActivation

__all__ = ["FloorDetail", "FloorValue", "FxTrace", "floor_detail"]


@dataclass(frozen=True)
class FxTrace:
    """An :class:`ActivationTrace` plus how it maps back onto the graphs.

    Invariant: ``op_nodes[i]`` names the node of ``trace.ops[i]``; ops
    ``0 .. num_fw_ops - 1`` are the forward's. ``node_storage`` maps qualified node
    names (``"fw:addmm"``) to the storage of their first tensor leaf. The forward's
    first ``num_fwd_outputs`` outputs are the model's; the rest are saved tensors.
    """

    trace: ActivationTrace
    op_nodes: tuple[str, ...]
    num_fw_ops: int
    saved: tuple[SavedActivation, ...]
    node_storage: Mapping[str, StorageId]
    device: torch.device
    num_fwd_outputs: int
    """How many of the forward's outputs are model outputs (``build_fx_trace``); the
    same node may also be a saved tensor, returned again among the rest."""
    activation_inputs: frozenset[str] = frozenset()
    """The forward placeholders traced as activations (``build_fx_trace``)."""
    outputs_move: bool = False
    """Whether saved model outputs may move (``build_fx_trace``)."""
    may_move: frozenset[str] | None = None
    """The saved tensors the caller lets move, None for all (``build_fx_trace``)."""
    storage_exprs: Mapping[StorageId, Any] = field(default_factory=dict)
    """Bytes of each storage whose size is symbolic, as a sympy expression of the sizes'
    symbols (``trace.storage_sizes`` holds it at the values a plan assumes,
    :mod:`.sizes`): :meth:`at_sizes` evaluates it at a call's own sizes."""
    own_operands: tuple[tuple[StorageId, ...], ...] = ()
    """Each op's own operands: the storages its node reads and writes (``trace.ops[i]``
    also reads every storage whose span inside a graph covers it: :mod:`.graph_trace`'s
    filling), for reports of what an op itself needs (:func:`floor_detail`)."""

    def at_sizes(self, values: Mapping[str, int]) -> ActivationTrace:
        """The trace with every symbolic storage at ``values`` (symbol name -> size;
        a symbol not named keeps the value the plan assumes). Same ops and accesses."""
        if not self.storage_exprs or not values:
            return self.trace
        sizes = dict(self.trace.storage_sizes)
        for sid, expr in self.storage_exprs.items():
            known = {s: values[str(s)] for s in expr.free_symbols if str(s) in values}
            if len(known) == len(expr.free_symbols):
                sizes[sid] = int(expr.xreplace(known))
        return dataclasses.replace(self.trace, storage_sizes=sizes)

    @property
    def peak_without_offload(self) -> int:
        return max(resident_bytes_without_offload(self.trace), default=0)

    @property
    def saved_bytes(self) -> int:
        """Bytes of the distinct storages saved activations hold (not parameters/inputs)."""
        storages = {s.storage for s in self.saved if s.storage is not None}
        return sum(self.trace.storage_sizes[sid] for sid in storages)

    def movable(self) -> dict[StorageId, tuple[SavedActivation, ...]]:
        """Offloadable storages and the saved tensors on each, in forward output order
        (all share one ``base``: one copy moves them all)."""
        return self._by_storage(offloadable=True)

    def held(self) -> frozenset[StorageId]:
        """The storages of the activation inputs: what a region's caller holds through
        its whole forward."""
        return frozenset(self.node_storage[key] for key in
                         (f"{FORWARD_GRAPH}:{name}" for name in self.activation_inputs)
                         if key in self.node_storage)

    def region_floor(
        self, schedule: ResidencySchedule, *, trace: ActivationTrace | None = None,
        lowerable: bool = False,
    ) -> RegionFloor:
        """This region as the step model sees it, running ``schedule`` (``trace``: this
        trace at other sizes, :meth:`at_sizes`; ``lowerable``: the step plan may lower
        it again with a schedule of its own)."""
        return RegionFloor(trace or self.trace, self.num_fw_ops, schedule,
                           frozenset(self.movable()), self.held(), lowerable)

    def kept(self) -> dict[StorageId, tuple[SavedActivation, ...]]:
        """Activation storages that stay on the device and the saved tensors on each
        (parameters and inputs are not activations and are not listed)."""
        return self._by_storage(offloadable=False)

    def _by_storage(self, *, offloadable: bool) -> dict[StorageId, tuple[SavedActivation, ...]]:
        groups: dict[StorageId, list[SavedActivation]] = {}
        for saved in self.saved:
            if saved.offloadable is offloadable and saved.storage is not None:
                groups.setdefault(saved.storage, []).append(saved)
        return {sid: tuple(group) for sid, group in groups.items()}

    def op_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.op_nodes)}

    def operands(self, op: int) -> tuple[tuple[str, int], ...]:
        """What op ``op`` holds on the device while it runs (the storages it touches,
        its span's included: nothing moves inside a graph), largest first: each storage
        named by the first node that holds it (``"bw:mul_7"``, ``"fw:addmm"`` for a
        saved activation), with its bytes."""
        names: dict[StorageId, str] = {}
        for name, sid in self.node_storage.items():
            names.setdefault(sid, name)
        sizes = self.trace.storage_sizes
        found = [(names.get(sid, f"storage {sid}"), sizes[sid]) for sid in self.trace.ops[op].storages]
        return tuple(sorted(found, key=lambda item: -item[1]))


_GB = 1e9


class FloorValue(NamedTuple):
    """One value on the device at the op: the node that made it (``"bw:mul_15"``; a
    forward input by its placeholder), its bytes, and how it is there: ``"saved,
    reloaded"``, ``"saved, kept"``, ``"recomputed"``, ``"region input"``, ``"made in the
    forward"`` or ``"made in the backward"``; ``written``: the op makes it."""

    name: str
    nbytes: int
    how: str
    written: bool = False

    def describe(self) -> str:
        return f"{self.name} {self.nbytes / _GB:.2f} GB ({self.how})"


class FloorDetail(NamedTuple):
    """The op, its operands (``operand_bytes`` in all) and the ``held`` values, largest
    first, that the floor keeps on the device beside them."""

    op: str
    operands: tuple[FloorValue, ...]
    held: tuple[FloorValue, ...]

    @property
    def operand_bytes(self) -> int:
        return sum(v.nbytes for v in self.operands)

    def describe(self, held: int = 6) -> str:
        reads = ", ".join(v.describe() for v in self.operands if not v.written) or "nothing"
        writes = ", ".join(v.describe() for v in self.operands if v.written) or "nothing"
        also = "; ".join(v.describe() for v in self.held[:held]) or "nothing else"
        return f"{self.op} reads {reads}; writes {writes}; also on the device: {also}"


def floor_detail(
    fx_trace: FxTrace, op: str, *, least_bytes: int = 0,
    graphs: tuple[fx.GraphModule, fx.GraphModule] | None = None,
) -> FloorDetail:
    """The :class:`FloorDetail` of trace op ``op`` (``"bw:mul_15"``) of ``fx_trace``;
    ``held`` lists the values of at least ``least_bytes``; ``graphs`` (the forward and
    backward the trace was built from) name a recomputed value by what it recomputes.
    Raises ``KeyError`` for an op the trace does not have."""
    index = fx_trace.op_index()[op]
    trace = fx_trace.trace
    names = _names(fx_trace, graphs)
    movable, kept = fx_trace.movable(), fx_trace.kept()
    inputs = {fx_trace.node_storage.get(f"fw:{name}") for name in fx_trace.activation_inputs}
    backward = index >= fx_trace.num_fw_ops

    def value(sid: StorageId, written: bool = False) -> FloorValue:
        name = names.get(sid, f"storage {sid}")
        if sid in inputs:
            how = "region input" + (", reloaded" if sid in movable and backward else "")
        elif sid in movable:
            how = "saved, reloaded" if backward else "saved"
        elif sid in kept:
            how = "saved, kept"
        elif "_recomputed" in name or ":materialize" in name:  # recompute_splice's nodes
            how = "recomputed"
        else:
            how = "made in the backward" if name.startswith("bw:") else "made in the forward"
        return FloorValue(name, trace.storage_sizes[sid], how, written)

    own = {sid for sid, _ in _accesses(fx_trace, index)}
    operands = tuple(value(sid, kind is AccessKind.WRITE) for sid, kind in _accesses(fx_trace, index))
    held = [
        value(sid) for sid in trace.accessed_storages()
        if sid not in own and trace.storage_sizes[sid] >= least_bytes
        and _alive(fx_trace, sid, index, sid in movable)
    ]
    held.sort(key=lambda v: -v.nbytes)
    return FloorDetail(op, operands, tuple(held))


def _accesses(fx_trace: FxTrace, index: int) -> Iterable[tuple[StorageId, AccessKind]]:
    own = fx_trace.own_operands[index] if fx_trace.own_operands else ()
    kinds = {a.storage: a.kind for a in fx_trace.trace.ops[index].accesses}
    return [(sid, kinds.get(sid, AccessKind.READ)) for sid in own]


def _alive(fx_trace: FxTrace, sid: StorageId, index: int, movable: bool) -> bool:
    """Whether ``sid`` is on the device during op ``index`` of the floor: from its first
    access to its last; a moved one only inside each graph. A model output the backward
    does not read is its caller's after the forward (the next block's input), as the step
    plan counts it, so it is not counted past its last access either."""
    accesses = [i for i, _ in fx_trace.trace.accesses_of(sid)]
    if movable:
        split = fx_trace.num_fw_ops
        accesses = [i for i in accesses if (i >= split) == (index >= split)]
    return bool(accesses) and accesses[0] <= index <= accesses[-1]


def _names(
    fx_trace: FxTrace, graphs: tuple[fx.GraphModule, fx.GraphModule] | None
) -> dict[StorageId, str]:
    """Each storage by the op that first writes it, else (a forward input) by its node;
    a recompute's copy by the node its chain ends in (``bw:getitem_4_recomputed``)."""
    nodes = {} if graphs is None else {
        f"{prefix}:{n.name}": n for prefix, g in zip(("fw", "bw"), graphs) for n in g.graph.nodes
    }
    names: dict[StorageId, str] = {}
    for op, operands in zip(fx_trace.trace.ops, fx_trace.own_operands or ()):
        kinds = {a.storage: a.kind for a in op.accesses}
        node = nodes.get(op.name)
        name = op.name
        if node is not None and node.target is MATERIALIZE and node.args:
            name = f"bw:{node.args[0].name}"
        for sid in operands:
            if kinds.get(sid) is AccessKind.WRITE:
                names.setdefault(sid, name)
    for qualified, sid in fx_trace.node_storage.items():
        names.setdefault(sid, qualified)
    return names
