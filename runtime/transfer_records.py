"""What a :class:`~.transfer_context.TransferRuntime` keeps outside its class: the records
of what its ops did, and how an op finds the runtime.

**The records**: the host copies it made, the transfers started and not yet waited, and
the copies it kept on the device, each keyed by its storage and dropped when that
storage dies.

State machine of one host copy (keyed by its storage)::

    copy_d2h ─► FILLING ─wait_transfer─► VALID ─release_host─► RELEASED
                 └── copy_h2d allowed from FILLING, VALID and RELEASED ──┘

Keys and deaths: a record's key is the id of its storage's Python object, which torch
keeps for as long as the storage lives, so the key is unique for the record's lifetime.
A storage's death reaches the records through a weak-reference callback, which may run
inside any code (a garbage collection), the runtime's own included: the callback only
appends to a queue, and :meth:`TransferRecords.collect_locked` applies the queue under the
runtime's lock before any record is read (a key that already names a newer record is
left alone).

**How a transfer op finds its runtime**, with no module-level mutable state: the block it
runs in, or the tensor it is given.

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
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar, Token
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, TypeVar

import torch

from hyper_offload.errors import TransferMisuseError
from hyper_offload.passes.ir.properties import TensorProperties

from .physical_buffer import AllDone
from .pinned_pool import PinnedMemoryPool
from .transfer import Transfer
from .verify import dense_bytes, require_checksum, require_properties

__all__ = [
    "HostCopy",
    "HostCopyState",
    "PendingTransfer",
    "RUNTIME_LINK",
    "TransferRecords",
    "TransferScope",
    "current_keep",
    "current_scope",
    "describe",
    "enter_scope",
    "leave_scope",
    "link_runtime",
    "linked_runtime",
    "storage_key",
]


class HostCopyState(str, Enum):
    FILLING = "FILLING"  # D2H started, not yet waited
    VALID = "VALID"  # D2H waited: the host copy may be prefetched any number of times
    RELEASED = "RELEASED"  # the program's last use passed; readable while referenced

    def __repr__(self) -> str:
        return self.value


def describe(tensor: torch.Tensor) -> str:
    """``tensor``'s sizes, dtype and device, as the runtime's errors name it."""
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} on {tensor.device}"


def storage_key(tensor: torch.Tensor) -> int:
    """The key of ``tensor``'s storage in the records (module docstring)."""
    return id(tensor.untyped_storage())


@dataclass(eq=False)
class HostCopy:
    """One host copy made by ``copy_d2h``: its state, the D2H that fills it (a prefetch
    is ordered after it) and the weak reference whose callback returns its buffer."""

    state: HostCopyState
    d2h: Transfer
    lifetime: weakref.ref[torch.UntypedStorage]
    """To the copy's storage; its death ends the record (and returns the buffer)."""
    sent: torch.Tensor | None = None
    """``verify``: the checksum of the bytes the D2H copies (None when unverified)."""
    origin: str = ""
    """Where the D2H was issued (door, region, copy), for ``verify``'s errors."""
    sent_properties: TensorProperties | None = None
    """``verify``: what left (its dtype, sizes and bits) in the host copy's layout: what
    a reload must be."""
    holder: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """The pool buffer, until the copy's death (or a spill,
    :meth:`TransferRecords.take_host_buffer`) gives it back: whoever pops it returns it,
    exactly once."""
    read: Any = None
    """A disk read filling the buffer (:mod:`.disk_ops`); the first H2D waits for it."""
    readers: list[Transfer] = dataclasses.field(default_factory=list)
    """The H2Ds started from this copy (a buffer given back waits for them)."""
    loaded: bool = False
    """Read back from disk: ``release_host`` gives its buffer back at once (no second
    backward can read it: its file is gone)."""


