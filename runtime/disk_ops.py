"""The disk tier of a :class:`~.transfer_context.TransferRuntime`: what the compile door's
``spill_to_disk`` / ``load_from_disk`` / ``release_disk`` ops do (declared in
:mod:`hyper_offload.passes.ir.ops`, lowered by :mod:`hyper_offload.passes.fx.lowering`)::

    host   = copy_d2h(act, dim_order, s)          # forward
    handle = spill_to_disk(host)                  # the host buffer goes to a file
    ...                                           # the forward returns handle, not host
    host2  = load_from_disk(handle, size, stride, dtype)   # backward: a fresh host copy
    release_disk(handle, after=host2)             # the file goes once read
    dev    = copy_h2d(host2, device)              # waits for the read first
    ...
    release_host(host2, after=dev)                # host2's buffer back to the pool now
    hold([host2])                                 # the graph's end (forward: hold([host]))

A *handle* is a one-element ``int64`` CPU tensor naming the file; the forward returns it
in place of the host copy, so between forward and backward a spilled activation holds
16 bytes of host memory. Its file is removed by ``release_disk`` or, at the latest, when
the handle dies (a forward whose backward never ran, a backward that raised: the
autograd graph that held it is gone), without blocking: see
:meth:`~.disk_store.DiskStore.discard`. A handle's file is read once: a retained graph's
second backward finds it released and says so.

Both ``host`` (after its spill) and ``host2`` (after its ``release_host``) are tensors over
pool memory that the pool may hand out again; the graphs hold them to their end so that
the inner compiler, which reuses a buffer once its last reader ran, never writes into
that memory (Inductor on a CPU model did: a reload differed from its D2H).

A host copy the runtime kept on the device (a step plan's slot, or no host room:
``keep_on_device``) spills nothing: its handle stands for the device copy, and the load
hands that copy back.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hyper_offload.errors import TransferMisuseError

from .disk_store import DiskStore
from .transfer_records import HostCopy, TransferRecords, link_runtime

__all__ = ["DiskTransfers"]


class _Runtime(Protocol):
    """What this module needs of a ``TransferRuntime`` (no import: it imports us)."""

    def adopt_host_copy(self, buffer: torch.Tensor, nbytes: int, dtype: torch.dtype,
                        shape: tuple[int, ...], stride: tuple[int, ...], read: Any,
                        like: HostCopy) -> torch.Tensor: ...


@dataclass(eq=False)
class _Spilled:
    """One handle's state: its file's key in the store (or the kept device copy)."""

    nbytes: int
    record: Any = None
    """The spilled host copy's record (``verify``'s checksum travels with the bytes)."""
    kept: torch.Tensor | None = None
    released: bool = False


class DiskTransfers:
    """The disk tier's ops on ``runtime`` (whose host copies ``records`` holds) with
    ``store`` (module docstring)."""

    def __init__(self, runtime: _Runtime, records: TransferRecords, store: DiskStore) -> None:
        self._runtime = weakref.ref(runtime)  # the runtime owns us
        self._records = records
        self.store = store
        self._lock = threading.Lock()
        self._spilled: dict[int, _Spilled] = {}
        self._keys = itertools.count()
        self.bytes_to_disk = 0
        self.bytes_from_disk = 0

    def spill(self, host: torch.Tensor) -> torch.Tensor:
        """Write host copy ``host`` to a file (after its D2H), give its buffer back to the
        pool once written; return the handle."""
        runtime = self._owner()
        key = next(self._keys)
        pool = self._records.pool
        if self._records.is_kept(host):
            spilled = _Spilled(0, kept=host)
        else:
            buffer, record = self._records.take_host_buffer(host)
            nbytes = host.numel() * host.element_size()
            d2h = record.d2h
            ready = None if d2h.event is None or d2h.query() else d2h.event.synchronize
            try:
                write = self.store.write(key, buffer, nbytes, ready=ready)
            except BaseException:
                pool.release(buffer, d2h)
                raise
            pool.release(buffer, write)  # reused once on disk; the pool waits at its cap
            spilled = _Spilled(nbytes, record)
            self.bytes_to_disk += nbytes
        handle = torch.full((1,), key, dtype=torch.int64)
        storage = handle.untyped_storage()
        link_runtime(storage, runtime)
        weakref.finalize(storage, self._handle_died(key))
        with self._lock:
            self._spilled[key] = spilled
        return handle

    def load(self, handle: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
        """A fresh host copy laid out as ``shape``/``stride``, filled from ``handle``'s
        file by a read its first ``copy_h2d`` waits for (the kept device copy, for a
        handle that stands for one)."""
        key, spilled = self._spilled_of("load_from_disk", handle)
        if spilled.kept is not None:
            return spilled.kept
        runtime = self._owner()
        buffer = self._records.pool.acquire(spilled.nbytes)
        try:
            read = self.store.read(key, buffer, spilled.nbytes)
        except BaseException:
            self._records.pool.release(buffer)
            raise
        self.bytes_from_disk += spilled.nbytes
        return runtime.adopt_host_copy(buffer, spilled.nbytes, dtype, tuple(shape),
                                       tuple(stride), read, spilled.record)

    def release(self, handle: torch.Tensor) -> None:
        """Remove ``handle``'s file (after the read queued before it)."""
        key, spilled = self._spilled_of("release_disk", handle)
        spilled.released = True
        if spilled.kept is None:
            self.store.remove(key)

    # ------------------------------------------------------------------ internals

    def _owner(self) -> _Runtime:
        runtime = self._runtime()
        if runtime is None:  # pragma: no cover - the runtime holds us
            raise TransferMisuseError("disk tier: its TransferRuntime no longer exists")
        return runtime

    def _spilled_of(self, op: str, handle: torch.Tensor) -> tuple[int, _Spilled]:
        key = int(handle.reshape(-1)[0])
        with self._lock:
            spilled = self._spilled.get(key)
        if spilled is None or spilled.released:
            raise TransferMisuseError(
                f"hyper_offload::{op}: the disk tier's file of this saved activation "
                + ("was released after it was read (a retained graph's second backward?). "
                   "Rule: a spilled activation is read back once. Fix: no retain_graph=True "
                   "with max_disk_activation_mb, or no disk tier"
                   if spilled is not None else "is unknown to this runtime (a handle of "
                   "another runtime?). Fix: pass the handle spill_to_disk returned")
            )
        return key, spilled

    def _handle_died(self, key: int) -> Callable[[], None]:
        spilled, store = self._spilled, self.store

        def died() -> None:
            # Any thread, any moment (a garbage collection, maybe while this thread holds
            # a lock of ours): no lock, non-blocking calls only (dict.pop is atomic).
            entry = spilled.pop(key, None)
            if entry is not None and entry.kept is None and not entry.released:
                store.discard(key)

        return died
