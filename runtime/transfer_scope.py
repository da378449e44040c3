"""How a transfer op finds its :class:`~.transfer_context.TransferRuntime`, with no
module-level mutable state: the block it runs in, or the tensor it is given.

* **The current block.** ``copy_d2h`` uses the runtime of the innermost ``with runtime``
  (or ``with runtime.keeping(...)``) block: a :class:`TransferScope` held by a
  :class:`contextvars.ContextVar`, so threads that do not inherit the context see none.
  The scope also says which ``copy_d2h`` slots the block keeps on the device
  (:func:`current_keep`) and names the block and its copies for ``verify``'s errors.
* **The storage link.** Every tensor a runtime creates (host copies, H2D destinations,
  kept copies) carries a weak reference to it on its storage (:func:`link_runtime`), and
  the other ops follow that link first (:func:`linked_runtime`), so a backward needs no
  ``with`` block: it may run on the autograd engine's device thread, from a graph served
  by a compile cache, long after the forward's block closed (a retained graph's second
  backward).

This module does not know the runtime's class (that module imports this one): a scope
and a link hold their runtime as it was given, and
:func:`~.transfer_context.current_transfer_runtime` and
:func:`~.transfer_context.runtime_of` return it as a ``TransferRuntime``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Mapping
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from hyper_offload.errors import TransferMisuseError

from .transfer_records import describe

__all__ = [
    "RUNTIME_LINK",
    "TransferScope",
    "current_keep",
    "current_scope",
    "enter_scope",
    "leave_scope",
    "link_runtime",
    "linked_runtime",
]

RuntimeT = TypeVar("RuntimeT")


@dataclass(frozen=True, eq=False)
class TransferScope(Generic[RuntimeT]):
    """One ``with runtime`` block (compared by identity): the transfers it started are
    drained at its exit. ``keep``: the ``copy_d2h`` slots this block keeps on the device
    (:meth:`~.transfer_context.TransferRuntime.keeping`); ``where`` and ``slot_names``
    name the block and its copies in ``verify``'s errors."""

    runtime: RuntimeT
    keep: frozenset[int] = frozenset()
    where: str = ""
    slot_names: Mapping[int, str] = dataclasses.field(default_factory=dict)

    def origin(self, slot: int) -> str:
        """Where the ``copy_d2h`` of ``slot`` ran, for ``verify``'s errors."""
        name = self.slot_names.get(slot, f"slot {slot}" if slot >= 0 else "")
        return ", ".join(part for part in (self.where, f"copy_d2h {name}".strip()) if part)


_CURRENT: ContextVar[TransferScope[Any] | None] = ContextVar(
    "hyper_offload_transfer_runtime", default=None)


def current_scope() -> TransferScope[Any] | None:
    """The innermost block entered in this context (None: none)."""
    return _CURRENT.get()


def enter_scope(scope: TransferScope[Any]) -> Token[TransferScope[Any] | None]:
    """Make ``scope`` the current block; the token undoes it (:func:`leave_scope`)."""
    return _CURRENT.set(scope)


def leave_scope(token: Token[TransferScope[Any] | None]) -> TransferScope[Any] | None:
    """Make the block current again that was before ``token``'s; returns the block that
    was current until now."""
    scope = _CURRENT.get()
    _CURRENT.reset(token)
    return scope


def current_keep(slot: int) -> bool:
    """Whether the current block keeps ``copy_d2h`` slot ``slot`` on the device
    (``TransferRuntime.keeping``)."""
    scope = _CURRENT.get()
    return scope is not None and slot in scope.keep


RUNTIME_LINK = "_hyper_offload_runtime"
"""Attribute, on the storage of every tensor a runtime creates, holding a weak reference
to that runtime (torch keeps a storage's Python object, and so its attributes, for as
long as the storage lives, whichever tensor object reaches it)."""


def link_runtime(storage: torch.UntypedStorage, runtime: object) -> None:
    """Link ``storage`` to ``runtime`` (weakly: the link does not keep it alive)."""
    setattr(storage, RUNTIME_LINK, weakref.ref(runtime))


def linked_runtime(op: str, tensors: Iterable[torch.Tensor | None]) -> Any:
    """The runtime linked from the first of ``tensors`` that has a link; None if none
    has. Raises naming ``op`` if that runtime no longer exists."""
    for tensor in tensors:
        if tensor is None:
            continue
        link = getattr(tensor.untyped_storage(), RUNTIME_LINK, None)
        if link is None:
            continue
        runtime = link()
        if runtime is None:
            raise TransferMisuseError(
                f"{op}: {describe(tensor)} was made by a TransferRuntime that no longer "
                "exists. Rule: a runtime outlives the graphs that use its host copies. "
                "Fix: keep the runtime (the compiled model's backend) alive until their "
                "backward has run"
            )
        return runtime
    return None