@dataclass(eq=False)
class PendingTransfer:
    """A started transfer whose ``wait_transfer`` has not run yet.

    A D2H holds its source and host copy (``keep``): both live until the wait whatever
    the caller drops, and ``copy_d2h`` runs only inside a block, whose exit drains it. An
    H2D holds neither: it runs in a backward, outside any block, and one whose
    destination died unwaited (a backward that raised) must not keep its device tensor
    or host copy from being freed; its handle keeps the host side alive until it
    completes, which is all the bytes need.
    """

    op: str
    transfer: Transfer
    label: str
    source: weakref.ref[torch.UntypedStorage]
    lifetime: weakref.ref[torch.UntypedStorage]
    """To the destination's storage; its death (unwaited) ends the record."""
    host_key: int
    scope: object | None
    """The ``with`` block of this runtime that started it (compared by identity: its exit
    drains it); None for a transfer started outside one."""
    keep: tuple[torch.Tensor, ...]
    expect: torch.Tensor | None = None
    """``verify``: the checksum the destination must have once waited (None: unchecked)."""
    origin: str = ""
    expect_properties: TensorProperties | None = None
    """``verify``, an H2D: the properties its destination must have."""

    def check(self, data: torch.Tensor) -> None:
        """``verify``: after this transfer's wait, ``data`` (a D2H's source, which the
        graph frees next; an H2D's destination, which ops read next) must still hold, or
        now hold, the bytes the D2H copied; raises
        :class:`~hyper_offload.errors.TransferIntegrityError` otherwise."""
        assert self.expect is not None
        layout = self.keep[1] if self.op == "copy_d2h" else data
        found = dense_bytes(data, tuple(layout.shape), tuple(layout.stride()))
        subject = f"{describe(data)} ({data.numel() * data.element_size()} B)"
        if self.op == "copy_d2h":
            require_checksum(
                found, self.expect, "write after copy", subject, "the device bytes changed "
                "after their D2H was issued, so the host copy holds older or torn bytes",
                self.origin,
            )
        else:
            where = f"{self.origin}, reloaded by copy_h2d" if self.origin else "copy_h2d"
            if self.expect_properties is not None:
                require_properties(data, self.expect_properties, subject, where)
            require_checksum(
                found, self.expect, "reload", subject,
                "the reloaded bytes differ from those the D2H read", where,
            )


