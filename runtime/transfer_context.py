"""``TransferRuntime``: the state behind the ``hyper_offload::`` transfer ops.

The custom ops of :mod:`~hyper_offload.runtime.ops` are stateless functions in a graph;
the transfers they start, the host buffers they fill and the rules they enforce live
here, in an object the caller owns and makes current for a step::

    with TransferRuntime(pool=PinnedMemoryPool(config.max_host_bytes)):
        loss = compiled_model(x)
        loss.backward()

"Current" is a :class:`contextvars.ContextVar`: no module-level mutable state, threads
that do not inherit the context see no runtime, and the compiled backward, which the
autograd engine may run on a device thread, still sees it (AOTAutograd re-enters the
caller's context there). Hand-written eager backward code that the engine runs on a
device thread does not see it; call the ops from compiled graphs or the calling thread.

State machine of one host copy (keyed by the host buffer's storage)::

    copy_d2h ──► FILLING ──wait_transfer──► VALID ──release_host──► RELEASED
                    └──────────── copy_h2d allowed from FILLING or VALID ──┘ (not RELEASED)

and of one transfer: started by ``copy_d2h``/``copy_h2d`` (keyed by its destination's
storage), ended by exactly one ``wait_transfer``. Every violation raises
:class:`TransferMisuseError` naming the op, the tensor, the rule and the fix; nothing is
changed by a call that raises.

Host buffers go back to the pool on ``release_host`` gated by an event that completes
only when every transfer that touched the buffer has completed **and** the host tensor
handed out by ``copy_d2h`` has been dropped. The second condition keeps a released buffer
from being handed to the next ``copy_d2h`` while a stale reference to it still exists,
so a late ``copy_h2d``/``release_host`` on that reference is always caught as
"released" instead of silently reading another activation's bytes.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from .device import Transfer, TransferDirection, TransferEngine, resolve_device
from .errors import OffloadRuntimeError, TransferFailedError
from .memory_meter import label_host
from .pinned_pool import PinnedMemoryPool
from .stats import RuntimeStats, runtime_stats

__all__ = [
    "HostCopyState",
    "TransferMisuseError",
    "TransferRuntime",
    "current_transfer_runtime",
]


class TransferMisuseError(OffloadRuntimeError):
    """A transfer-op rule was broken (wait without a start, release twice, prefetch of a
    released host copy, no active runtime, ...). Nothing was changed."""


class HostCopyState(str, Enum):
    FILLING = "FILLING"  # D2H started, not yet waited
    VALID = "VALID"  # D2H waited: the host copy may be prefetched any number of times
    RELEASED = "RELEASED"  # returned to the pool; any further use is an error

    def __repr__(self) -> str:
        return self.value


_CURRENT: ContextVar[TransferRuntime | None] = ContextVar(
    "hyper_offload_transfer_runtime", default=None
)


def current_transfer_runtime(op: str = "hyper_offload transfer op") -> TransferRuntime:
    """The runtime made current by ``with TransferRuntime(...)``; raises if there is none."""
    runtime = _CURRENT.get()
    if runtime is None:
        raise TransferMisuseError(
            f"{op}: no TransferRuntime is active in this context. Rule: transfer ops run "
            "inside `with TransferRuntime(pool=...)`, which owns the copy engines and the "
            "host pool. Fix: wrap the step (forward and backward) in that block"
        )
    return runtime


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} on {tensor.device}"


@dataclass(eq=False)
class _HostCopy:
    """One host copy made by ``copy_d2h``. ``buffer`` is the pool buffer (dropped once
    released); ``transfers`` every copy that touched it (its release waits for all)."""

    buffer: torch.Tensor | None
    state: HostCopyState
    transfers: list[Transfer] = field(default_factory=list)
    views: list[weakref.ref[torch.Tensor]] = field(default_factory=list)
    """Every tensor object on the buffer that the ops handed out or were given."""
    storage: weakref.ref[torch.UntypedStorage] | None = None
    """Set once released: drops the record when the storage dies (its id may be reused)."""
    own_refs: int = 0
    """References to the buffer's storage that the runtime and the pool hold themselves:
    more than that means some tensor outside the runtime still reaches the host copy."""


@dataclass(eq=False)
class _Pending:
    """A started transfer whose ``wait_transfer`` has not run yet. Holding ``source``
    and ``destination`` keeps both alive until the wait, whatever the caller drops."""

    op: str
    transfer: Transfer
    source: torch.Tensor
    destination: torch.Tensor
    host_key: int


class _ReleaseGate:
    """Completion event handed to :meth:`PinnedMemoryPool.release` (see module docstring)."""

    def __init__(
        self, transfers: Iterable[Transfer], views: Iterable[weakref.ref[torch.Tensor]]
    ) -> None:
        self._transfers = tuple(transfers)
        self._views = tuple(views)

    def query(self) -> bool:
        # Transfers first: a completed Transfer drops its keepalive, which may hold the
        # last reference to a host view; checking the views first would wait forever.
        return all(t.query() for t in self._transfers) and all(v() is None for v in self._views)


def _watch(record: _HostCopy, tensor: torch.Tensor) -> None:
    """Add ``tensor`` to the objects whose death opens the record's release gate."""
    if not any(ref() is tensor for ref in record.views):
        record.views.append(weakref.ref(tensor))


