"""``TransferRuntime``: the state behind the ``hyper_offload::`` transfer ops.

The custom ops of :mod:`~hyper_offload.runtime.ops` are stateless functions in a graph;
the transfers they start, the host buffers they fill and the rules they enforce live
here, in an object the caller owns and makes current for a forward pass::

    runtime = TransferRuntime(pool=PinnedMemoryPool(config.max_host_bytes))
    with runtime:
        loss = compiled_model(x)
    loss.backward()  # the backward reaches the runtime through its host copies

How an op finds its runtime: ``copy_d2h`` uses the *current* one (a
:class:`contextvars.ContextVar` set by ``with runtime``: no module-level mutable state,
threads that do not inherit the context see none). Every tensor a runtime creates (host
copies, H2D destinations) carries a weak link to it on its storage, and the other ops
follow that link first, so a backward needs no ``with`` block: it may run on the
autograd engine's device thread, from a graph served by a compile cache, long after the
forward's block closed (a retained graph's second backward).

Lifetime of a host copy: its pool buffer is **tied to the tensor**. ``copy_d2h`` hands
out a tensor on a storage of its own (a view of the pool buffer's bytes that keeps the
buffer alive); when the last tensor on that storage dies (the autograd graph holding
it is freed, whichever runtime or session runs next) a finalizer gives the buffer back
to the pool. No transfer can still touch it then: an in-flight copy keeps its host side
alive until it is observed complete. So a host copy is readable for exactly as long as
something can read it, and a buffer is never handed out while a stale reference to it
exists.

State machine of one host copy (keyed by its storage)::

    copy_d2h ─► FILLING ─wait_transfer─► VALID ─release_host─► RELEASED
                 └── copy_h2d allowed from FILLING, VALID and RELEASED ──┘

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
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar, Token
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from hyper_offload.errors import TransferFailedError, TransferMisuseError
from hyper_offload.passes.ir.properties import TensorProperties

from .device import resolve_device
from .transfer import Transfer, TransferDirection, TransferEngine, completed_transfer
from .disk_ops import DiskTransfers
from .disk_store import DiskStore
from .memory_meter import label_host
from .physical_buffer import AllDone
from .pinned_pool import PinnedMemoryPool
from .stats import RuntimeStats, runtime_stats
from .verify import checksum, dense_bytes, require_checksum, require_properties

__all__ = [
    "HostCopyState",
    "TransferMisuseError",
    "TransferRuntime",
    "current_keep",
    "current_transfer_runtime",
    "runtime_of",
]


class HostCopyState(str, Enum):
    FILLING = "FILLING"  # D2H started, not yet waited
    VALID = "VALID"  # D2H waited: the host copy may be prefetched any number of times
    RELEASED = "RELEASED"  # the program's last use passed; readable while referenced

    def __repr__(self) -> str:
        return self.value


@dataclass(frozen=True, eq=False)
class _Scope:
    """One ``with runtime`` block (compared by identity): the transfers it started are
    drained at its exit. ``keep``: the ``copy_d2h`` slots this block keeps on the device
    (:meth:`TransferRuntime.keeping`); ``where`` and ``slot_names`` name the block and its
    copies in ``verify``'s errors."""

    runtime: TransferRuntime
    keep: frozenset[int] = frozenset()
    where: str = ""
    slot_names: Mapping[int, str] = dataclasses.field(default_factory=dict)

    def origin(self, slot: int) -> str:
        """Where the ``copy_d2h`` of ``slot`` ran, for ``verify``'s errors."""
        name = self.slot_names.get(slot, f"slot {slot}" if slot >= 0 else "")
        return ", ".join(part for part in (self.where, f"copy_d2h {name}".strip()) if part)


_CURRENT: ContextVar[_Scope | None] = ContextVar("hyper_offload_transfer_runtime", default=None)

_RUNTIME_LINK = "_hyper_offload_runtime"
"""Attribute, on the storage of every tensor a runtime creates, holding a weak reference
to that runtime (torch keeps a storage's Python object, and so its attributes, for as
long as the storage lives, whichever tensor object reaches it)."""
_HOST_BUFFER = "_hyper_offload_pool_buffer"
"""Attribute, on a host copy's storage, holding its pool buffer: the bytes stay valid
for as long as any tensor on the copy lives, even past its runtime and pool."""


def current_transfer_runtime(op: str = "hyper_offload transfer op") -> TransferRuntime:
    """The runtime made current by ``with TransferRuntime(...)``; raises if there is none."""
    scope = _CURRENT.get()
    if scope is None:
        raise TransferMisuseError(
            f"{op}: no TransferRuntime is active in this context. Rule: a forward pass "
            "that offloads runs inside `with TransferRuntime(pool=...)`, which owns the "
            "copy engines and the host pool. Fix: wrap the forward pass in that block"
        )
    return scope.runtime