class TransferRecords:
    """The host copies, pending transfers and kept copies of one runtime (module
    docstring). ``lock`` is the runtime's: every table is read and written under it, and
    the ``*_locked`` methods expect the caller to hold it. ``pool`` takes back the buffer
    of a host copy that died."""

    def __init__(self, pool: PinnedMemoryPool, lock: threading.RLock) -> None:
        self.pool = pool
        self.lock = lock
        self.pending: dict[int, PendingTransfer] = {}
        self.hosts: dict[int, HostCopy] = {}
        self.kept: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        """Kept copies (``keep_on_device``) by storage; the record is the weak reference."""
        self.unobserved: list[Transfer] = []
        """Transfers not yet seen complete: until then each one's handle holds its host
        side, so :meth:`collect` must look at them for a dead host copy to die."""
        # Keys whose storage died, appended by weakref callbacks (which may run inside
        # any code, the runtime's included) and applied under the lock by collect_locked.
        self._dead: deque[tuple[dict[int, Any], int, weakref.ref[Any]]] = deque()

    def collect(self) -> None:
        """Apply the deaths the callbacks reported and observe completed copies, so that
        a host copy whose last holder is a finished copy's handle dies now (one event
        query per copy not yet seen complete)."""
        with self.lock:
            self.collect_locked()
            transfers, self.unobserved = self.unobserved, []
        # Outside the lock: a completion drops references, which may run finalizers.
        running = [transfer for transfer in transfers if not transfer.query()]
        with self.lock:
            self.unobserved.extend(running)

    def collect_locked(self) -> None:
        """Drop the records whose storage died (the caller holds the lock)."""
        while self._dead:
            table, key, ref = self._dead.popleft()
            record = table.get(key)
            # The key may already name a newer record (ids are reused once a storage dies);
            # a kept copy's record is its weak reference itself.
            lifetime = record if isinstance(record, weakref.ref) else getattr(record, "lifetime", None)
            if record is not None and lifetime is ref:
                del table[key]

    def on_death(self, table: dict[int, Any], key: int) -> Callable[[Any], None]:
        """The weakref callback that ends record ``key`` of ``table`` (``pending`` or
        ``kept``) when its storage dies."""
        dead = self._dead
        return lambda ref: dead.append((table, key, ref))

    def on_host_death(self, key: int, holder: list[torch.Tensor]) -> Callable[[Any], None]:
        """The weakref callback of host copy ``key``: its buffer (if ``holder`` still
        has it) goes back to the pool, and its record ends."""
        pool, dead, hosts = self.pool, self._dead, self.hosts

        def died(ref: weakref.ref[torch.UntypedStorage]) -> None:
            # May run inside any code, also while this thread holds the pool's or this
            # runtime's lock: only non-blocking calls here (list.pop is atomic).
            if holder:
                pool.release_soon(holder.pop())
            dead.append((hosts, key, ref))

        return died

    def host_record(self, op: str, host: torch.Tensor) -> HostCopy:
        """The record of host copy ``host``; raises naming ``op`` if there is none (the
        caller holds the lock)."""
        record = self.hosts.get(storage_key(host))
        if record is None:
            raise TransferMisuseError(
                f"{op}: {describe(host)} is not a host copy made by copy_d2h in this "
                "TransferRuntime. Rule: only tensors returned by copy_d2h are host copies. "
                "Fix: pass the result of copy_d2h (after its wait_transfer)"
            )
        return record

    def drain(self, scope: object | None) -> list[PendingTransfer]:
        """Synchronize and forget the unwaited transfers started in ``scope``; returns
        them. A drained D2H's host copy is complete, hence VALID."""
        with self.lock:
            self.collect_locked()
            keys = [key for key, p in self.pending.items() if p.scope is scope]
            leftover = [self.pending.pop(key) for key in keys]
        for pending in leftover:
            pending.transfer.synchronize()  # nothing stays in flight past this point
        with self.lock:
            for pending in leftover:
                record = self.hosts.get(pending.host_key)
                if pending.op == "copy_d2h" and record is not None:
                    record.state = HostCopyState.VALID
        return leftover

    def is_kept(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a kept copy (``keep_on_device``) recorded here."""
        with self.lock:
            self.collect_locked()
            ref = self.kept.get(storage_key(tensor))
            return ref is not None and ref() is tensor.untyped_storage()

    def take_pending(self, tensor: torch.Tensor, keepalive: torch.Tensor | None) -> PendingTransfer:
        """The transfer into ``tensor``, no longer pending: its ``wait_transfer`` runs.
        Raises unless one is pending and ``keepalive`` (if given) is its source."""
        key = storage_key(tensor)
        with self.lock:
            self.collect_locked()
            pending = self.pending.get(key)
            if pending is None:
                raise TransferMisuseError(
                    f"hyper_offload::wait_transfer: no transfer into {describe(tensor)} is "
                    "pending; it was never started, or was already waited. Rule: each "
                    "copy_d2h/copy_h2d result is waited exactly once. Fix: pass the tensor "
                    "returned by copy_d2h or copy_h2d, once"
                )
            if keepalive is not None and keepalive.untyped_storage() is not pending.source():
                raise TransferMisuseError(
                    f"hyper_offload::wait_transfer: keepalive {describe(keepalive)} is not "
                    f"the source of the {pending.op} into {describe(tensor)}. Rule: the "
                    "keepalive is the tensor being copied, so that it outlives the copy. "
                    "Fix: pass the argument given to the matching copy op"
                )
            del self.pending[key]
        return pending

    def release(self, host: torch.Tensor) -> None:
        """``release_host`` of host copy ``host`` (not a kept copy): RELEASED once its D2H
        was waited (again: a retained graph's second backward), else raises. A copy read
        back from disk gives its buffer back now (:meth:`give_back_host_buffer`)."""
        with self.lock:
            self.collect_locked()
            record = self.host_record("hyper_offload::release_host", host)
            if record.state is HostCopyState.FILLING:
                raise TransferMisuseError(
                    f"hyper_offload::release_host: the copy_d2h into {describe(host)} was "
                    "never waited. Rule: a host copy is released only after its D2H was "
                    "waited. Fix: call wait_transfer(host, keepalive=source) first"
                )
            record.state = HostCopyState.RELEASED
            loaded = record.loaded
        if loaded:
            self.give_back_host_buffer(host)

    def take_host_buffer(self, host: torch.Tensor) -> tuple[torch.Tensor, HostCopy]:
        """The pool buffer of host copy ``host``, taken from the copy (:mod:`.disk_ops`
        writes it to disk and gives it back to the pool itself): the copy's death no
        longer returns it. Nothing may read ``host`` afterwards."""
        with self.lock:
            self.collect_locked()
            record = self.host_record("hyper_offload::spill_to_disk", host)
            if not record.holder:
                raise TransferMisuseError(
                    f"hyper_offload::spill_to_disk: the host copy {describe(host)} was "
                    "spilled already. Rule: one spill per host copy. Fix: spill the copy_d2h "
                    "result once")
            return record.holder.pop(), record

    def give_back_host_buffer(self, host: torch.Tensor) -> None:
        """A host copy read back from disk is done with (its ``release_host``): its buffer
        returns to the pool once the copies reading it completed, not at its death (the
        file is gone, so no second backward reads it again; nothing reads ``host`` after
        its last reload)."""
        with self.lock:
            record = self.hosts.get(storage_key(host))
            if record is None or not record.holder:
                return
            buffer = record.holder.pop()
            readers = [t for t in record.readers if not t.query()]
        self.pool.release(buffer, AllDone(readers) if readers else None)


# ---------------------------------------------------------------- how an op finds its runtime

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
