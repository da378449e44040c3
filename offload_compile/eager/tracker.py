"""``ActivationTracker``: which storages the current step created, and whether they live.

The eager warmup executor sees tensors, the IR speaks of storages. The tracker gives
every storage an op *creates* during the step a :data:`StorageId` (dense, from 0, in
creation order) and forgets it when the storage dies, so that a later allocation that
happens to reuse the address never inherits the id.

Identity is the storage object: ``UntypedStorage._cdata`` while the storage lives.
Storages that existed before the step (parameters, inputs, buffers, optimizer state)
are never tracked: they are not activations, and no plan may move them.

Who holds what: the tracker follows storages through a
:class:`~hyper_offload.runtime.memory_meter.StorageLedger` (weak references only), so it
never keeps an activation alive. Liveness at the end of the step is read from the storage's own use
count (:meth:`ActivationTracker.referenced_elsewhere`), because a storage offloaded by
the warmup executor is also held by the ``ResidencyManager`` and its weak reference
would never fire.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterator

import torch

from hyper_offload.errors import ConfigurationError
from hyper_offload.passes.ir.trace import StorageId
from hyper_offload.runtime.memory_meter import StorageLedger

__all__ = ["ActivationTracker", "TrackedStorage"]


def _dead_ref() -> None:
    """Stands in for the weak reference of a storage recorded as already dead."""
    return None


class TrackedStorage:
    """One tracked storage: its id, size at creation, producing op and a weak reference."""

    __slots__ = ("sid", "nbytes", "producer", "ref", "alive")

    def __init__(self, sid: StorageId, nbytes: int, producer: int, ref: weakref.ref) -> None:
        self.sid = sid
        self.nbytes = nbytes
        self.producer = producer
        self.ref = ref
        self.alive = True

    def __repr__(self) -> str:
        state = "alive" if self.alive else "dead"
        return f"TrackedStorage({self.sid}, {self.nbytes} B, from op {self.producer}, {state})"


class ActivationTracker:
    """Storage ids for storages created during one step (see the module docstring).

    ``on_free(sid)`` is called when a tracked storage is freed (its last reference
    dropped); the warmup executor uses it to keep its resident-bytes count exact.
    """

    def __init__(self, on_free: Callable[[StorageId], None] | None = None) -> None:
        self._live: StorageLedger[TrackedStorage] = StorageLedger(self._freed)
        self._entries: dict[StorageId, TrackedStorage] = {}
        self._next_sid = 0
        # Weakly, when it is a method of the executor that owns this tracker: a strong one
        # would make a cycle that keeps the executor, its manager and every host buffer
        # alive until a garbage collection (measured: at interpreter exit, after the
        # process group was destroyed, where gloo aborts the process).
        self._on_free: Callable[[], Callable[[StorageId], None] | None] | None = (
            None if on_free is None
            else weakref.WeakMethod(on_free) if isinstance(on_free, types.MethodType)
            else (lambda: on_free)
        )

    # ------------------------------------------------------------------ queries

    def sid_of(self, storage: torch.UntypedStorage) -> StorageId | None:
        """The id of ``storage`` if the step created it and it is alive, else None."""
        entry = self._live.get(storage)
        return None if entry is None else entry.sid

    def entry(self, sid: StorageId) -> TrackedStorage:
        return self._entries[sid]

    def storage(self, sid: StorageId) -> torch.UntypedStorage | None:
        """The storage object of ``sid`` while it lives, else None."""
        entry = self._entries[sid]
        return entry.ref() if entry.alive else None

    def referenced_elsewhere(self, sid: StorageId) -> bool:
        """Whether any tensor (a user variable, autograd's saved tensors, a view) still
        points at ``sid``'s storage. The storage's Python object counts once however many
        Python references it has, so a use count above one means a tensor holds it."""
        storage = self.storage(sid)
        if storage is None:
            return False
        return torch._C._storage_Use_Count(storage._cdata) > 1

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[TrackedStorage]:
        return iter(list(self._entries.values()))

    def sizes(self) -> dict[StorageId, int]:
        return {sid: e.nbytes for sid, e in self._entries.items()}

    # ------------------------------------------------------------------ updates

    def adopt(self, storage: torch.UntypedStorage, producer: int) -> StorageId:
        """Start tracking ``storage`` (created by op ``producer``); returns its new id."""
        tracked = self._live.get(storage)
        if tracked is not None:
            raise ConfigurationError(
                f"ActivationTracker.adopt: storage already tracked as "
                f"{tracked.sid}; look it up with sid_of() first"
            )
        return self.adopt_as(storage, self._next_sid, storage.nbytes(), producer)

    def adopt_as(
        self, storage: torch.UntypedStorage, sid: StorageId, nbytes: int, producer: int
    ) -> StorageId:
        """Track ``storage`` under a given id (continuing a step another executor began);
        later fresh ids start above it."""
        if sid in self._entries:
            raise ConfigurationError(f"ActivationTracker.adopt_as: storage id {sid} is already in use")
        entry = TrackedStorage(sid, nbytes, producer, _dead_ref)  # type: ignore[arg-type]
        entry.ref = self._live.add(storage, entry)
        self._entries[sid] = entry
        self._next_sid = max(self._next_sid, sid + 1)
        return sid

    def add_dead(self, sid: StorageId, nbytes: int, producer: int) -> None:
        """Record a storage of the step that no longer lives (its size stays in the trace)."""
        if sid in self._entries:
            raise ConfigurationError(f"ActivationTracker.add_dead: storage id {sid} is already in use")
        entry = TrackedStorage(sid, nbytes, producer, _dead_ref)  # type: ignore[arg-type]
        entry.alive = False
        self._entries[sid] = entry
        self._next_sid = max(self._next_sid, sid + 1)

    def add_virtual(self, nbytes: int, producer: int) -> StorageId:
        """A new id for bytes no storage of the step holds for the session (an opaque
        region's own saved activations): sized, never alive; returns the id."""
        sid = self._next_sid
        self.add_dead(sid, nbytes, producer)
        return sid

    def grow(self, sid: StorageId, nbytes: int) -> None:
        """Record that ``sid`` grew (an op resized it); sizes are the maximum seen."""
        entry = self._entries[sid]
        entry.nbytes = max(entry.nbytes, nbytes)

    def clear(self) -> None:
        """Forget everything (between steps); pending weakref callbacks become no-ops."""
        for entry in self._entries.values():
            entry.alive = False
        self._live.clear()
        self._entries = {}
        self._next_sid = 0

    def _freed(self, entry: TrackedStorage) -> None:
        """A tracked storage died (the ledger's callback)."""
        if not entry.alive:
            return
        entry.alive = False
        on_free = self._on_free() if self._on_free is not None else None
        if on_free is not None:
            on_free(entry.sid)