def _storage_refs(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _reachable(record: _HostCopy) -> bool:
    """Whether a tensor outside the runtime still reaches the record's host copy.

    Tensor objects are not enough: Inductor hands the backward a fresh alias of the
    host tensor (``reinterpret_tensor``), so the object the op returned can die while
    the autograd graph still holds the bytes. Every tensor on the buffer's storage
    holds a reference to it, so the storage's use count decides.
    """
    if any(view() is not None for view in record.views):
        return True
    for transfer in record.transfers:
        transfer.query()  # a completed transfer drops the tensors it kept alive
    return record.buffer is not None and _storage_refs(record.buffer) > record.own_refs


def _key(tensor: torch.Tensor) -> int:
    # The storage's Python object lives as long as the storage (torch preserves it), and
    # the records below hold a tensor on it, so its id is unique while a record exists.
    return id(tensor.untyped_storage())


class TransferRuntime:
    """Copy engines, host pool and in-flight transfer records for the transfer ops.

    ``pool`` supplies host buffers; ``engines`` pre-supplies a :class:`TransferEngine` per
    device (others are created on first use). The runtime may be entered several times
    (e.g. once per step); state carries over. Leaving the block synchronizes every
    transfer still in flight (a synchronized D2H counts as waited, so its host copy can
    still be released); leaving it normally with transfers never waited raises. Leaving
    the outermost block by an exception also runs :meth:`release_all`.
    """

    def __init__(self, *, pool: PinnedMemoryPool, engines: Iterable[TransferEngine] = ()) -> None:
        self.pool = pool
        self._engines: dict[torch.device, TransferEngine] = {e.device: e for e in engines}
        self._lock = threading.RLock()
        self._pending: dict[int, _Pending] = {}
        self._hosts: dict[int, _HostCopy] = {}
        self._tokens: list[Token[TransferRuntime | None]] = []

    # ------------------------------------------------------------------ context

    def __enter__(self) -> TransferRuntime:
        self._tokens.append(_CURRENT.set(self))
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        _CURRENT.reset(self._tokens.pop())
        leftover = self._drain_pending()
        if exc_type is not None and not self._tokens:
            self.release_all()  # the step is abandoned: no host buffer may stay lost
        if leftover and exc_type is None:
            started = ", ".join(f"{p.op}→{_describe(p.destination)}" for p in leftover)
            raise TransferMisuseError(
                f"TransferRuntime exit: {len(leftover)} transfer(s) were started but never "
                f"waited ({started}). Rule: every copy_d2h/copy_h2d is followed by one "
                "wait_transfer on its result. They were synchronized; fix the lowering"
            )

    # ------------------------------------------------------------------ ops

    def engine(self, device: torch.device | str) -> TransferEngine:
        """The engine copying to and from ``device`` (created on first use)."""
        resolved = resolve_device(device)
        with self._lock:
            if resolved not in self._engines:
                self._engines[resolved] = TransferEngine(resolved)
            return self._engines[resolved]

    def copy_d2h(
        self, src: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]
    ) -> torch.Tensor:
        """Start copying ``src`` into a pool buffer laid out as ``shape``/``stride`` (a
        dense layout, see ``ops.dense_layout``); returns the host tensor.

        ``wait_transfer`` on it orders the *compute stream* after the copy (what a later
        ``copy_h2d`` or a free of ``src`` needs); it does not block the host. On an
        accelerator, host code that reads the bytes directly must synchronize the device
        first (``torch.accelerator.synchronize()``)."""
        nbytes = src.numel() * src.element_size()
        engine = self.engine(src.device)
        buffer = self.pool.acquire(nbytes)
        host = buffer[:nbytes].view(src.dtype).as_strided(shape, stride)
        label_host(host)
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
        with self._lock:
            self._hosts[key] = _HostCopy(
                buffer, HostCopyState.FILLING, [transfer], [weakref.ref(host)],
                own_refs=_storage_refs(buffer) - 1,  # all but ``host`` itself
            )
            self._pending[key] = _Pending("copy_d2h", transfer, src, host, key)
        return host

    def copy_h2d(
        self,
        host: torch.Tensor,
        device: torch.device,
        shape: tuple[int, ...],
        stride: tuple[int, ...],
    ) -> torch.Tensor:
        """Start copying host copy ``host`` into a fresh ``device`` tensor laid out as
        ``shape``/``stride``; returns it, readable after ``wait_transfer``."""
        host_key = _key(host)
        with self._lock:
            record = self._host_record("hyper_offload::copy_h2d", host)
            if record.state is HostCopyState.RELEASED:
                raise TransferMisuseError(
                    f"hyper_offload::copy_h2d: the host copy {_describe(host)} was already "
                    "released. Rule: a host copy may be prefetched only until release_host; "
                    "its buffer may now hold another activation. Fix: move release_host "
                    "after the last copy_h2d of this host copy"
                )
            _watch(record, host)
            # The D2H that filled the host copy, waited or not: a wait orders only the
            # stream it ran on, so name the D2H explicitly (the engine skips it once done).
            after = [t for t in record.transfers if t.direction is TransferDirection.D2H]
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
        with self._lock:
            record.transfers.append(transfer)
            self._pending[_key(device_tensor)] = _Pending(
                "copy_h2d", transfer, host, device_tensor, host_key
            )
        return device_tensor

    def wait_transfer(self, tensor: torch.Tensor, keepalive: torch.Tensor | None) -> None:
        """Make the compute stream wait for the transfer whose destination is ``tensor``."""
        key = _key(tensor)
        with self._lock:
            pending = self._pending.get(key)
            if pending is None:
                raise TransferMisuseError(
                    f"hyper_offload::wait_transfer: no transfer into {_describe(tensor)} is "
                    "pending; it was never started, or was already waited. Rule: each "
                    "copy_d2h/copy_h2d result is waited exactly once. Fix: pass the tensor "
                    "returned by copy_d2h or copy_h2d, once"
                )
            if keepalive is not None and _key(keepalive) != _key(pending.source):
                raise TransferMisuseError(
                    f"hyper_offload::wait_transfer: keepalive {_describe(keepalive)} is not "
                    f"the source of the {pending.op} into {_describe(tensor)}. Rule: the "
                    "keepalive is the tensor being copied, so that it outlives the copy. "
                    "Fix: pass the argument given to the matching copy op"
                )
            del self._pending[key]
        pending.transfer.wait()
        pending.transfer.query()  # drops the handle's references at once if already done
        if pending.op == "copy_d2h":
            with self._lock:
                record = self._hosts[pending.host_key]
                record.state = HostCopyState.VALID
                _watch(record, tensor)

    def release_host(self, host: torch.Tensor) -> None:
        """Return the buffer of host copy ``host`` to the pool once no copy touches it."""
        host_key = _key(host)
        with self._lock:
            record = self._host_record("hyper_offload::release_host", host)
            if record.state is HostCopyState.RELEASED:
                raise TransferMisuseError(
                    f"hyper_offload::release_host: the host copy {_describe(host)} was already "
                    "released. Rule: each host copy is released exactly once. Fix: remove "
                    "the second release_host"
                )
            if record.state is HostCopyState.FILLING:
                raise TransferMisuseError(
                    f"hyper_offload::release_host: the copy_d2h into {_describe(host)} was "
                    "never waited. Rule: a host copy is released only after its D2H was "
                    "waited. Fix: call wait_transfer(host, keepalive=source) first"
                )
            _watch(record, host)
            buffer, gate = self._mark_released_locked(record, host_key)
        self.pool.release(buffer, gate)

    def _mark_released_locked(
        self, record: _HostCopy, host_key: int
    ) -> tuple[torch.Tensor, _ReleaseGate]:
        """Flip ``record`` to RELEASED; returns its pool buffer and the gate to release it
        with. Caller holds the lock and then calls ``pool.release`` outside it."""
        buffer, record.buffer = record.buffer, None
        assert buffer is not None, "a record that is not RELEASED owns its buffer"
        record.state = HostCopyState.RELEASED
        record.storage = weakref.ref(
            buffer.untyped_storage(), self._forget_host_callback(host_key)
        )
        gate = _ReleaseGate(record.transfers, record.views)
        record.transfers, record.views = [], []
        return buffer, gate

    def release_all(self) -> int:
        """Release every host copy not released yet; returns how many (exception-path
        cleanup, the counterpart of ``ResidencyManager.reset``).

        Every copy engine is drained first, so no transfer is left in flight. Each buffer
        returns to the pool only once every tensor on it is dropped, so a stale host copy
        used afterwards is refused as released, never fed another activation's bytes.
        """
        self._drain_pending()
        with self._lock:
            engines = list(self._engines.values())
        for engine in engines:
            engine.synchronize()
        with self._lock:
            to_release = [
                self._mark_released_locked(record, key)
                for key, record in list(self._hosts.items())
                if record.state is not HostCopyState.RELEASED
            ]
        for buffer, gate in to_release:
            self.pool.release(buffer, gate)
        return len(to_release)

    def release_orphans(self) -> int:
        """Release every host copy that nothing can reach any more; returns how many.

        A host copy whose every handed-out tensor has died (the autograd graph holding
        it was freed without running its backward, e.g. a forward without backward or a
        backward that raised before this region's part) can never be released by a
        ``release_host``; without this its pool buffer would stay lost for the
        runtime's lifetime. Copies with a transfer still pending are left alone.
        """
        with self._lock:
            pending_hosts = {p.host_key for p in self._pending.values()}
            to_release = [
                self._mark_released_locked(record, key)
                for key, record in list(self._hosts.items())
                if record.state is not HostCopyState.RELEASED
                and key not in pending_hosts
                and not _reachable(record)
            ]
        for buffer, gate in to_release:
            self.pool.release(buffer, gate)
        return len(to_release)

    def _drain_pending(self) -> list[_Pending]:
        """Synchronize and forget every started transfer; returns them. A drained D2H's
        host copy is complete, hence VALID."""
        with self._lock:
            leftover = list(self._pending.values())
            self._pending.clear()
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
            record = self._hosts.get(_key(host))
            return None if record is None else record.state

    @property
    def transfers_pending(self) -> int:
        """Transfers started and not yet waited."""
        with self._lock:
            return len(self._pending)

    def stats(self) -> RuntimeStats:
        """Host syncs of every engine, the pool's figures (pageable fallbacks included)
        and the transfers started but not yet waited."""
        with self._lock:
            counters = [engine.host_syncs for engine in self._engines.values()]
            pending = len(self._pending)
        return runtime_stats(counters, self.pool.stats(), pending)

    def synchronize(self) -> None:
        """Block until every started transfer has completed (records stay pending)."""
        with self._lock:
            pending = list(self._pending.values())
        for p in pending:
            p.transfer.synchronize()

    def _forget_host_callback(self, key: int) -> Any:
        # Weak in the runtime: a callback must not keep a finished runtime alive.
        runtime_ref = weakref.ref(self)

        def forget(_: weakref.ref[torch.UntypedStorage]) -> None:
            runtime = runtime_ref()
            if runtime is None:
                return
            with runtime._lock:
                record = runtime._hosts.get(key)
                if record is not None and record.state is HostCopyState.RELEASED:
                    del runtime._hosts[key]

        return forget

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
            live = sum(r.state is not HostCopyState.RELEASED for r in self._hosts.values())
            pending = len(self._pending)
        stats = self.stats()
        return (
            f"TransferRuntime(pending={pending}, host_copies={live}, host_syncs="
            f"{stats.host_syncs}, pageable_fallbacks={stats.pageable_fallbacks}, pool={self.pool!r})"
        )
