"""Which saved activations of a compiled region may leave the device, and why not.

A forward saves tensors for the backward; most of a Transformer's are *views* (the q/k/v
selects of the qkv projection, reshapes of linear outputs, ``getitem``s of multi-output
ops), whose bytes belong to a storage that the forward does not save as itself. The unit
that moves is therefore the storage, not the tensor: a storage is **movable** when

* an op of the forward created it (parameters, inputs and their views are not
  activations), or it is a graph input the caller named an *activation* (the compile
  backend's step scope: a block's input, the residual stream, which the block saves for
  its norm's backward) that the forward never writes; and no model output aliases it
  (those outlive the step anyway), so after its last forward use only saved tensors (and,
  for an input, the caller until it moves on) reach it;
* its *base*, the tensor the creating op returned, covers it densely (offset 0, every
  byte once), so one copy of the base is a byte-for-byte copy of the storage;
* every saved tensor on it can be rebuilt on the reloaded base as the *same tensor* in
  everything the backward can observe (:class:`TensorProperties`: dtype, sizes,
  strides, storage offset, conjugate and negative bits). The backward rebuilds it with
  view ops only (:func:`rebuild_steps`): a dtype other than the base's reinterprets the
  bytes (``view(dtype)`` of the flat storage), a layout other than the base's is an
  ``as_strided``, and the bits are set again with ``_conj`` / ``_neg_view`` (a copy of
  the base carries neither: AOTAutograd saves ``_conj(freqs)`` for a complex multiply's
  backward, and a reload without the bit silently conjugates the gradient). A
  reinterpretation or re-layout needs concrete sizes; what cannot be rebuilt keeps its
  storage on the device with a reason, never reloads as another tensor.

Aliasing is read from the op schemas' alias annotations (:mod:`.graph_trace` propagates a
storage through every op whose result aliases an argument: ``view``, ``transpose``,
``permute``, ``select``, ``slice``, ``split``/``unbind`` + ``getitem``, ``expand``,
``detach``, ``as_strided``, ``t``, ...), never from a list of op names. So non-dense,
overlapping and 0-stride (``expand``) views, views of views and several views of one
storage all move, the storage once. When a storage is kept, every saved tensor on it
says why (:attr:`SavedActivation.reason`).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import fx

from ..ir.ops import dense_layout
from ..ir.properties import TensorProperties
from ..ir.trace import StorageId
from .cost_model import tensor_bytes
from .sizes import planning_size

__all__ = [
    "RebuildStep",
    "SavedActivation",
    "StorageBase",
    "TensorProperties",
    "classify_saved",
    "rebuild_steps",
    "same_layout",
    "view_layout",
]


@dataclass(frozen=True)
class SavedActivation:
    """A tensor the forward saves for the backward.

    ``name`` is the forward node (and the backward placeholder of the same name);
    ``nbytes`` the tensor's own bytes (a view's may be less than its storage's).
    ``offloadable`` is False with a ``reason`` when its storage stays on the device;
    ``storage`` is None when it is not an activation (a parameter or input, or a view of
    one). ``base`` names the forward node holding the storage's base tensor (what the
    lowering copies), for an offloadable one.
    """

    name: str
    storage: StorageId | None
    nbytes: int
    offloadable: bool
    reason: str
    base: str | None = None
    properties: TensorProperties | None = None
    """What the backward observes of it (the forward node's fake value): a reload must
    hand its readers a tensor with exactly these (:mod:`.lowering_check` checks it)."""

    def __repr__(self) -> str:
        where = "offloadable" if self.offloadable else f"kept: {self.reason}"
        via = f" via {self.base}" if self.base not in (None, self.name) else ""
        return f"Saved({self.name} s{self.storage} {self.nbytes}B{via}, {where})"


class StorageBase(NamedTuple):
    """Where a storage was created: the forward op node and which of its results."""

    node: str
    leaf: int
    value: Any


class ViewLayout(NamedTuple):
    size: tuple[Any, ...]
    stride: tuple[Any, ...]
    offset: Any


def view_layout(tensor: torch.Tensor) -> ViewLayout:
    """Sizes, strides and storage offset: what ``as_strided`` needs to rebuild ``tensor``."""
    return ViewLayout(tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view their storage identically (so no rebuild is needed).

    Symbolic sizes compare without adding a guard: only what is known to be equal is."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    left, right = view_layout(a), view_layout(b)
    flat_left = (*left.size, *left.stride, left.offset)
    flat_right = (*right.size, *right.stride, right.offset)
    return len(left.size) == len(right.size) and all(
        x == y if isinstance(x, int) and isinstance(y, int) else statically_known_true(x == y)
        for x, y in zip(flat_left, flat_right)
    )


def _properties(value: Any) -> TensorProperties | None:
    if isinstance(value, torch.Tensor) and value.layout is torch.strided:
        return TensorProperties.of(value)
    return None


def _concrete(layout: ViewLayout) -> bool:
    values = (*layout.size, *layout.stride, layout.offset)
    return all(isinstance(v, int) for v in values)


def _dense(value: torch.Tensor) -> bool:
    return value.layout is torch.strided and tuple(value.stride()) == dense_layout(value)[1]


def base_node(nodes: Mapping[str, fx.Node], base: StorageBase) -> fx.Node | None:
    """The forward node (of ``nodes``, by name) whose value is the storage's base
    tensor, if the graph has one."""
    creator = nodes.get(base.node)
    if creator is None:
        return None
    if isinstance(creator.meta.get("val"), torch.Tensor):
        return creator if base.leaf == 0 else None
    for user in creator.users:
        if user.target is operator.getitem and user.args[1] == base.leaf:
            return user
    return None


def _storage_reason(
    sid: StorageId | None,
    *,
    sizes: Mapping[StorageId, int],
    bases: Mapping[StorageId, StorageBase],
    model_outputs: set[StorageId],
    base: fx.Node | None,
    pinned: Mapping[StorageId, str],
) -> str:
    """Why no saved tensor on ``sid`` can move ("" when the storage is movable)."""
    if sid is None:
        return "a parameter or input (or a view of one)"
    if sid in pinned:
        return pinned[sid]
    if sid in model_outputs:
        return "its storage is also a model output"
    if sizes[sid] == 0:
        return "its storage holds no bytes"
    if sid not in bases or base is None:
        return "no forward node holds the base tensor of its storage"
    value = bases[sid].value
    where = f"fw:{base.name}"
    covers = (planning_size(value.storage_offset(), where) == 0
              and tensor_bytes(value, where) == sizes[sid])
    if not (covers and _dense(value)):
        return (
            f"the base of its storage ({base.name}, size {tuple(value.shape)}, stride "
            f"{tuple(value.stride())}) does not cover the storage densely, so no single "
            "copy restores it byte for byte"
        )
    if value.is_conj() or value.is_neg():
        # An op's fresh output never carries a bit; a graph input may (a region handed
        # b.conj() after a graph break). A copy resolves the bit into the values, and no
        # view op of the reload restores the storage's own bytes.
        return (
            f"the base of its storage ({base.name}) is a "
            f"{'conjugate' if value.is_conj() else 'negative'} view: a copy would resolve "
            "the bit into its values, and no view of the reload restores the storage"
        )
    return ""


def _view_reason(value: torch.Tensor, base_value: torch.Tensor) -> str:
    """Why this saved tensor cannot be rebuilt on the reloaded base ("" when it can)."""
    layout = view_layout(value)
    if value.dtype != base_value.dtype:
        if not (_concrete(layout) and isinstance(base_value.numel(), int)):
            return (
                f"a view as {value.dtype} of a {base_value.dtype} storage with symbolic sizes "
                "(dynamic shapes): the backward could not reinterpret it; compile with "
                "dynamic=False to move it"
            )
        if (base_value.numel() * base_value.element_size()) % value.element_size():
            return (
                f"it views its storage as {value.dtype}, whose {value.element_size()}-byte "
                f"elements do not tile the storage's bytes"
            )
    elif not same_layout(value, base_value) and not _concrete(layout):
        return (
            "a view with symbolic sizes or strides (dynamic shapes): the backward could "
            "not rebuild it; compile with dynamic=False to move it"
        )
    return ""


class RebuildStep(NamedTuple):
    """One view op of a saved tensor's rebuild: ``target(previous, *args)``."""

    target: torch._ops.OpOverload
    args: tuple[Any, ...]


def rebuild_steps(value: torch.Tensor, base_value: torch.Tensor) -> tuple[RebuildStep, ...]:
    """The view ops that turn the reloaded base (a dense copy of ``base_value``, offset 0,
    no conjugate or negative bit) into ``value`` with all its :class:`TensorProperties`;
    empty when the base itself is what the readers need. Only for a saved tensor whose
    ``_view_reason`` is "" (concrete sizes wherever a re-layout is needed)."""
    aten = torch.ops.aten
    steps: list[RebuildStep] = []
    reinterpret = value.dtype != base_value.dtype
    if reinterpret:  # the storage's bytes, flat, then as value's dtype
        steps.append(RebuildStep(aten.as_strided.default, ([base_value.numel()], [1], 0)))
        steps.append(RebuildStep(aten.view.dtype, (value.dtype,)))
    if reinterpret or not same_layout(value, base_value):
        layout = view_layout(value)
        steps.append(RebuildStep(
            aten.as_strided.default, (list(layout.size), list(layout.stride), layout.offset)
        ))
    if value.is_conj():
        steps.append(RebuildStep(aten._conj.default, ()))
    if value.is_neg():
        steps.append(RebuildStep(aten._neg_view.default, ()))
    return tuple(steps)


def _storage_verdicts(
    sid: StorageId | None,
    nodes: Sequence[fx.Node],
    base: fx.Node | None,
    *,
    sizes: Mapping[StorageId, int],
    bases: Mapping[StorageId, StorageBase],
    model_outputs: set[StorageId],
    pinned: Mapping[StorageId, str],
) -> dict[str, str]:
    """Reason each saved node on ``sid`` stays ("" for all of them when it moves). A
    storage moves whole or not at all: one view that cannot be rebuilt keeps them all."""
    reason = _storage_reason(
        sid, sizes=sizes, bases=bases, model_outputs=model_outputs, base=base, pinned=pinned
    )
    if reason:
        return {node.name: reason for node in nodes}
    assert sid is not None
    views = {node.name: _view_reason(node.meta["val"], bases[sid].value) for node in nodes}
    blocked = next(((name, why) for name, why in views.items() if why), None)
    if blocked is None:
        return views
    sibling = f"shares its storage with {blocked[0]}, which is kept: {blocked[1]}"
    return {name: why or sibling for name, why in views.items()}


def classify_saved(
    fw: fx.Graph,
    saved_nodes: Sequence[fx.Node],
    *,
    storage_of: Mapping[str, StorageId | None],
    sizes: Mapping[StorageId, int],
    bases: Mapping[StorageId, StorageBase],
    model_outputs: set[StorageId],
    pinned: Mapping[StorageId, str] | None = None,
) -> list[SavedActivation]:
    """One :class:`SavedActivation` per saved node, in order, by the rules of the module
    docstring. ``storage_of`` maps forward node names to their storage; ``bases`` says
    which op (or, for a movable graph input, which placeholder) created each storage;
    ``pinned`` keeps storages on the device with a reason (a graph input written in
    place)."""
    pinned = pinned or {}
    by_storage: dict[StorageId | None, list[fx.Node]] = {}
    for node in saved_nodes:
        by_storage.setdefault(storage_of.get(node.name), []).append(node)
    fw_nodes = {n.name: n for n in fw.nodes}
    reasons: dict[str, str] = {}
    base_names: dict[str, str] = {}
    for sid, nodes in by_storage.items():
        base = base_node(fw_nodes, bases[sid]) if sid in bases else None
        verdicts = _storage_verdicts(
            sid, nodes, base, sizes=sizes, bases=bases, model_outputs=model_outputs,
            pinned=pinned,
        )
        reasons.update(verdicts)
        if base is not None and not any(verdicts.values()):
            base_names.update({node.name: base.name for node in nodes})
    return [
        SavedActivation(
            node.name, storage_of.get(node.name), tensor_bytes(node.meta["val"], f"fw:{node.name}"),
            not reasons[node.name], reasons[node.name], base_names.get(node.name),
            _properties(node.meta["val"]),
        )
        for node in saved_nodes
    ]
