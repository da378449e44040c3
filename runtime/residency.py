"""``ResidencyManager``: the schedule's actions, executed on storages keyed by id.

The manager is the runtime half of a :class:`~hyper_offload.passes.ir.schedule.ResidencySchedule`:
each action kind maps to one method (``COPY_D2H`` → :meth:`~ResidencyManager.copy_d2h`,
``RELEASE_DEVICE`` → :meth:`~ResidencyManager.release_device`, ``COPY_H2D`` →
:meth:`~ResidencyManager.copy_h2d`, ``WAIT_H2D`` → :meth:`~ResidencyManager.wait_h2d`,
``RELEASE_HOST`` → :meth:`~ResidencyManager.release_host`, and the disk tier's
``SPILL_TO_DISK`` / ``LOAD_FROM_DISK`` / ``RELEASE_DISK`` →
:meth:`~ResidencyManager.spill_to_disk` / :meth:`~ResidencyManager.load_from_disk` /
:meth:`~ResidencyManager.release_disk` on the manager's :class:`~.disk_store.DiskStore`;
:meth:`~ResidencyManager.apply` dispatches a ``ResidencyAction``). It never decides *what*
to move; it does what it is told, or refuses with an error naming the storage, the broken
rule and the fix.

Storage ids are the trace's ``StorageId`` (plain ints chosen by the caller). Each id maps
to one :class:`PhysicalBuffer` over the bound tensor's ``UntypedStorage``; releasing
device memory shrinks that storage to zero bytes so the allocator really gets the bytes
back, and a reload grows the *same* storage again, so tensors held elsewhere see the
data again bit for bit (see :mod:`~hyper_offload.runtime.physical_buffer`).

The manager holds each bound storage object (not a second copy of its bytes) until
:meth:`~ResidencyManager.unbind` or :meth:`~ResidencyManager.reset`, so an offloaded storage
survives even if no tensor points at it any more.

Failure behaviour: misuse raises :class:`ResidencyMisuseError` before anything changes; a
failed copy raises :class:`~hyper_offload.errors.TransferFailedError` after rolling back (no
transfer in flight, no pool buffer leaked, the surviving copy named).
:meth:`~ResidencyManager.reset` is the exception-path cleanup: it drains every transfer,
pages offloaded storages back so that no tensor is left pointing at missing bytes, returns
every host buffer to the pool and removes every file of the disk tier.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hyper_offload.errors import DataLostError, ResidencyMisuseError
from hyper_offload.passes.ir.schedule import ActionKind, ResidencyAction
from hyper_offload.passes.ir.trace import StorageId

from .transfer import Transfer, TransferEngine
from .disk_store import DiskIO, DiskStore
from .physical_buffer import BufferState, PhysicalBuffer
from .pinned_pool import PinnedMemoryPool
from .stats import RuntimeStats, runtime_stats

__all__ = ["ResidencyManager"]


class ResidencyManager:
    """Physical residency of bound storages; see the module docstring."""

    def __init__(
        self, engine: TransferEngine, pool: PinnedMemoryPool, *, verify: bool = False,
        disk: DiskStore | None = None,
    ) -> None:
        self.engine = engine
        self.pool = pool
        self.disk = disk
        """The disk tier's files (None: no disk tier; a disk action then raises)."""
        self.verify = verify
        """Every storage bound from now on checks its copies (:mod:`.verify`)."""
        self._buffers: dict[StorageId, PhysicalBuffer] = {}
        self._sid_of_storage: dict[int, StorageId] = {}  # UntypedStorage._cdata -> sid
        self._in_flight: list[Transfer] = []

    # ------------------------------------------------------------------ binding

    def bind(self, sid: StorageId, tensor: torch.Tensor) -> PhysicalBuffer:
        """Manage the storage of ``tensor`` under ``sid``; it starts device-resident."""
        if isinstance(sid, bool) or not isinstance(sid, int):
            raise ResidencyMisuseError(
                f"bind({sid!r}): storage ids are ints (the trace's StorageId)"
            )
        if not isinstance(tensor, torch.Tensor):
            raise ResidencyMisuseError(
                f"bind({sid}): expected a torch.Tensor, got {type(tensor).__name__}"
            )
        if sid in self._buffers:
            raise ResidencyMisuseError(
                f"bind({sid}): storage id {sid} is already bound ({self._buffers[sid]!r}); "
                "each id is bound once per step: unbind it or reset() the manager first"
            )
        key = tensor.untyped_storage()._cdata
        if key in self._sid_of_storage:
            other = self._sid_of_storage[key]
            raise ResidencyMisuseError(
                f"bind({sid}): this tensor's storage is already bound as storage {other}; views "
                "share a storage, so bind the storage once and reuse its id"
            )
        buffer = PhysicalBuffer(tensor, self.engine, self.pool, label=f"storage {sid}",
                                verify=self.verify)
        self._buffers[sid] = buffer
        self._sid_of_storage[key] = sid
        return buffer

    def unbind(self, sid: StorageId, *, synchronize: bool = True) -> None:
        """Forget ``sid``: wait for its transfers, return its host buffer. The device
        storage is left as it is; an offloaded storage (only a host copy) is refused.

        ``synchronize=False`` skips the host wait (the normal path of a pipeline swap,
        where the compute stream already waited for the load): it needs the storage
        resident with no host copy left, and its transfers stay tracked in flight (the
        engine protects their device bytes, the pool's release gate their host bytes).
        """
        buffer = self.buffer(sid, action="unbind")
        if buffer.state is BufferState.HOST:
            raise ResidencyMisuseError(
                f"unbind({sid}): storage {sid} is offloaded and its only copy is on the host; "
                "unbinding would drop the data silently: copy_h2d it first, or release_host to "
                "drop it on purpose"
            )
        if synchronize:
            buffer.synchronize()
        elif buffer.has_host_copy:
            raise ResidencyMisuseError(
                f"unbind({sid}, synchronize=False): storage {sid} still has a host copy; "
                "release_host it first (the pool then waits for its copies), or unbind with "
                "synchronize=True"
            )
        if buffer.has_host_copy:
            buffer.release_host()
        if buffer.on_disk:
            buffer.release_disk()
        del self._buffers[sid]
        del self._sid_of_storage[buffer.storage._cdata]
        self._prune_in_flight()

    # ------------------------------------------------------------------ actions

    def copy_d2h(self, sid: StorageId) -> Transfer:
        """``COPY_D2H``: start copying the storage to a host buffer from the pool."""
        return self._track(self.buffer(sid, action="copy_d2h").start_d2h())

    def adopt_resize(self, sid: StorageId) -> int:
        """An op resized storage ``sid`` on the device: manage it at its new size
        (:meth:`PhysicalBuffer.adopt_resize`). Returns the change in bytes."""
        buffer = self.buffer(sid, action="adopt_resize")
        before = buffer.nbytes
        buffer.adopt_resize()
        return buffer.nbytes - before

    def release_device(self, sid: StorageId) -> None:
        """``RELEASE_DEVICE``: give the device bytes back to the allocator now."""
        self.buffer(sid, action="release_device").release_device()
        self._prune_in_flight()

    def copy_h2d(self, sid: StorageId) -> Transfer:
        """``COPY_H2D``: re-allocate the storage and start loading it from its host copy
        (ordered after the D2H that filled the host buffer)."""
        return self._track(self.buffer(sid, action="copy_h2d").start_h2d())

    def wait_h2d(self, sid: StorageId) -> None:
        """``WAIT_H2D``: make the compute stream wait for the storage's pending H2D."""
        buffer = self.buffer(sid, action="wait_h2d")
        if not buffer.is_resident:
            raise ResidencyMisuseError(
                f"wait_h2d({sid}): storage {sid} is not being loaded (state {buffer.state.value}); "
                "a WAIT_H2D must follow the COPY_H2D of the same storage"
            )
        buffer.wait_device()

    def release_host(self, sid: StorageId) -> None:
        """``RELEASE_HOST``: return the host buffer to the pool (reused only after every
        transfer that touched it has completed)."""
        self.buffer(sid, action="release_host").release_host()

    def spill_to_disk(self, sid: StorageId) -> DiskIO:
        """``SPILL_TO_DISK``: write the host copy to a file, give the host buffer back."""
        return self.buffer(sid, action="spill_to_disk").spill_to_disk(self._store(sid), sid)

    def load_from_disk(self, sid: StorageId) -> DiskIO:
        """``LOAD_FROM_DISK``: read the disk copy into a host buffer (its H2D waits)."""
        return self.buffer(sid, action="load_from_disk").load_from_disk()

    def release_disk(self, sid: StorageId) -> None:
        """``RELEASE_DISK``: remove the disk copy's file."""
        self.buffer(sid, action="release_disk").release_disk()

    def _store(self, sid: StorageId) -> DiskStore:
        if self.disk is None:
            raise ResidencyMisuseError(
                f"spill_to_disk({sid}): this manager has no disk tier; make the schedule "
                "without one, or set OffloadConfig.max_disk_activation_mb and disk_dir"
            )
        return self.disk

    def apply(self, action: ResidencyAction) -> Transfer | None:
        """Run one schedule action; returns the transfer it started, if any."""
        kind, sid = action.kind, action.storage
        if kind is ActionKind.COPY_D2H:
            return self.copy_d2h(sid)
        if kind is ActionKind.COPY_H2D:
            return self.copy_h2d(sid)
        if kind is ActionKind.RELEASE_DEVICE:
            self.release_device(sid)
        elif kind is ActionKind.WAIT_H2D:
            self.wait_h2d(sid)
        elif kind is ActionKind.RELEASE_HOST:
            self.release_host(sid)
        elif kind is ActionKind.SPILL_TO_DISK:
            self.spill_to_disk(sid)
        elif kind is ActionKind.LOAD_FROM_DISK:
            self.load_from_disk(sid)
        elif kind is ActionKind.RELEASE_DISK:
            self.release_disk(sid)
        else:  # pragma: no cover - ActionKind is closed; guards against a future kind
            raise ResidencyMisuseError(f"apply({action!r}): unknown action kind {kind!r}")
        return None

    # ------------------------------------------------------------------ transfers

    def wait_for_transfers(self) -> None:
        """Make the current compute stream wait for every transfer in flight (normal exit:
        nothing after this point can observe a half-done copy)."""
        for transfer in self._in_flight:
            transfer.wait()
        self._prune_in_flight()

    def sync_all_transfers(self) -> None:
        """Block the host until every transfer in flight completed (exception path)."""
        self.engine.synchronize()
        for transfer in self._in_flight:
            transfer.synchronize()
        self._in_flight.clear()

    def stats(self) -> RuntimeStats:
        """Host syncs of the engine, the pool's figures (pageable fallbacks included) and
        the transfers in flight."""
        return runtime_stats([self.engine.host_syncs], self.pool.stats(), self.transfers_in_flight())

    def transfers_in_flight(self) -> int:
        self._prune_in_flight()
        return len(self._in_flight)

    def reset(self, *, restore_offloaded: bool = True) -> None:
        """Drain all transfers, return every host buffer, forget every binding.

        With ``restore_offloaded`` (the default) a storage that lives only on the host is
        paged back first, so no tensor is left pointing at missing bytes. Storages whose
        load fails are named in a :class:`DataLostError` raised *after* the cleanup
        finished. With ``restore_offloaded=False`` offloaded storages stay at zero bytes.
        Every file of the disk tier is removed (after the storages on disk are paged back).
        Storages the schedule released on purpose (both copies gone: state ``RELEASED``,
        a dead activation after its last use) are not an error and also stay at zero
        bytes. Tensors over zero-byte storages must not be read again.
        """
        self.sync_all_transfers()
        lost: list[str] = []
        try:
            for sid, buffer in self._buffers.items():
                if restore_offloaded and buffer.state is BufferState.HOST:
                    try:
                        buffer.device_storage()
                    except Exception as exc:  # keep cleaning up; report below
                        lost.append(f"storage {sid}: {exc}")
                buffer.synchronize()
                if buffer.has_host_copy:
                    buffer.release_host()
                if buffer.on_disk:
                    buffer.release_disk()
        finally:
            # Every file goes, whatever failed above (an interrupt included).
            if self.disk is not None:
                self.disk.clear()
        self._buffers.clear()
        self._sid_of_storage.clear()
        self._in_flight.clear()
        if lost:
            raise DataLostError(
                "reset(): could not page these offloaded storages back; their tensors have no "
                "bytes and must not be used: " + "; ".join(lost)
            )

    # ------------------------------------------------------------------ accessors

    def buffer(self, sid: StorageId, *, action: str = "buffer") -> PhysicalBuffer:
        """The :class:`PhysicalBuffer` of ``sid``; raises naming ``action`` if unknown."""
        try:
            return self._buffers[sid]
        except KeyError:
            bound = sorted(self._buffers)
            shown = ", ".join(map(str, bound[:10])) + (" ..." if len(bound) > 10 else "")
            raise ResidencyMisuseError(
                f"{action}({sid}): storage id {sid} is not bound (bound: [{shown}]); bind(sid, "
                "tensor) must come before any action on it"
            ) from None

    def device_storage(self, sid: StorageId) -> torch.UntypedStorage:
        """The device-resident storage of ``sid`` (demand-paged from host if needed)."""
        return self.buffer(sid, action="device_storage").device_storage()

    def device_tensor(self, sid: StorageId) -> torch.Tensor:
        """A view shaped like the bound tensor over the device-resident storage."""
        return self.buffer(sid, action="device_tensor").device_tensor()

    def is_resident(self, sid: StorageId) -> bool:
        return self.buffer(sid, action="is_resident").is_resident

    def has_host_copy(self, sid: StorageId) -> bool:
        return self.buffer(sid, action="has_host_copy").has_host_copy

    def state(self, sid: StorageId) -> BufferState:
        return self.buffer(sid, action="state").state

    def resident_bytes(self) -> int:
        """Bytes of bound storages currently on the device (by the manager's bookkeeping;
        tests prove real frees with storage sizes, not with this)."""
        return sum(b.nbytes for b in self._buffers.values() if b.is_resident)

    def on_disk(self, sid: StorageId) -> bool:
        return self.buffer(sid, action="on_disk").on_disk

    def host_bytes(self) -> int:
        """Bytes of bound storages that have a host copy."""
        return sum(b.nbytes for b in self._buffers.values() if b.has_host_copy)

    def __contains__(self, sid: object) -> bool:
        return sid in self._buffers

    def __len__(self) -> int:
        return len(self._buffers)

    def __iter__(self) -> Iterator[StorageId]:
        return iter(list(self._buffers))

    def __repr__(self) -> str:
        in_flight = self.transfers_in_flight()
        return (
            f"ResidencyManager({self.engine!r}, {len(self)} storages, {in_flight} in flight, "
            f"{self.engine.host_syncs.total} host syncs, "
            f"{self.pool.stats().pageable_fallbacks} pageable fallbacks)"
        )

    # ------------------------------------------------------------------ internals

    def _track(self, transfer: Transfer) -> Transfer:
        self._prune_in_flight()
        if not transfer.query():
            self._in_flight.append(transfer)
        return transfer

    def _prune_in_flight(self) -> None:
        self._in_flight = [t for t in self._in_flight if not t.query()]
