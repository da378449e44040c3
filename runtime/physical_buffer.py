"""``PhysicalBuffer``: where the bytes of one storage are, and the copies between them.

The state machine of the HyperOffload design::

    (device_buffer, device_event)  <-->  (host_buffer, host_event)

* ``device_buffer`` is the storage's own ``torch.UntypedStorage``. Releasing device memory
  *shrinks that storage to zero bytes* (``resize_(0)``) and reloading grows it back
  (``resize_(nbytes)``) and copies the bytes in. The storage *object* never changes, so
  every tensor and view that points at it (autograd's saved tensors, a compiled
  graph's keepalive) sees the data again after a reload, and
  nothing but that one storage ever holds the device bytes: after ``release_device`` the
  bytes are really returned to the allocator even while callers still hold tensors.
  The price: between release and reload those tensors have no bytes behind them and
  must not be read (a kernel reading them may crash); the eager executor guarantees this
  by resolving every use through :meth:`PhysicalBuffer.device_storage`, which pages the
  bytes back in first. Identity is the storage object (``_cdata``), not ``data_ptr()``,
  which changes on every reload.
* ``host_buffer`` is a uint8 buffer from the :class:`PinnedMemoryPool` holding a full
  byte copy (``nbytes`` = the storage's size; copies are byte-wise, hence bit-exact for
  every dtype, NaN payloads included).
* ``host_event`` is the D2H :class:`Transfer` that filled the host buffer; ``device_event``
  the H2D that fills the device storage.

Event rules (section 5.3 of the design), each enforced here:

1. An H2D is ordered after the D2H that filled its host buffer (``after=host_event``).
2. The device bytes are not handed back to the allocator while a D2H still reads them:
   the D2H is issued with ``free_before_wait=True`` (RELEASE_DEVICE usually follows it
   before any stream wait), so on CUDA the engine ``record_stream``-s them on the copy
   stream; where that is unavailable ``release_device`` orders the stream that will
   reuse the bytes after the D2H (a stream wait, never a host block).
3. ``release_device`` never frees bytes an H2D is still writing: if the compute stream
   already waited for the H2D (WAIT_H2D) nothing is needed; otherwise the stream that
   allocated them is made to wait for the H2D first (again a stream wait).
4. The host buffer goes back to the pool with an event covering *every* transfer that
   touched it (the D2H and all H2Ds reading it); the pool reuses it only after that.
5. Failures roll back: a failed copy leaves no transfer in flight, returns any buffer it
   took, keeps the copy that is still valid, and raises :class:`TransferFailedError`
   saying which copy that is.
6. The disk tier (:mod:`.disk_store`): :meth:`PhysicalBuffer.spill_to_disk` writes the
   host copy to a file once its D2H is done and gives the host buffer back (reused only
   once the write is done); :meth:`~PhysicalBuffer.load_from_disk` reads it into a fresh
   pool buffer; an H2D from that buffer first waits (the host blocks) for the read;
   :meth:`~PhysicalBuffer.release_disk` removes the file after the reads queued before it.
   An offloaded storage whose copy is on disk is in state ``HOST`` (off the device, data
   kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from hyper_offload.errors import DataLostError, ResidencyMisuseError, TransferFailedError

from .transfer import Transfer, TransferEngine
from .disk_store import DiskIO, DiskStore
from .pinned_pool import PinnedMemoryPool
from .verify import checksum, require_checksum

__all__ = ["AllDone", "BufferState", "PhysicalBuffer", "TensorLayout", "byte_view"]


class BufferState(str, Enum):
    DEVICE = "DEVICE"
    """Bytes on the device only."""
    DEVICE_AND_HOST = "DEVICE_AND_HOST"
    """Bytes on the device and a host copy (in flight or complete)."""
    HOST = "HOST"
    """Offloaded: the device storage is zero bytes, the host copy (or its disk copy) is
    the data."""
    RELEASED = "RELEASED"
    """Neither copy exists any more (both released on purpose)."""

    def __repr__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TensorLayout:
    """How the bound tensor viewed its storage, so it can be rebuilt after a reload."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorLayout:
        return TensorLayout(
            tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()
        )