def runtime_of(op: str, *tensors: torch.Tensor | None) -> TransferRuntime:
    """The runtime that created the first of ``tensors`` made by a runtime, else the
    current one (see the module docstring)."""
    for tensor in tensors:
        if tensor is None:
            continue
        link = getattr(tensor.untyped_storage(), _RUNTIME_LINK, None)
        if link is None:
            continue
        runtime = link()
        if runtime is None:
            raise TransferMisuseError(
                f"{op}: {_describe(tensor)} was made by a TransferRuntime that no longer "
                "exists. Rule: a runtime outlives the graphs that use its host copies. "
                "Fix: keep the runtime (the compiled model's backend) alive until their "
                "backward has run"
            )
        return runtime
    return current_transfer_runtime(op)


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} on {tensor.device}"


def _key(tensor: torch.Tensor) -> int:
    # The storage's Python object lives as long as the storage, and every record below
    # is dropped (by a weakref callback) when its storage dies, so the id is unique for
    # the record's lifetime.
    return id(tensor.untyped_storage())


@dataclass(eq=False)
class _HostCopy:
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
    :meth:`TransferRuntime.take_host_buffer`) gives it back: whoever pops it returns it,
    exactly once."""
    read: Any = None
    """A disk read filling the buffer (:mod:`.disk_ops`); the first H2D waits for it."""
    readers: list[Transfer] = dataclasses.field(default_factory=list)
    """The H2Ds started from this copy (a buffer given back waits for them)."""
    loaded: bool = False
    """Read back from disk: ``release_host`` gives its buffer back at once (no second
    backward can read it: its file is gone)."""


@dataclass(eq=False)
class _Pending:
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
    scope: _Scope | None
    keep: tuple[torch.Tensor, ...]
    expect: torch.Tensor | None = None
    """``verify``: the checksum the destination must have once waited (None: unchecked)."""
    origin: str = ""
    expect_properties: TensorProperties | None = None
    """``verify``, an H2D: the properties its destination must have."""


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
        self.disk = None if disk is None else DiskTransfers(self, disk)
        """The disk tier's ops (:mod:`.disk_ops`; None: no disk tier)."""
        self.verify = verify
        """Checksum every ``copy_d2h`` from now on and check it (module docstring); the
        copies it checksummed stay checked after it is turned off."""
        self.checks = 0
        """Checks that passed since the runtime was made (``verify``)."""
        self._engines: dict[torch.device, TransferEngine] = {e.device: e for e in engines}
        self._lock = threading.RLock()
        self._pending: dict[int, _Pending] = {}
        self._hosts: dict[int, _HostCopy] = {}
        # Kept copies (keep_on_device) by storage, each dropped when its storage dies.
        self._kept: dict[int, weakref.ref[torch.UntypedStorage]] = {}
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
        self._tokens: list[Token[_Scope | None]] = []
        # Keys whose storage died, appended by weakref callbacks (which may run inside
        # any code, this runtime's included) and applied under the lock by _collect_locked.
        self._dead: deque[tuple[dict[int, Any], int, weakref.ref[Any]]] = deque()
        # Transfers not yet seen complete: until then each one's handle holds its host
        # side, so collect() must look at them for a dead host copy to die.
        self._unobserved: list[Transfer] = []

    # ------------------------------------------------------------------ context

    def __enter__(self) -> TransferRuntime:
        self._tokens.append(_CURRENT.set(_Scope(self)))
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
        return _KeepingBlock(_Scope(self, frozenset(slots), where, slot_names or {}))

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
                f"hyper_offload::copy_d2h of {_describe(src)} failed; the device tensor is "
                "untouched and still the valid copy, the host buffer went back to the pool"
            ) from exc
        key = _key(host)
        storage = host.untyped_storage()
        with self._lock:
            self._collect_locked()
            scope = _CURRENT.get()
            origin = scope.origin(slot) if scope is not None else ""
            holder = [buffer]
            self._hosts[key] = _HostCopy(
                HostCopyState.FILLING, transfer,
                weakref.ref(storage, self._on_host_death(key, holder)), sent, origin,
                sent_properties, holder,
            )
            self._pending[key] = self._new_pending(
                "copy_d2h", transfer, src, host, key, keep=(src, host), expect=sent,
                origin=origin,
            )
            self._unobserved.append(transfer)
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
        setattr(storage, _RUNTIME_LINK, weakref.ref(self))
        key, dead, table = _key(kept), self._dead, self._kept
        with self._lock:
            self._collect_locked()
            table[key] = weakref.ref(storage, lambda ref: dead.append((table, key, ref)))
            self.bytes_kept += src.numel() * src.element_size()
        return kept

    def is_kept(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a kept copy (:meth:`keep_on_device`) of this runtime."""
        with self._lock:
            self._collect_locked()
            ref = self._kept.get(_key(tensor))
            return ref is not None and ref() is tensor.untyped_storage()

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
        host_key = _key(host)
        with self._lock:
            self._collect_locked()
            record = self._host_record("hyper_offload::copy_h2d", host)
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
                f"hyper_offload::copy_h2d of {_describe(host)} to {device} failed; the host "
                "copy is untouched and still valid, nothing is in flight"
            ) from exc
        setattr(device_tensor.untyped_storage(), _RUNTIME_LINK, weakref.ref(self))
        with self._lock:
            record.readers = [t for t in record.readers if not t.query()] + [transfer]
            self._pending[_key(device_tensor)] = self._new_pending(
                "copy_h2d", transfer, host, device_tensor, host_key, expect=expect,
                origin=origin, expect_properties=properties,
            )
            self._unobserved.append(transfer)
            self.bytes_h2d += device_tensor.numel() * device_tensor.element_size()
        return device_tensor

    def wait_transfer(self, tensor: torch.Tensor, keepalive: torch.Tensor | None) -> None:
        """Make the compute stream wait for the transfer whose destination is ``tensor``
        (nothing to wait for on a kept copy)."""
        if self.is_kept(tensor):
            return
        key = _key(tensor)
        with self._lock:
            self._collect_locked()
            pending = self._pending.get(key)
            if pending is None:
                raise TransferMisuseError(
                    f"hyper_offload::wait_transfer: no transfer into {_describe(tensor)} is "
                    "pending; it was never started, or was already waited. Rule: each "
                    "copy_d2h/copy_h2d result is waited exactly once. Fix: pass the tensor "
                    "returned by copy_d2h or copy_h2d, once"
                )
            if keepalive is not None and keepalive.untyped_storage() is not pending.source():
                raise TransferMisuseError(
                    f"hyper_offload::wait_transfer: keepalive {_describe(keepalive)} is not "
                    f"the source of the {pending.op} into {_describe(tensor)}. Rule: the "
                    "keepalive is the tensor being copied, so that it outlives the copy. "
                    "Fix: pass the argument given to the matching copy op"
                )
            del self._pending[key]
        pending.transfer.wait()
        pending.transfer.query()  # drops the handle's references at once if already done
        if pending.expect is not None:
            self._check(pending, tensor if pending.op == "copy_h2d" else pending.keep[0])
        if pending.op == "copy_d2h":
            with self._lock:
                self._hosts[pending.host_key].state = HostCopyState.VALID

    def _check(self, pending: _Pending, data: torch.Tensor) -> None:
        """``verify``: after the wait of ``pending``, ``data`` (a D2H's source, which the
        graph frees next; an H2D's destination, which ops read next) must still hold, or
        now hold, the bytes the D2H copied."""
        assert pending.expect is not None
        layout = pending.keep[1] if pending.op == "copy_d2h" else data
        found = dense_bytes(data, tuple(layout.shape), tuple(layout.stride()))
        subject = f"{_describe(data)} ({data.numel() * data.element_size()} B)"
        if pending.op == "copy_d2h":
            require_checksum(
                found, pending.expect, "write after copy", subject, "the device bytes changed "
                "after their D2H was issued, so the host copy holds older or torn bytes",
                pending.origin,
            )
        else:
            where = f"{pending.origin}, reloaded by copy_h2d" if pending.origin else "copy_h2d"
            if pending.expect_properties is not None:
                require_properties(data, pending.expect_properties, subject, where)
            require_checksum(
                found, pending.expect, "reload", subject,
                "the reloaded bytes differ from those the D2H read", where,
            )
        self.checks += 1

    def release_host(self, host: torch.Tensor) -> None:
        """Mark the program's last use of host copy ``host``. Its buffer goes back to the
        pool when the copy dies; releasing a released copy again (a retained graph's
        second backward) changes nothing; nor does releasing a kept copy."""
        if self.is_kept(host):
            return
        with self._lock:
            self._collect_locked()
            record = self._host_record("hyper_offload::release_host", host)
            if record.state is HostCopyState.FILLING:
                raise TransferMisuseError(
                    f"hyper_offload::release_host: the copy_d2h into {_describe(host)} was "
                    "never waited. Rule: a host copy is released only after its D2H was "
                    "waited. Fix: call wait_transfer(host, keepalive=source) first"
                )
            record.state = HostCopyState.RELEASED
            loaded = record.loaded
        if loaded:
            self.give_back_host_buffer(host)

    # ------------------------------------------------------------------ lifetimes

    def collect(self) -> None:
        """Apply the deaths finalizers reported and observe completed copies, so that a
        host copy whose last holder is a finished copy's handle dies now. Costs one
        event query per copy not yet seen complete; ``copy_d2h``, ``stats`` and the
        compile backend (at every forward of every region) call it."""
        with self._lock:
            self._collect_locked()
            transfers, self._unobserved = self._unobserved, []
        # Outside the lock: a completion drops references, which may run finalizers.
        running = [transfer for transfer in transfers if not transfer.query()]
        with self._lock:
            self._unobserved.extend(running)

    def _exit_scope(self, exc_type: Any) -> None:
        scope = _CURRENT.get()
        _CURRENT.reset(self._tokens.pop())
        leftover = self._drain_pending(scope)
        if leftover and exc_type is None:
            started = ", ".join(f"{p.op}→{p.label}" for p in leftover)
            raise TransferMisuseError(
                f"TransferRuntime exit: {len(leftover)} transfer(s) were started but never "
                f"waited ({started}). Rule: every copy_d2h/copy_h2d is followed by one "
                "wait_transfer on its result. They were synchronized; fix the lowering"
            )

    def _collect_locked(self) -> None:
        while self._dead:
            table, key, ref = self._dead.popleft()
            record = table.get(key)
            # The key may already name a newer record (ids are reused once a storage dies);
            # a kept copy's record is its weak reference itself.
            lifetime = record if isinstance(record, weakref.ref) else getattr(record, "lifetime", None)
            if record is not None and lifetime is ref:
                del table[key]

    def _on_host_death(self, key: int, holder: list[torch.Tensor]) -> Callable[[Any], None]:
        pool, dead, hosts = self.pool, self._dead, self._hosts

        def died(ref: weakref.ref[torch.UntypedStorage]) -> None:
            # May run inside any code, also while this thread holds the pool's or this
            # runtime's lock: only non-blocking calls here (list.pop is atomic).
            if holder:
                pool.release_soon(holder.pop())
            dead.append((hosts, key, ref))

        return died

    # ------------------------------------------------------------------ the disk tier

    def take_host_buffer(self, host: torch.Tensor) -> tuple[torch.Tensor, _HostCopy]:
        """The pool buffer of host copy ``host``, taken from the copy (:mod:`.disk_ops`
        writes it to disk and gives it back to the pool itself): the copy's death no
        longer returns it. Nothing may read ``host`` afterwards."""
        with self._lock:
            self._collect_locked()
            record = self._host_record("hyper_offload::spill_to_disk", host)
            if not record.holder:
                raise TransferMisuseError(
                    f"hyper_offload::spill_to_disk: the host copy {_describe(host)} was "
                    "spilled already. Rule: one spill per host copy. Fix: spill the copy_d2h "
                    "result once")
            return record.holder.pop(), record

    def adopt_host_copy(
        self, buffer: torch.Tensor, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...],
        stride: tuple[int, ...], read: Any, like: _HostCopy,
    ) -> torch.Tensor:
        """A host copy over pool ``buffer`` that ``read`` (a disk read) fills: VALID, its
        first ``copy_h2d`` waits for the read; checked by ``verify`` as ``like`` was."""
        host = self._host_tensor(buffer, nbytes, dtype, shape, stride)
        key, holder = _key(host), [buffer]
        done = completed_transfer(TransferDirection.D2H, buffer.device, nbytes)
        with self._lock:
            self._collect_locked()
            self._hosts[key] = _HostCopy(
                HostCopyState.VALID, done,
                weakref.ref(host.untyped_storage(), self._on_host_death(key, holder)),
                like.sent, like.origin, like.sent_properties, holder, read, loaded=True,
            )
        setattr(host.untyped_storage(), _HOST_BUFFER, buffer)
        return host

    def give_back_host_buffer(self, host: torch.Tensor) -> None:
        """A host copy read back from disk is done with (its ``release_host``): its buffer
        returns to the pool once the copies reading it completed, not at its death (the
        file is gone, so no second backward reads it again; nothing reads ``host`` after
        its last reload)."""
        with self._lock:
            record = self._hosts.get(_key(host))
            if record is None or not record.holder:
                return
            buffer = record.holder.pop()
            readers = [t for t in record.readers if not t.query()]
        self.pool.release(buffer, AllDone(readers) if readers else None)

    def _new_pending(
        self, op: str, transfer: Transfer, source: torch.Tensor, destination: torch.Tensor,
        host_key: int, *, keep: tuple[torch.Tensor, ...] = (),
        expect: torch.Tensor | None = None, origin: str = "",
        expect_properties: TensorProperties | None = None,
    ) -> _Pending:
        dead, table, key = self._dead, self._pending, _key(destination)
        scope = _CURRENT.get()
        return _Pending(
            op, transfer, f"{_describe(destination)}",
            weakref.ref(source.untyped_storage()),
            weakref.ref(destination.untyped_storage(), lambda ref: dead.append((table, key, ref))),
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
        setattr(storage, _RUNTIME_LINK, weakref.ref(self))
        label_host(storage)
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape, stride)

    def _drain_pending(self, scope: _Scope | None) -> list[_Pending]:
        """Synchronize and forget the unwaited transfers started in ``scope``; returns
        them. A drained D2H's host copy is complete, hence VALID."""
        with self._lock:
            self._collect_locked()
            keys = [key for key, p in self._pending.items() if p.scope is scope]
            leftover = [self._pending.pop(key) for key in keys]
        for pending in leftover:
            pending.transfer.synchronize()  # nothing stays in flight past this point
        with self._lock:
            for pending in leftover:
                record = self._hosts.get(pending.host_key)
                if pending.op == "copy_d2h" and record is not None:
                    record.state = HostCopyState.VALID
        return leftover

    # ------------------------------------------------------------------ inspection

    def host_state(self, host: torch.Tensor) -> HostCopyState | None:
        """State of the host copy ``host`` belongs to, or None if this runtime never made it."""
        with self._lock:
            self._collect_locked()
            record = self._hosts.get(_key(host))
            return None if record is None else record.state

    @property
    def host_copies(self) -> int:
        """Host copies alive (some tensor still reaches them), released or not."""
        self.collect()
        with self._lock:
            return len(self._hosts)

    @property
    def transfers_pending(self) -> int:
        """Transfers started and not yet waited."""
        with self._lock:
            self._collect_locked()
            return len(self._pending)

    def stats(self) -> RuntimeStats:
        """Host syncs of every engine, the pool's figures (pageable fallbacks included)
        and the transfers started but not yet waited."""
        self.collect()
        with self._lock:
            counters = [engine.host_syncs for engine in self._engines.values()]
            pending = len(self._pending)
        stats = runtime_stats(counters, self.pool.stats(), pending)
        moved = {"bytes_d2h": self.bytes_d2h, "bytes_h2d": self.bytes_h2d,
                 "bytes_kept": self.bytes_kept, "bytes_kept_for_host": self.bytes_kept_for_host}
        return dataclasses.replace(stats, extra={**stats.extra, **moved})

    def synchronize(self) -> None:
        """Block until every started transfer has completed (records stay pending)."""
        with self._lock:
            pending = list(self._pending.values())
        for p in pending:
            p.transfer.synchronize()

    def _host_record(self, op: str, host: torch.Tensor) -> _HostCopy:
        # Caller holds the lock.
        record = self._hosts.get(_key(host))
        if record is None:
            raise TransferMisuseError(
                f"{op}: {_describe(host)} is not a host copy made by copy_d2h in this "
                "TransferRuntime. Rule: only tensors returned by copy_d2h are host copies. "
                "Fix: pass the result of copy_d2h (after its wait_transfer)"
            )
        return record

    def __repr__(self) -> str:
        with self._lock:
            live = len(self._hosts)
            pending = len(self._pending)
        stats = self.stats()
        return (
            f"TransferRuntime(pending={pending}, host_copies={live}, host_syncs="
            f"{stats.host_syncs}, pageable_fallbacks={stats.pageable_fallbacks}, pool={self.pool!r})"
        )


class _KeepingBlock:
    """The context manager of :meth:`TransferRuntime.keeping`."""

    def __init__(self, scope: _Scope) -> None:
        self._scope = scope

    def __enter__(self) -> TransferRuntime:
        runtime = self._scope.runtime
        runtime._tokens.append(_CURRENT.set(self._scope))
        return runtime

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._scope.runtime._exit_scope(exc_type)


def current_keep(slot: int) -> bool:
    """Whether the current block keeps ``copy_d2h`` slot ``slot`` on the device
    (``TransferRuntime.keeping``)."""
    scope = _CURRENT.get()
    return scope is not None and slot in scope.keep
