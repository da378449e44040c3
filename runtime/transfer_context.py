"""``TransferRuntime``: the state behind the ``hyper_offload::`` transfer ops.

The custom ops of :mod:`~hyper_offload.runtime.ops` are stateless functions in a graph;
the transfers they start, the host buffers they fill and the rules they enforce live
here, in an object the caller owns and makes current for a forward pass::

    runtime = TransferRuntime(pool=PinnedMemoryPool(config.max_host_bytes))
    with runtime:
        loss = compiled_model(x)
    loss.backward()  # the backward reaches the runtime through its host copies

How an op finds its runtime (:mod:`.transfer_records`): ``copy_d2h`` uses the *current*
one, made current by ``with runtime``; the other ops follow the weak link that every
tensor a runtime creates carries on its storage, so a backward needs no ``with`` block.

Lifetime of a host copy: its pool buffer is **tied to the tensor**. ``copy_d2h`` hands
out a tensor on a storage of its own (a view of the pool buffer's bytes that keeps the
buffer alive); when the last tensor on that storage dies (the autograd graph holding
it is freed, whichever runtime or session runs next) a finalizer gives the buffer back
to the pool. No transfer can still touch it then: an in-flight copy keeps its host side
alive until it is observed complete. So a host copy is readable for exactly as long as
something can read it, and a buffer is never handed out while a stale reference to it
exists.

A host copy goes FILLING ─wait_transfer─► VALID ─release_host─► RELEASED and may be
prefetched by ``copy_h2d`` in each state (the records of host copies, pending transfers
and kept copies, and how a storage's death ends each, are :mod:`.transfer_records`).
``release_host`` marks the program's last use (the lowering places it after the last
prefetch of one backward); a retained graph's second backward prefetches and releases
the same copy again, which is why neither is an error. One transfer is started by
``copy_d2h``/``copy_h2d`` (keyed by its destination's storage) and ended by exactly
one ``wait_transfer``. Every violation raises :class:`TransferMisuseError` naming the op,
the tensor, the rule and the fix; nothing is changed by a call that raises.

``verify`` (:mod:`.verify`): while it is on, ``copy_d2h`` takes a checksum of the bytes it
copies (on the compute stream, right before the copy stream is told to read them); the
D2H's ``wait_transfer``, the last point before the graph frees the source, checks the
source again (a write after the copy was issued), and an H2D's ``wait_transfer`` checks
the reloaded bytes once the compute stream waited for them, before any op reads them. A
mismatch raises :class:`~hyper_offload.errors.TransferIntegrityError` naming the block's
``where`` (door, region) and the copy (``slot_names``). The reload's metadata is checked
too: the dtype, sizes and conjugate/negative bits of what left, in the layout of its host
copy (which the graph's rebuild of each saved view assumes; the views themselves are checked
when the graphs are lowered, ``passes.fx.lowering_check.check_reloads``).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Iterable, Mapping
from contextvars import Token
from typing import Any

import torch

from hyper_offload.errors import TransferFailedError, TransferMisuseError
from hyper_offload.passes.ir.properties import TensorProperties

from .device import resolve_device
from .transfer import Transfer, TransferDirection, TransferEngine, completed_transfer
from .disk_ops import DiskTransfers
from .disk_store import DiskStore
from .memory_meter import label_host
from .pinned_pool import PinnedMemoryPool
from .stats import RuntimeStats, runtime_stats
from .transfer_records import (
    HostCopy,
    HostCopyState,
    PendingTransfer,
    TransferRecords,
    TransferScope,
    current_scope,
    describe,
    enter_scope,
    leave_scope,
    link_runtime,
    linked_runtime,
    storage_key,
)
from .verify import checksum, dense_bytes

__all__ = ["TransferRuntime", "current_transfer_runtime", "runtime_of"]


_HOST_BUFFER = "_hyper_offload_pool_buffer"
"""Attribute, on a host copy's storage, holding its pool buffer: the bytes stay valid
for as long as any tensor on the copy lives, even past its runtime and pool."""


def current_transfer_runtime(op: str = "hyper_offload transfer op") -> TransferRuntime:
    """The runtime made current by ``with TransferRuntime(...)``; raises if there is none."""
    scope = current_scope()
    if scope is None:
        raise TransferMisuseError(
            f"{op}: no TransferRuntime is active in this context. Rule: a forward pass "
            "that offloads runs inside `with TransferRuntime(pool=...)`, which owns the "
            "copy engines and the host pool. Fix: wrap the forward pass in that block"
        )
    runtime: TransferRuntime = scope.runtime
    return runtime


def runtime_of(op: str, *tensors: torch.Tensor | None) -> TransferRuntime:
    """The runtime that created the first of ``tensors`` made by a runtime, else the
    current one (:mod:`.transfer_records`)."""
    runtime: TransferRuntime | None = linked_runtime(op, tensors)
    return current_transfer_runtime(op) if runtime is None else runtime


class TransferRuntime:
    """Copy engines, host pool and in-flight transfer records for the transfer ops.

    ``pool`` supplies host buffers; ``engines`` pre-supplies a :class:`TransferEngine` per
    device (others are created on first use). The runtime may be entered any number of
    times, also nested; state carries over. Leaving a block synchronizes the transfers
    started inside it that are still unwaited (a synchronized D2H counts as waited);
    leaving it normally with such transfers raises. Host buffers need no cleanup on any
    path: each goes back to the pool when its host copy dies.
    """

    def __init__(
        self, *, pool: PinnedMemoryPool, engines: Iterable[TransferEngine] = (),
        verify: bool = False, disk: DiskStore | None = None,
    ) -> None:
        self.pool = pool
        self._lock = threading.RLock()
        self._records = TransferRecords(pool, self._lock)
        self.disk = None if disk is None else DiskTransfers(self, self._records, disk)
        """The disk tier's ops (:mod:`.disk_ops`; None: no disk tier)."""
        self.verify = verify
        """Checksum every ``copy_d2h`` from now on and check it (module docstring); the
        copies it checksummed stay checked after it is turned off."""
        self.checks = 0
        """Checks that passed since the runtime was made (``verify``)."""
        self._engines: dict[torch.device, TransferEngine] = {e.device: e for e in engines}
        self.bytes_d2h = 0
        """Bytes copied to the host since the runtime was made (measured, monotonic)."""
        self.bytes_h2d = 0
        """Bytes copied back to a device since the runtime was made."""
        self.bytes_kept = 0
        """Bytes of ``copy_d2h`` calls that a step plan kept on the device instead."""
        self.bytes_kept_for_host = 0
        """Of ``bytes_kept``, those kept because the host budget had no room for them
        (:meth:`host_full`): a plan made without this budget (the step scope's first,
        floor step, a cached graph). Every such byte is over the device budget's plan."""
        self._tokens: list[Token[TransferScope[Any] | None]] = []

    # ------------------------------------------------------------------ context

    def __enter__(self) -> TransferRuntime:
        self._tokens.append(enter_scope(TransferScope(self)))
        return self

    def keeping(
        self, slots: frozenset[int], *, where: str = "",
        slot_names: Mapping[int, str] | None = None,
    ) -> _KeepingBlock:
        """``with runtime.keeping(slots):`` is ``with runtime:`` in which a ``copy_d2h``
        whose ``slot`` is in ``slots`` keeps a device copy of its source
        (:meth:`keep_on_device`) instead of starting a D2H: how a step plan keeps one
        invocation of a compiled graph resident while another invocation of the same
        graph offloads. ``where`` and ``slot_names`` name the block and its copies in
        ``verify``'s errors."""
        return _KeepingBlock(TransferScope(self, frozenset(slots), where, slot_names or {}))

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._exit_scope(exc_type)

    # ------------------------------------------------------------------ ops

    def engine(self, device: torch.device | str) -> TransferEngine:
        """The engine copying to and from ``device`` (created on first use)."""
        resolved = resolve_device(device)
        with self._lock:
            if resolved not in self._engines:
                self._engines[resolved] = TransferEngine(resolved)
            return self._engines[resolved]

    def copy_d2h(
        self, src: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...],
        slot: int = -1,
    ) -> torch.Tensor:
        """Start copying ``src`` into a pool buffer laid out as ``shape``/``stride`` (a
        dense layout, see ``ops.dense_layout``); returns the host tensor.

        ``wait_transfer`` on it orders the *compute stream* after the copy (what a later
        ``copy_h2d`` or a free of ``src`` needs); it does not block the host. On an
        accelerator, host code that reads the bytes directly must synchronize the device
        first (``torch.accelerator.synchronize()``)."""
        nbytes = src.numel() * src.element_size()
        engine = self.engine(src.device)
        self.collect()  # a finished copy may hold the last reference to a reusable buffer
        buffer = self.pool.acquire(nbytes)
        host = self._host_tensor(buffer, nbytes, src.dtype, shape, stride)
        # Enqueued right before the copy: the copy stream reads exactly these bytes.
        sent = checksum(dense_bytes(src, shape, stride)) if self.verify else None
        sent_properties = TensorProperties.of(src)._replace(
            stride=tuple(host.stride()), offset=0) if self.verify else None
        try:
            transfer = engine.d2h(src, host)
        except Exception as exc:
            # Drain first: a copy half-enqueued before the failure may still write the
            # buffer, and the pool would hand it to the next caller at once.
            engine.synchronize()
            self.pool.release(buffer)
            raise TransferFailedError(
                f"hyper_offload::copy_d2h of {describe(src)} failed; the device tensor is "
                "untouched and still the valid copy, the host buffer went back to the pool"
            ) from exc
        key = storage_key(host)
        storage = host.untyped_storage()
        with self._lock:
            self._records.collect_locked()
            scope = current_scope()
            origin = scope.origin(slot) if scope is not None else ""
            holder = [buffer]
            self._records.hosts[key] = HostCopy(
                HostCopyState.FILLING, transfer,
                weakref.ref(storage, self._records.on_host_death(key, holder)), sent, origin,
                sent_properties, holder,
            )
            self._records.pending[key] = self._new_pending(
                "copy_d2h", transfer, src, host, key, keep=(src, host), expect=sent,
                origin=origin,
            )
            self._records.unobserved.append(transfer)
            self.bytes_d2h += nbytes
        # Set last: until here a failure leaves a plain tensor that frees its own bytes.
        setattr(storage, _HOST_BUFFER, buffer)
        return host

    def host_full(self, src: torch.Tensor) -> bool:
        """Whether a ``copy_d2h`` of ``src`` would take the host pool past its budget (and
        the pool may not fall back to pageable memory): the copy is then kept on the
        device instead, exactly as a step plan keeps one, and counted in
        :attr:`bytes_kept_for_host`. Never true under ``pageable_fallback``."""
        if self.pool.pageable_fallback:
            return False
        self.collect()  # a finished copy may hold the last reference to a buffer
        nbytes = src.numel() * src.element_size()
        if self.pool.has_room(nbytes):
            return False
        with self._lock:
            self.bytes_kept_for_host += nbytes
        return True

    def keep_on_device(
        self, src: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]
    ) -> torch.Tensor:
        """A device copy of ``src`` laid out as ``shape``/``stride``, standing for a host
        copy: ``wait_transfer`` and ``release_host`` of it do nothing, ``copy_h2d`` returns
        it without a transfer. One device-to-device copy, after which ``src`` is freed at
        its wait as after a D2H, so the device holds the slot's bytes once.

        Never ``src`` itself: ``copy_d2h`` is a functional op, and an output aliasing its
        input breaks that contract (AOTAutograd checks each compiled graph's first call
        for it: a warning today, an error under ``CI=1`` and in later torch), and an inner
        compiler may reuse ``src``'s buffer once the graph is done with it (Inductor
        does)."""
        kept = torch.empty_strided(shape, stride, dtype=src.dtype, device=src.device)
        kept.copy_(src)
        storage = kept.untyped_storage()
        link_runtime(storage, self)
        key, table = storage_key(kept), self._records.kept
        with self._lock:
            self._records.collect_locked()
            table[key] = weakref.ref(storage, self._records.on_death(table, key))
            self.bytes_kept += src.numel() * src.element_size()
        return kept

    def is_kept(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a kept copy (:meth:`keep_on_device`) of this runtime."""
        return self._records.is_kept(tensor)

    def copy_h2d(
        self,
        host: torch.Tensor,
        device: torch.device,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
    ) -> torch.Tensor:
        """Start copying host copy ``host`` into a fresh ``device`` tensor laid out as
        ``shape``/``stride``; returns it, readable after ``wait_transfer``. A kept copy
        (:meth:`keep_on_device`) is already there: it comes back as it is."""
        if self.is_kept(host):
            return host
        host_key = storage_key(host)
        with self._lock:
            self._records.collect_locked()
            record = self._records.host_record("hyper_offload::copy_h2d", host)
            # The D2H that filled the host copy, waited or not: a wait orders only the
            # stream it ran on, so name the D2H explicitly (the engine skips it once done).
            after = [record.d2h]
            expect, origin, properties = record.sent, record.origin, record.sent_properties
            read, record.read = record.read, None
        if read is not None:
            read.synchronize()  # a host copy read back from disk: its bytes first
        engine = self.engine(device)
        device_tensor = torch.empty_strided(shape, stride, dtype=host.dtype, device=device)
        try:
            transfer = engine.h2d(host, device_tensor, after=after)
        except Exception as exc:
            # Drain before device_tensor is dropped: its bytes may still be written.
            engine.synchronize()
            raise TransferFailedError(
                f"hyper_offload::copy_h2d of {describe(host)} to {device} failed; the host "
                "copy is untouched and still valid, nothing is in flight"
            ) from exc
        link_runtime(device_tensor.untyped_storage(), self)
        with self._lock:
            record.readers = [t for t in record.readers if not t.query()] + [transfer]
            self._records.pending[storage_key(device_tensor)] = self._new_pending(
                "copy_h2d", transfer, host, device_tensor, host_key, expect=expect,
                origin=origin, expect_properties=properties,
            )
            self._records.unobserved.append(transfer)
            self.bytes_h2d += device_tensor.numel() * device_tensor.element_size()
        return device_tensor

    def wait_transfer(self, tensor: torch.Tensor, keepalive: torch.Tensor | None) -> None:
        """Make the compute stream wait for the transfer whose destination is ``tensor``
        (nothing to wait for on a kept copy)."""
        if self.is_kept(tensor):
            return
        pending = self._records.take_pending(tensor, keepalive)
        pending.transfer.wait()
        pending.transfer.query()  # drops the handle's references at once if already done
        if pending.expect is not None:
            pending.check(tensor if pending.op == "copy_h2d" else pending.keep[0])
            self.checks += 1
        if pending.op == "copy_d2h":
            with self._lock:
                self._records.hosts[pending.host_key].state = HostCopyState.VALID

    def release_host(self, host: torch.Tensor) -> None:
        """Mark the program's last use of host copy ``host``. Its buffer goes back to the
        pool when the copy dies; releasing a released copy again (a retained graph's
        second backward) changes nothing; nor does releasing a kept copy."""
        if self.is_kept(host):
            return
        self._records.release(host)

    # ------------------------------------------------------------------ lifetimes

    def collect(self) -> None:
        """Apply the deaths finalizers reported and observe completed copies, so that a
        host copy whose last holder is a finished copy's handle dies now. Costs one
        event query per copy not yet seen complete; ``copy_d2h``, ``stats`` and the
        compile backend (at every forward of every region) call it."""
        self._records.collect()

    def _exit_scope(self, exc_type: Any) -> None:
        scope = leave_scope(self._tokens.pop())
        leftover = self._records.drain(scope)
        if leftover and exc_type is None:
            started = ", ".join(f"{p.op}→{p.label}" for p in leftover)
            raise TransferMisuseError(
                f"TransferRuntime exit: {len(leftover)} transfer(s) were started but never "
                f"waited ({started}). Rule: every copy_d2h/copy_h2d is followed by one "
                "wait_transfer on its result. They were synchronized; fix the lowering"
            )

    # ------------------------------------------------------------------ the disk tier

    def adopt_host_copy(
        self, buffer: torch.Tensor, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...],
        stride: tuple[int, ...], read: Any, like: HostCopy,
    ) -> torch.Tensor:
        """A host copy over pool ``buffer`` that ``read`` (a disk read) fills: VALID, its
        first ``copy_h2d`` waits for the read; checked by ``verify`` as ``like`` was."""
        host = self._host_tensor(buffer, nbytes, dtype, shape, stride)
        key, holder = storage_key(host), [buffer]
        done = completed_transfer(TransferDirection.D2H, buffer.device, nbytes)
        with self._lock:
            self._records.collect_locked()
            self._records.hosts[key] = HostCopy(
                HostCopyState.VALID, done,
                weakref.ref(host.untyped_storage(), self._records.on_host_death(key, holder)),
                like.sent, like.origin, like.sent_properties, holder, read, loaded=True,
            )
        setattr(host.untyped_storage(), _HOST_BUFFER, buffer)
        return host

    def _new_pending(
        self, op: str, transfer: Transfer, source: torch.Tensor, destination: torch.Tensor,
        host_key: int, *, keep: tuple[torch.Tensor, ...] = (),
        expect: torch.Tensor | None = None, origin: str = "",
        expect_properties: TensorProperties | None = None,
    ) -> PendingTransfer:
        table, key = self._records.pending, storage_key(destination)
        scope = current_scope()
        return PendingTransfer(
            op, transfer, f"{describe(destination)}",
            weakref.ref(source.untyped_storage()),
            weakref.ref(destination.untyped_storage(), self._records.on_death(table, key)),
            host_key, scope if scope is not None and scope.runtime is self else None, keep,
            expect, origin, expect_properties,
        )

    def _host_tensor(
        self, buffer: torch.Tensor, nbytes: int, dtype: torch.dtype,
        shape: tuple[int, ...], stride: tuple[int, ...],
    ) -> torch.Tensor:
        """A tensor on a storage of its own over the first ``nbytes`` of ``buffer``: its
        death, not the buffer's (which the pool holds), ends the host copy."""
        # torch's own cudagraph trees build storages over existing bytes the same way.
        storage = torch._C._construct_storage_from_data_pointer(
            buffer.data_ptr(), buffer.device, nbytes
        )
        link_runtime(storage, self)
        label_host(storage)
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape, stride)

    # ------------------------------------------------------------------ inspection

    def host_state(self, host: torch.Tensor) -> HostCopyState | None:
        """State of the host copy ``host`` belongs to, or None if this runtime never made it."""
        with self._lock:
            self._records.collect_locked()
            record = self._records.hosts.get(storage_key(host))
            return None if record is None else record.state

    @property
    def host_copies(self) -> int:
        """Host copies alive (some tensor still reaches them), released or not."""
        self.collect()
        with self._lock:
            return len(self._records.hosts)

    @property
    def transfers_pending(self) -> int:
        """Transfers started and not yet waited."""
        with self._lock:
            self._records.collect_locked()
            return len(self._records.pending)

    def stats(self) -> RuntimeStats:
        """Host syncs of every engine, the pool's figures (pageable fallbacks included)
        and the transfers started but not yet waited."""
        self.collect()
        with self._lock:
            counters = [engine.host_syncs for engine in self._engines.values()]
            pending = len(self._records.pending)
        stats = runtime_stats(counters, self.pool.stats(), pending)
        moved = {"bytes_d2h": self.bytes_d2h, "bytes_h2d": self.bytes_h2d,
                 "bytes_kept": self.bytes_kept, "bytes_kept_for_host": self.bytes_kept_for_host}
        return dataclasses.replace(stats, extra={**stats.extra, **moved})

    def synchronize(self) -> None:
        """Block until every started transfer has completed (records stay pending)."""
        with self._lock:
            pending = list(self._records.pending.values())
        for p in pending:
            p.transfer.synchronize()

    def __repr__(self) -> str:
        with self._lock:
            live = len(self._records.hosts)
            pending = len(self._records.pending)
        stats = self.stats()
        return (
            f"TransferRuntime(pending={pending}, host_copies={live}, host_syncs="
            f"{stats.host_syncs}, pageable_fallbacks={stats.pageable_fallbacks}, pool={self.pool!r})"
        )


class _KeepingBlock:
    """The context manager of :meth:`TransferRuntime.keeping`."""

    def __init__(self, scope: TransferScope[TransferRuntime]) -> None:
        self._scope = scope

    def __enter__(self) -> TransferRuntime:
        runtime = self._scope.runtime
        runtime._tokens.append(enter_scope(self._scope))
        return runtime

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._scope.runtime._exit_scope(exc_type)

