"""``PackedCopy``: a swap group's storages moved as ONE packed host buffer, one copy each way.

The ``group_swap=True`` path of pipeline activation swap: instead of one D2H and one H2D
per storage, every member storage is packed into a device *staging* buffer that moves with
a single engine copy each way::

    launch_offload   staging = cat(bytes(s) for s in members)       (compute stream)
                     host    = pool.acquire(nbytes)
                     d2h     = engine.d2h(staging, host)             (copy stream)
                     s.resize_(0) for s in members (the staging buffer holds the bytes)
    wait_offload     d2h.order_before_free(); drop staging
    launch_load      staging = empty(nbytes)
                     h2d     = engine.h2d(host, staging, after=d2h)  (copy stream)
    wait_load        h2d.wait() (a stream wait); s.resize_(n_s); bytes(s) <- staging slice
                     (compute stream); drop staging; pool.release(host, gated by both copies)

States: ``IDLE → OFFLOADING → OFFLOADED → LOADING → LOADED``; :meth:`PackedCopy.abort`
leads from any state to ``CLOSED``. A step called out of order raises
:class:`~hyper_offload.errors.SwapStateError` and changes nothing. A packed copy makes one cycle.

Invariants:

* **One copy each way.** A cycle issues exactly one ``engine.d2h`` and one ``engine.h2d``
  whatever the number of members (zero when the members hold no bytes);
  ``d2h_copies``/``h2d_copies`` count them (an abort's reload counts as an H2D).
* **Cost of one copy.** The staging buffer lives only in ``OFFLOADING`` and ``LOADING``,
  in place of the members (they are freed right after the pack and grown right before
  the unpack): the level is what a per-storage swap holds, and the members and the pack
  coexist only inside ``launch_offload`` and ``wait_load`` (a transient of ``nbytes``).
* **Members are snapshotted at launch_offload**; they hold no bytes from then until
  ``wait_load`` returns and must not be read in between.
* **No reuse mid-copy, no host block.** The D2H is issued ``free_before_wait=True`` (the
  staging buffer is dropped before any stream wait): the engine ``record_stream``-s it, or
  ``order_before_free`` orders the compute stream after the copy. The staging buffer of a
  load is dropped only after the compute stream waited for the H2D. The host buffer is
  released to the pool gated by both copies, so it is reused only after they completed.
  Only :meth:`PackedCopy.abort` blocks the host (counted in ``engine.host_syncs``).
* **Lifetime.** The member storages are held strongly from construction until
  ``wait_load`` or ``abort`` returns (an offloaded storage must survive to be grown back),
  then dropped, so the bytes die with autograd's saved tensors. In ``LOADED``/``CLOSED``
  the object holds no storage, no staging buffer and no host buffer.
* Host buffers come from the pool, which labels them host memory (``label_host``): the
  live-storage meter never counts them as device bytes.
* ``verify`` (:mod:`~hyper_offload.runtime.verify`): the staging buffer's checksum is
  taken at the pack (compute stream, before the D2H reads it) and checked once the load
  was waited, before the unpack hands the bytes to the members. The members are freed
  at the pack, so no write after the copy can reach the bytes it moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import torch

from hyper_offload.errors import (
    DataLostError,
    ResidencyMisuseError,
    SwapStateError,
    TransferFailedError,
)

from ..transfer import Transfer, TransferEngine
from ..physical_buffer import AllDone, byte_view
from ..pinned_pool import PinnedMemoryPool
from ..verify import checksum, require_checksum

__all__ = ["PackState", "PackedCopy"]


class PackState(str, Enum):
    IDLE = "IDLE"
    OFFLOADING = "OFFLOADING"
    OFFLOADED = "OFFLOADED"
    LOADING = "LOADING"
    LOADED = "LOADED"
    CLOSED = "CLOSED"

    def __repr__(self) -> str:
        return self.value


# The state each step needs, and the state it leaves behind.
_TRANSITIONS = {
    "launch_offload": (PackState.IDLE, PackState.OFFLOADING),
    "wait_offload": (PackState.OFFLOADING, PackState.OFFLOADED),
    "launch_load": (PackState.OFFLOADED, PackState.LOADING),
    "wait_load": (PackState.LOADING, PackState.LOADED),
}


class PackedCopy:
    """One packed swap of ``storages``; see the module docstring for steps and rules.

    ``storages`` are packed in the given order; zero-byte storages are left out (nothing
    to move), and a storage may appear once. ``name`` prefixes every error message.
    """

    def __init__(
        self,
        name: str,
        storages: Sequence[torch.UntypedStorage],
        engine: TransferEngine,
        pool: PinnedMemoryPool,
        device: torch.device,
        *,
        verify: bool = False,
    ) -> None:
        self.name = name
        self.verify = verify
        self._sent: torch.Tensor | None = None  # checksum of the packed bytes (verify)
        self.engine = engine
        self.pool = pool
        self.device = torch.device(device)
        self.state = PackState.IDLE
        self._members: list[tuple[torch.UntypedStorage, int]] = []
        seen: set[int] = set()
        for index, storage in enumerate(storages):
            self._check_member(index, storage, seen)
            if storage.nbytes() > 0:
                self._members.append((storage, storage.nbytes()))
        self._nbytes = sum(n for _, n in self._members)
        self._staging: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._d2h: Transfer | None = None
        self._h2d: Transfer | None = None
        self._d2h_copies = 0
        self._h2d_copies = 0

    @property
    def nbytes(self) -> int:
        """Packed bytes: the sum of the member storages' sizes at construction."""
        return self._nbytes

    @property
    def host_bytes(self) -> int:
        """Capacity of the pool buffer held now (a bucket, >= ``nbytes``), else 0."""
        return 0 if self._host is None else self._host.numel()

    @property
    def d2h_copies(self) -> int:
        """Engine D2H copies issued (1 per cycle when ``nbytes`` > 0, else 0)."""
        return self._d2h_copies

    @property
    def h2d_copies(self) -> int:
        """Engine H2D copies issued (1 per cycle, or per abort's reload, when ``nbytes`` > 0)."""
        return self._h2d_copies

    @property
    def num_storages(self) -> int:
        """Member storages held now (0 once ``LOADED``/``CLOSED``)."""
        return len(self._members)

    def launch_offload(self) -> None:
        """Pack the members into a staging buffer and start its one D2H."""
        self._check("launch_offload")
        resized = [i for i, (s, n) in enumerate(self._members) if s.nbytes() != n]
        if resized:
            raise ResidencyMisuseError(
                f"{self.name}: launch_offload: member storage(s) {resized} were resized outside "
                "the packed copy since construction; build the PackedCopy after the last resize"
            )
        if self._nbytes:
            staging = torch.cat([byte_view(s, n) for s, n in self._members])
            self._sent = checksum(staging) if self.verify else None
            host = self.pool.acquire(self._nbytes)
            try:
                self._d2h = self.engine.d2h(staging, host[: self._nbytes], free_before_wait=True)
            except Exception as exc:
                self.pool.release(host)  # the engine drained its stream before raising
                raise TransferFailedError(
                    f"{self.name}: the packed D2H of {self._nbytes} B failed: {exc}. The members "
                    "are intact on the device and no host copy exists; fix the cause and retry"
                ) from exc
            self._d2h_copies += 1
            self._staging, self._host = staging, host
            # The staging buffer holds the bytes now: the members go at once, so the pack
            # replaces them instead of doubling them. Safe under a caching allocator: the
            # pack kernel that read them is queued on this (compute) stream before any reuse.
            for storage, _ in self._members:
                storage.resize_(0)
        self.state = PackState.OFFLOADING

    def wait_offload(self) -> None:
        """Free the staging buffer once the D2H no longer needs it (no host block)."""
        self._check("wait_offload")
        if self._d2h is not None:
            # A no-op when the engine record_stream-ed the staging buffer or the copy is
            # done; otherwise the compute stream (which reuses the block) waits for the D2H.
            self._d2h.order_before_free()
        self._staging = None
        self.state = PackState.OFFLOADED

    def launch_load(self) -> None:
        """Start the one H2D into a fresh staging buffer (the members grow at wait_load)."""
        self._check("launch_load")
        self._start_load()
        self.state = PackState.LOADING

    def wait_load(self) -> None:
        """Stream-wait for the H2D, unpack into the members, give the host buffer back."""
        self._check("wait_load")
        self._finish_load()
        self._members = []  # the storages now live as long as autograd keeps them
        self.state = PackState.LOADED

    def abort(self) -> None:
        """Exception path from any state: drain the copies, make every member hold its
        bytes again (a synchronous reload in ``OFFLOADED``), return the host buffer. A
        no-op in ``LOADED``/``CLOSED``; raises :class:`DataLostError` (after cleaning up)
        only when an offloaded member could not be reloaded."""
        if self.state in (PackState.LOADED, PackState.CLOSED):
            return
        lost: Exception | None = None
        try:
            if self.state is PackState.OFFLOADED:
                self._start_load()
            if self.state is PackState.OFFLOADING:
                self._unpack()  # the staging buffer still holds the bytes
            else:
                self._finish_load()
        except Exception as exc:  # keep cleaning up; report below
            lost = exc
        for transfer in (self._d2h, self._h2d):
            if transfer is not None:
                transfer.synchronize()
        self._release_host()
        self._staging = None
        self._members = []
        self.state = PackState.CLOSED
        if lost is not None:
            raise DataLostError(
                f"{self.name}: abort could not reload the offloaded members ({lost}); their "
                "tensors have no bytes and must not be used"
            ) from lost

    def _start_load(self) -> None:
        if not self._nbytes:
            return
        assert self._host is not None
        try:
            staging = torch.empty(self._nbytes, dtype=torch.uint8, device=self.device)
            after = [self._d2h] if self._d2h is not None else []
            self._h2d = self.engine.h2d(self._host[: self._nbytes], staging, after=after)
        except Exception as exc:
            raise TransferFailedError(
                f"{self.name}: the packed H2D of {self._nbytes} B could not start: {exc}. The "
                "host copy is intact and the members stay offloaded; free device memory and "
                "retry launch_load"
            ) from exc
        self._h2d_copies += 1
        self._staging = staging

    def _finish_load(self) -> None:
        if self._h2d is None:
            return
        self._h2d.wait()  # the compute stream, which runs the unpack, follows the copy
        if self._sent is not None:
            assert self._staging is not None
            require_checksum(
                self._staging, self._sent, "reload", f"{self.name}, {len(self._members)} "
                f"storages packed in {self._nbytes} B on {self.device}",
                "the reloaded bytes differ from those the D2H read",
            )
        self._unpack()
        self._release_host()

    def _unpack(self) -> None:
        """Grow the members and copy the staging buffer into them (compute stream)."""
        staging, offset = self._staging, 0
        assert staging is not None
        for storage, nbytes in self._members:
            storage.resize_(nbytes)
            byte_view(storage, nbytes).copy_(staging[offset : offset + nbytes])
            offset += nbytes
        # The unpack was queued on the compute stream, so the block may go.
        self._staging = None

    def _release_host(self) -> None:
        if self._host is None:
            return
        pending = [t for t in (self._d2h, self._h2d) if t is not None and not t.query()]
        self.pool.release(self._host, AllDone(pending) if pending else None)
        self._host = None

    def _check(self, step: str) -> None:
        need, _ = _TRANSITIONS[step]
        if self.state is not need:
            raise SwapStateError(
                f"{self.name}: packed {step} needs state {need.value}, found "
                f"{self.state.value}. Rule: launch_offload, wait_offload, launch_load, "
                "wait_load run once each, in that order; build a new PackedCopy per cycle"
            )

    def _check_member(self, index: int, storage: object, seen: set[int]) -> None:
        where = f"{self.name}: PackedCopy storage {index}"
        if not isinstance(storage, torch.UntypedStorage):
            raise ResidencyMisuseError(
                f"{where} is a {type(storage).__name__}; pass tensor.untyped_storage()"
            )
        device = self.device
        if storage.device.type != device.type or device.index not in (None, storage.device.index):
            raise ResidencyMisuseError(
                f"{where} lives on {storage.device}, the packed copy moves {self.device} "
                "bytes; group storages by device"
            )
        if not storage.resizable():
            raise ResidencyMisuseError(
                f"{where} is not resizable (borrowed memory), so its device bytes cannot be "
                "freed in place; leave it out of the group"
            )
        if storage._cdata in seen:
            raise ResidencyMisuseError(
                f"{where} was already passed (views share a storage); pass each storage once"
            )
        seen.add(storage._cdata)

    def __repr__(self) -> str:
        return (
            f"PackedCopy({self.name}, {self.state.value}, {len(self._members)} storages, "
            f"{self._nbytes} B, {self._d2h_copies} D2H / {self._h2d_copies} H2D)"
        )

