"""The record of one compiled region's trace: :class:`FxTrace`, an :class:`ActivationTrace`
plus how it maps back onto the forward and backward graphs, and the queries the planner,
the lowering and the reports ask of it (what may move, what stays, what an op holds, the
trace at other sizes, the region as the step model sees it).

:func:`.graph_trace.build_fx_trace` builds it; this module only reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..analysis.liveness import resident_bytes_without_offload
from ..ir.schedule import ResidencySchedule
from ..ir.trace import FORWARD_GRAPH, ActivationTrace, StorageId
from ..plan.step.model import RegionFloor
from .saved import SavedActivation

__all__ = ["FxTrace"]


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
    filling), for reports of what an op itself needs (:mod:`.floor_detail`)."""

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
