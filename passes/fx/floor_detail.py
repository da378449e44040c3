"""What is on the device at one op of a region's floor: the op's own operands, and the
largest other values alive there, each named by the node that made it and how it got
there: the floor report names what remains, which op and which operands.

The floor is the region's plan with everything movable moved: a saved activation is on
the device from its first backward reader to its last, any other value from the op that
makes it to its last reader. Pure: reads an :class:`~.fx_trace.FxTrace`, nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from torch import fx

from ..ir.ops import MATERIALIZE
from ..ir.trace import AccessKind, StorageId
from .fx_trace import FxTrace

__all__ = ["FloorDetail", "FloorValue", "floor_detail"]

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