class AllDone:
    """Completion event of a group of transfers (and disk writes), for the pool's
    pending list (a host buffer released with it is reused only once every one of them
    completed; the pool blocks on :meth:`synchronize` at its cap)."""

    def __init__(self, transfers: Sequence[Transfer | DiskIO]) -> None:
        self._transfers = list(transfers)

    def query(self) -> bool:
        self._transfers = [t for t in self._transfers if not t.query()]
        return not self._transfers

    def synchronize(self) -> None:
        for transfer in self._transfers:
            transfer.synchronize()
        self._transfers = []


def byte_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over the first ``nbytes`` bytes of ``storage``."""
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return flat.set_(storage, 0, (nbytes,), (1,))


class PhysicalBuffer:
    """Residency of one storage; see the module docstring for the model and the rules.

    Methods validate first and change nothing when they raise
    :class:`ResidencyMisuseError`. ``label`` names the storage in every message.
    """

    def __init__(
        self,
        tensor: torch.Tensor,
        engine: TransferEngine,
        pool: PinnedMemoryPool,
        *,
        label: str = "storage",
        verify: bool = False,
    ) -> None:
        storage = tensor.untyped_storage()
        if tensor.device.type == "meta":
            raise ResidencyMisuseError(
                f"bind({label}): a meta tensor has no bytes to offload; bind real tensors only"
            )
        if not storage.resizable():
            raise ResidencyMisuseError(
                f"bind({label}): the storage is not resizable (memory borrowed from numpy, "
                "DLPack or a foreign buffer), so its device bytes cannot be released in place; "
                "bind a tensor that owns its memory (e.g. tensor.clone())"
            )
        self.label = label
        self.storage = storage
        self.nbytes = storage.nbytes()
        self.device = storage.device
        self.layout = TensorLayout.of(tensor)
        self._engine = engine
        self._pool = pool
        self._on_device = True
        self.host_buffer: torch.Tensor | None = None
        self.host_event: Transfer | None = None
        self.device_event: Transfer | None = None
        self._host_readers: list[Transfer] = []  # H2Ds that read host_buffer
        self.verify = verify
        """Checksum what leaves the device and check it where it is freed and reloaded
        (:mod:`.verify`)."""
        self._sent: torch.Tensor | None = None  # checksum of the bytes the last D2H read
        self._reload_unchecked = False
        self._disk: tuple[DiskStore, object] | None = None  # (store, key) of the disk copy
        self._disk_read: DiskIO | None = None  # the read filling host_buffer, if any

    # ------------------------------------------------------------------ state

    @property
    def state(self) -> BufferState:
        has_host = self.host_buffer is not None or self._disk is not None
        if self._on_device:
            return BufferState.DEVICE_AND_HOST if has_host else BufferState.DEVICE
        return BufferState.HOST if has_host else BufferState.RELEASED

    @property
    def device_buffer(self) -> torch.UntypedStorage | None:
        """The storage while it holds the bytes, else None (the design's ``device_buffer``).
        An H2D may still be filling it: use :meth:`device_storage` to read it."""
        return self.storage if self._on_device else None

    @property
    def is_resident(self) -> bool:
        """Whether the device storage holds the bytes (an H2D may still be filling it)."""
        return self._on_device

    @property
    def has_host_copy(self) -> bool:
        return self.host_buffer is not None

    @property
    def on_disk(self) -> bool:
        """Whether a disk copy (a file of the disk tier) exists."""
        return self._disk is not None

    def referenced(self) -> bool:
        """Whether anything but this buffer and its copies in flight holds the storage (a
        tensor, a view, autograd's saved tensors): False means nothing can read the bytes
        any more, so dropping the last copy of them loses nothing."""
        key = self.storage._cdata
        own = 1 + sum(t.references(key) for t in self.pending_transfers())
        return torch._C._storage_Use_Count(key) > own

    def pending_transfers(self) -> list[Transfer]:
        """Transfers touching this buffer that have not completed, oldest first."""
        seen: list[Transfer] = []
        for transfer in (self.host_event, *self._host_readers, self.device_event):
            if transfer is not None and transfer not in seen and not transfer.query():
                seen.append(transfer)
        return seen

    # ------------------------------------------------------------------ transitions

    def start_d2h(self) -> Transfer:
        """Start copying the device bytes into a host buffer (reusing the current one if
        the storage is copied again after a write)."""
        if not self._on_device:
            raise ResidencyMisuseError(
                f"copy_d2h({self.label}): the bytes are not on the device (state "
                f"{self.state.value}); a D2H needs a device copy: issue copy_h2d first, or "
                "drop this COPY_D2H"
            )
        if self.storage.nbytes() != self.nbytes:
            raise ResidencyMisuseError(
                f"copy_d2h({self.label}): the storage was resized outside the manager "
                f"({self.nbytes} B at bind, {self.storage.nbytes()} B now); re-bind it after "
                "resizing"
            )
        if self.host_buffer is not None and self.host_buffer.numel() < self.nbytes:
            self.release_host()  # a stale copy from before the storage grew (adopt_resize)
        reuse = self.host_buffer is not None
        host = self.host_buffer if reuse else self._pool.acquire(self.nbytes)
        # Same copy stream keeps these in order anyway; naming them makes the rule explicit
        # (and binding for an engine that copies on more than one stream).
        earlier = (self.device_event, self.host_event, *self._host_readers)
        after = [t for t in earlier if t is not None]
        device_bytes = byte_view(self.storage, self.nbytes)
        # on the compute stream, right where the copy stream will wait before reading
        sent = checksum(device_bytes) if self.verify else None
        try:
            transfer = self._engine.d2h(
                device_bytes, host[: self.nbytes], after=after, free_before_wait=True
            )
        except Exception as exc:
            self._quiesce_engine()
            self._pool.release(host)
            self.host_buffer, self.host_event, self._host_readers = None, None, []
            dropped = (
                " The previous host copy was partly overwritten and is discarded." if reuse else ""
            )
            raise TransferFailedError(
                f"copy_d2h({self.label}) failed: {exc}. The device copy is intact and still "
                f"resident; no host copy exists now.{dropped} Fix the cause and copy_d2h again"
            ) from exc
        self.host_buffer = host
        self.host_event = transfer
        self._host_readers = []
        self._sent = sent
        return transfer

    def release_device(self) -> None:
        """Return the device bytes to the allocator (the storage shrinks to 0 bytes)."""
        if not self._on_device:
            raise ResidencyMisuseError(
                f"release_device({self.label}): the device bytes were already released (state "
                f"{self.state.value}); each RELEASE_DEVICE must follow a residency (bind or "
                "copy_h2d)"
            )
        if self._sent is not None and (self.host_buffer is not None or self._disk is not None):
            self._check("write after copy", "the device bytes changed after their D2H was "
                        "issued, so the host copy holds older or torn bytes")
        # No host block on either path: the stream that reuses the bytes is ordered
        # after the copy instead (a no-op once WAIT_H2D ran or the D2H was recorded).
        for transfer in (self.device_event, self.host_event):
            if transfer is not None and not transfer.query():
                transfer.order_before_free()
        self.storage.resize_(0)
        self._on_device = False
        self.device_event = None

    def start_h2d(self) -> Transfer:
        """Re-allocate the device storage and start filling it from the host copy."""
        if self._on_device:
            raise ResidencyMisuseError(
                f"copy_h2d({self.label}): the bytes are already on the device (state "
                f"{self.state.value}); prefetch only after release_device"
            )
        if self.host_buffer is None:
            raise ResidencyMisuseError(
                f"copy_h2d({self.label}): there is no host copy to load (state "
                f"{self.state.value}: never copied to host, or its host copy was released); an "
                "H2D must follow a COPY_D2H and precede the RELEASE_HOST"
            )
        self._wait_for_read()
        try:
            self.storage.resize_(self.nbytes)
        except Exception as exc:
            raise TransferFailedError(
                f"copy_h2d({self.label}) could not allocate {self.nbytes} device bytes: {exc}. "
                "The host copy is intact; the storage stays offloaded. Free device memory and retry"
            ) from exc
        after = [self.host_event] if self.host_event is not None else []
        try:
            device_bytes = byte_view(self.storage, self.nbytes)
            transfer = self._engine.h2d(self.host_buffer[: self.nbytes], device_bytes, after=after)
        except Exception as exc:
            self._quiesce_engine()
            self.storage.resize_(0)  # never leave half-written device bytes visible
            raise TransferFailedError(
                f"copy_h2d({self.label}) failed: {exc}. The host copy is intact; the device "
                "storage was released again, so nothing reads partial data. Retry copy_h2d"
            ) from exc
        self._on_device = True
        self.device_event = transfer
        self._host_readers = [t for t in self._host_readers if not t.query()] + [transfer]
        self._reload_unchecked = self._sent is not None
        return transfer

    def wait_device(self) -> None:
        """Make the current compute stream wait for the H2D filling the storage (if any);
        under ``verify`` the reload is then checked, once, before anything reads it."""
        if self.device_event is not None:
            self.device_event.wait()
        if self._reload_unchecked:
            self.check_reload()

    @property
    def reload_unchecked(self) -> bool:
        """``verify``: a reload was issued and not yet checked."""
        return self._reload_unchecked

    def check_reload(self) -> None:
        """``verify``: the reloaded bytes must be those the D2H read. Called after the
        wait (on the compute stream, so it reads what an op would read)."""
        self._reload_unchecked = False
        self._check("reload", "the reloaded bytes differ from those the D2H read")

    def _check(self, check: str, what: str) -> None:
        assert self._sent is not None
        require_checksum(byte_view(self.storage, self.nbytes), self._sent, check,
                         f"{self.label}, {self.nbytes} B on {self.device}", what)

    def release_host(self) -> None:
        """Return the host buffer to the pool once every transfer touching it completed."""
        if self.host_buffer is None:
            raise ResidencyMisuseError(
                f"release_host({self.label}): there is no host copy (state {self.state.value}: "
                "never copied, copy failed, or released already); each RELEASE_HOST needs one "
                "COPY_D2H"
            )
        touching = (self.host_event, *self._host_readers, self._disk_read)
        pending = [t for t in touching if t is not None and not t.query()]
        self._pool.release(self.host_buffer, AllDone(pending) if pending else None)
        self.host_buffer, self.host_event, self._host_readers = None, None, []
        self._disk_read = None

    # ------------------------------------------------------------------ the disk tier

    def spill_to_disk(self, store: DiskStore, key: object) -> DiskIO:
        """Write the host copy to a file of ``store`` once its D2H is done, and give the
        host buffer back (the pool reuses it once the write and any H2D reading it are
        done). The disk copy is then the data (with the device copy, if any)."""
        if self.host_buffer is None or self._disk is not None:
            raise ResidencyMisuseError(
                f"spill_to_disk({self.label}): "
                + ("there is no host copy to write (state " f"{self.state.value}); a "
                   "SPILL_TO_DISK follows a COPY_D2H" if self.host_buffer is None else
                   "a disk copy exists already; release_disk it first")
            )
        d2h = self.host_event
        ready = None if d2h is None or d2h.event is None or d2h.query() else d2h.event.synchronize
        write = store.write(key, self.host_buffer, self.nbytes, ready=ready)
        readers = [t for t in (*self._host_readers, self._disk_read) if t is not None and not t.query()]
        self._pool.release(self.host_buffer, AllDone([write, *readers]))
        self.host_buffer, self.host_event, self._host_readers = None, None, []
        self._disk_read = None
        self._disk = (store, key)
        return write

    def load_from_disk(self) -> DiskIO:
        """Take a host buffer from the pool and start reading the disk copy into it; the
        next :meth:`start_h2d` waits for the read."""
        if self._disk is None or self.host_buffer is not None:
            raise ResidencyMisuseError(
                f"load_from_disk({self.label}): "
                + ("there is no disk copy (state " f"{self.state.value}); a LOAD_FROM_DISK "
                   "follows a SPILL_TO_DISK" if self._disk is None else
                   "the host copy is there already; drop the LOAD_FROM_DISK")
            )
        store, key = self._disk
        host = self._pool.acquire(self.nbytes)
        try:
            read = store.read(key, host, self.nbytes)
        except Exception:
            self._pool.release(host)
            raise
        self.host_buffer, self.host_event, self._host_readers = host, None, []
        self._disk_read = read
        return read

    def release_disk(self) -> None:
        """Remove the disk copy's file (after the reads queued before it)."""
        if self._disk is None:
            raise ResidencyMisuseError(
                f"release_disk({self.label}): there is no disk copy (state {self.state.value}); "
                "each RELEASE_DISK needs one SPILL_TO_DISK"
            )
        store, key = self._disk
        self._disk = None
        store.remove(key)

    def _wait_for_read(self) -> None:
        """Block the host until the disk read filling the host buffer is done (the rule
        that orders a load before its reload); a failed read gives the buffer back and
        raises, the disk copy stays."""
        read, self._disk_read = self._disk_read, None
        if read is None:
            return
        try:
            read.synchronize()
        except TransferFailedError:
            assert self.host_buffer is not None
            self._pool.release(self.host_buffer)
            self.host_buffer = None
            raise

    def adopt_resize(self) -> None:
        """An op resized the device storage (an in-place op that grows its output,
        ``resize_``, an ``out=`` argument of another size): manage it at its new size. A
        host copy, stale since that write, stays until its RELEASE_HOST (a next D2H
        replaces a host buffer too small for the new size). Only while on the device."""
        if not self._on_device:
            raise ResidencyMisuseError(
                f"adopt_resize({self.label}): the bytes are not on the device (state "
                f"{self.state.value}), so no op can have resized them"
            )
        self.nbytes = self.storage.nbytes()

    # ------------------------------------------------------------------ access

    def device_storage(self) -> torch.UntypedStorage:
        """The device-resident storage, ready for the current compute stream.

        Waits (stream-wise) for a pending H2D. If the bytes are only on the host they are
        demand-paged back (the fallback path: correct, not overlapped, since the copy
        starts only now) and the compute stream waits for that load; the host never
        blocks.
        """
        if self._on_device:
            self.wait_device()
            return self.storage
        if self.host_buffer is None and self._disk is not None:
            self.load_from_disk()
        if self.host_buffer is not None:
            self.start_h2d()
            self.wait_device()
            return self.storage
        raise DataLostError(
            f"device_storage({self.label}): both the device and the host copy were released "
            "(and no disk copy exists); "
            "the schedule freed this storage before its last use (check it with check_schedule)"
        )

    def device_tensor(self) -> torch.Tensor:
        """A fresh view with the bound tensor's dtype/size/stride/offset over
        :meth:`device_storage`."""
        storage = self.device_storage()
        layout = self.layout
        return torch.empty(0, dtype=layout.dtype, device=self.device).set_(
            storage, layout.storage_offset, layout.size, layout.stride
        )

    def synchronize(self) -> None:
        """Block until every transfer touching this buffer has completed (and a disk
        read into its host buffer: whether it failed is for the H2D to say)."""
        for transfer in self.pending_transfers():
            transfer.synchronize()
        if self._disk_read is not None:
            self._disk_read.wait()

    def _quiesce_engine(self) -> None:
        # After a failed enqueue we cannot know what reached the copy stream; draining it
        # guarantees nothing still reads or writes the buffers we are about to give back.
        self._engine.synchronize()

    def __repr__(self) -> str:
        return f"PhysicalBuffer({self.label}, {self.nbytes} B, {self.device}, {self.state.value})"
