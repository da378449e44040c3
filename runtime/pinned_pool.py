"""``PinnedMemoryPool``: bucketed, capped, thread-safe cache of host staging buffers.

Allocating page-locked memory is slow (milliseconds per call on CUDA) and the same sizes
recur every training step, so host buffers are cached by size bucket and reused.

Rules (each is tested):

* **Buckets.** A request of ``n`` bytes is served by a buffer of the next power of two,
  at least ``MIN_BUCKET_BYTES`` (2^10) and at most ``MAX_BUCKET_BYTES`` (2^31). A request
  larger than 2^31 bytes gets a *dedicated* buffer of exactly ``n`` bytes that is freed,
  not cached, when released: such sizes are rare and a power-of-two round-up would waste
  up to 2 GiB (of pageable memory; pinned, torch rounds it up anyway, see the cap).
* **Cap.** The pool never makes the process pin more than ``max_host_bytes`` for its
  own buffers (in use + waiting for release + cached). Each buffer is counted at what
  pinning it really costs: torch's caching host allocator rounds every pinned request
  up to a power of two (so a dedicated 2.1 GiB buffer pins 4 GiB and is counted so),
  and keeps freed pinned blocks in its own cache, so whenever the pool frees pinned
  buffers (eviction, :meth:`~PinnedMemoryPool.trim`, a dedicated buffer's release) it
  empties that cache (``torch.accelerator.empty_host_cache()``: note that this also returns
  *other* unused cached pinned blocks of the process).
  :attr:`~.stats.PoolStats.host_allocator_pinned_bytes` reports what torch's host allocator really
  holds, for comparison. When a new buffer would break the cap, cached buffers are freed
  first; if that is not enough, the pool first waits for buffers whose release is still
  pending on an event (their copies finish; nothing else can free room), then, only with
  ``pageable_fallback=True``, serves the request with ordinary *pageable* memory, counted
  separately (``pageable_fallbacks``, ``pageable_bytes_in_use``) and simply dropped on
  release; without it (the default) the cap is the host budget the planners keep
  (``OffloadConfig.max_host_activation_mb``), and breaking it raises
  :class:`~hyper_offload.errors.HostBudgetError` naming the budget and the fixes. A failed
  pinned allocation (the operating system refused to pin) falls back to pageable either way:
  that takes no more host memory, only slower copies.
* **Pageable fallbacks are loud.** A copy to or from pageable memory is synchronous on
  CUDA and, since the copy stream first waits for compute, blocks the host behind all
  queued work. A pinned pool warns once (:class:`PageableFallbackWarning`, naming the
  cap and ``OffloadConfig.max_host_activation_mb``) and every stats view reports the
  count.
* **Release after the last event.** ``release(buffer, event)`` puts the buffer on a
  pending list; it becomes reusable only once ``event.query()`` is True (the copy that
  touched it is finished). Pending buffers are reaped on ``acquire``, ``stats`` and
  ``trim``. ``event`` may be anything with ``query()``: a ``torch.Event``, a
  :class:`~hyper_offload.runtime.transfer.Transfer`, or ``None`` (free now).
* **Release from a finalizer.** :meth:`~PinnedMemoryPool.release_soon` never blocks: a
  weakref callback or garbage-collector finalizer may run while this very thread holds the
  pool's lock (a collection can start at any allocation), so it only queues the buffer;
  every locked operation applies the queue first, so no caller can tell the difference.
* **One owner at a time.** A buffer is handed out to one caller until released;
  releasing it twice, or releasing a tensor the pool never handed out, raises
  :class:`~hyper_offload.errors.PoolMisuseError`. Buffers are identified by
  their storage, so releasing any view of a handed-out buffer is accepted.
* **Thread-safe.** One ``threading.Lock`` guards the bookkeeping; the slow allocation
  itself runs outside the lock against a reservation, so the cap holds under contention.

On CPU ``pin`` defaults to False (the CPU build cannot pin): the pool then caches
ordinary host buffers with identical bookkeeping, and the ``pinned_*`` statistics count
those pool-owned buffers.

Every buffer the pool hands out is labelled as host memory
(:func:`~hyper_offload.runtime.memory_meter.label_host`), so the live-storage meter never
mistakes staging buffers for device bytes on CPU, where both share one allocator.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from hyper_offload.errors import (
    ConfigurationError,
    HostBudgetError,
    PageableFallbackWarning,
    PoolMisuseError,
)
from hyper_offload.passes.ir.schedule import MAX_BUCKET_BYTES, MIN_BUCKET_BYTES, host_bucket_bytes

from .device import pin_memory_available
from .memory_meter import label_host
from .stats import PoolStats


__all__ = [
    "CompletionEvent",
    "MAX_BUCKET_BYTES",
    "MIN_BUCKET_BYTES",
    "PageableFallbackWarning",
    "PinnedMemoryPool",
    "bucket_bytes",
    "host_buffer",
]


class CompletionEvent(Protocol):
    def query(self) -> bool: ...


#: Capacity of the buffer that serves a request (the planners count the same, so a plan
#: that keeps the host budget in these bytes keeps the pool under its cap).
bucket_bytes = host_bucket_bytes


def pinned_cost(capacity: int) -> int:
    """Bytes torch really pins for a pinned request of ``capacity`` bytes: its caching
    host allocator (``ATen/core/CachingHostAllocator.h``) rounds every request up to the
    next power of two unless the user lowered ``pinned_max_round_threshold`` in the
    allocator config, in which case this count is conservative (never below the truth)."""
    return 1 << max(0, capacity - 1).bit_length()


@dataclass(eq=False)
class _Buffer:
    tensor: torch.Tensor
    capacity: int
    cost: int  # bytes counted against the cap (what pinning it really takes)
    pool_owned: bool  # False: pageable fallback, never cached
    cacheable: bool  # False: dedicated (> MAX_BUCKET_BYTES) or pageable

    @property
    def key(self) -> int:
        return _storage_key(self.tensor)


def host_buffer(nbytes: int) -> torch.Tensor:
    """A pageable 1-D uint8 host buffer, labelled as host memory for
    :class:`~hyper_offload.runtime.memory_meter.DeviceMemoryMeter`.

    Allocated as a bare ``UntypedStorage`` (no aten op runs), so a meter active on CPU never
    counts host bytes as device bytes, not even for the one op before the label is set.
    """
    storage = torch.UntypedStorage(nbytes)
    label_host(storage)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class PinnedMemoryPool:
    """Host staging buffers for offloaded activations; see the module docstring."""

    def __init__(
        self, max_host_bytes: int, *, pin: bool | None = None, pageable_fallback: bool = False
    ) -> None:
        if not _is_count(max_host_bytes):
            raise ConfigurationError(
                f"PinnedMemoryPool: max_host_bytes must be an int >= 0, got {max_host_bytes!r}; "
                "use OffloadConfig.max_host_bytes"
            )
        if pin is None:
            pin = pin_memory_available()
        elif pin and not pin_memory_available():
            raise ConfigurationError(
                "PinnedMemoryPool(pin=True): page-locked memory needs an accelerator and "
                "torch.accelerator.is_available() is False here; pass pin=None or pin=False"
            )
        self.max_host_bytes = max_host_bytes
        self.pin = pin
        self.pageable_fallback = bool(pageable_fallback)
        self._lock = threading.Lock()
        self._free: dict[int, list[_Buffer]] = {}  # capacity -> cached buffers
        self._in_use: dict[int, _Buffer] = {}  # storage key -> buffer
        self._pending: list[tuple[_Buffer, CompletionEvent | None]] = []
        # Filled without the lock by release_soon (deque.append is atomic); drained by
        # every locked operation through _reap_locked.
        self._released_soon: deque[torch.Tensor] = deque()
        self._held = 0  # pool-owned bytes incl. reservations for allocations in progress
        self._in_use_bytes = 0
        self._pending_bytes = 0
        self._cached_bytes = 0
        self._peak = 0
        self._pageable_in_use = 0
        self._pageable_fallbacks = 0
        self._hits = 0
        self._misses = 0
        self._warned_pageable = False
        self._host_cache_dirty = False  # pinned buffers freed since the last empty

    # ------------------------------------------------------------------ public API

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 host buffer of at least ``nbytes`` bytes, owned by the caller until
        :meth:`release`. Contents are unspecified."""
        if not _is_count(nbytes):
            raise ConfigurationError(
                f"PinnedMemoryPool.acquire: nbytes must be an int >= 0, got {nbytes!r}"
            )
        capacity = bucket_bytes(nbytes)
        cost = pinned_cost(capacity) if self.pin else capacity
        with self._lock:
            self._reap_locked()
            cached = self._free.get(capacity)
            if cached and capacity <= MAX_BUCKET_BYTES:
                buffer = cached.pop()
                self._cached_bytes -= buffer.cost
                self._hits += 1
                self._hand_out_locked(buffer)
                return buffer.tensor
            self._misses += 1
            reserved = self._reserve_locked(cost)
        if not reserved and self._wait_for_pending():
            with self._lock:
                self._reap_locked()
                reserved = self._reserve_locked(cost)
        self._flush_host_cache()  # evicted pinned buffers must really be unpinned first
        if reserved:
            tensor = self._allocate(capacity, pin=self.pin)
            if tensor is not None:
                cacheable = capacity <= MAX_BUCKET_BYTES
                buffer = _Buffer(tensor, capacity, cost, pool_owned=True, cacheable=cacheable)
                with self._lock:
                    self._hand_out_locked(buffer)
                return tensor
            with self._lock:
                self._held -= cost  # pinning failed: give the reservation back
            return self._acquire_pageable(nbytes, why="pinning the buffer failed")
        if not self.pageable_fallback:
            raise self._over_budget(nbytes, capacity)
        return self._acquire_pageable(
            nbytes, why=f"the pool's cap of {self.max_host_bytes} B pinned is reached"
        )

    def release(self, buffer: torch.Tensor, event: CompletionEvent | None = None) -> None:
        """Give ``buffer`` (or any view of it) back. It is reused only after
        ``event.query()`` is True; ``None`` means no copy is touching it."""
        key = _storage_key(buffer)
        with self._lock:
            record = self._in_use.pop(key, None)
            if record is None:
                raise PoolMisuseError(self._why_not_in_use_locked(key))
            self._pend_locked(record, event)
            self._reap_locked()
        self._flush_host_cache()

    def release_soon(self, buffer: torch.Tensor) -> None:
        """Give ``buffer`` back with no copy touching it, from any context: never blocks,
        takes no lock and never raises, so finalizers may call it (see the module
        docstring). Applied by the next ``acquire``/``release``/``stats``/``trim``/``owns``,
        which is before anyone can observe or reuse it; a buffer this pool does not have
        in use is ignored."""
        self._released_soon.append(buffer)

    def stats(self) -> PoolStats:
        """Reap completed releases, then snapshot the counters."""
        with self._lock:
            self._reap_locked()
        self._flush_host_cache()
        host_pinned = self._host_allocator_pinned_bytes() if self.pin else None
        with self._lock:
            return PoolStats(
                pinned=self.pin,
                pinned_bytes_in_use=self._in_use_bytes,
                pinned_bytes_pending=self._pending_bytes,
                pinned_bytes_cached=self._cached_bytes,
                pinned_bytes_peak=self._peak,
                pageable_bytes_in_use=self._pageable_in_use,
                pageable_fallbacks=self._pageable_fallbacks,
                hits=self._hits,
                misses=self._misses,
                buffers_in_use=len(self._in_use),
                pending_releases=len(self._pending),
                host_allocator_pinned_bytes=host_pinned,
            )

    def trim(self) -> int:
        """Free every cached buffer (after reaping completed releases); returns the bytes
        freed. Buffers in use or still pending are untouched.

        Pinned memory freed by torch first lands in the accelerator's own host-allocator
        cache; with ``pin=True`` that cache's unused blocks are emptied too, so the bytes
        really go back to the operating system.
        """
        with self._lock:
            self._reap_locked()
            freed = self._cached_bytes
            self._free.clear()
            self._held -= freed
            self._cached_bytes = 0
            if freed and self.pin:
                self._host_cache_dirty = True
        self._flush_host_cache()
        return freed

    def has_room(self, nbytes: int) -> bool:
        """Whether a request of ``nbytes`` would be served within the cap (cached buffers
        count as room: they are evicted first; so do pending ones: :meth:`acquire` waits
        for their copies at the cap)."""
        capacity = bucket_bytes(nbytes)
        cost = pinned_cost(capacity) if self.pin else capacity
        with self._lock:
            self._reap_locked()
            if capacity <= MAX_BUCKET_BYTES and self._free.get(capacity):
                return True
            waiting = sum(b.cost for b, e in self._pending if e is not None and b.pool_owned
                          and callable(getattr(e, "synchronize", None)))
            busy = self._held - self._cached_bytes - waiting
            return busy + cost <= self.max_host_bytes

    def owns(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` (or a view of it) is currently handed out by this pool."""
        with self._lock:
            self._reap_locked()
            return _storage_key(buffer) in self._in_use

    def __repr__(self) -> str:
        return (f"PinnedMemoryPool(max_host_bytes={self.max_host_bytes}, pin={self.pin}, "
                f"pageable_fallback={self.pageable_fallback})")

    # ------------------------------------------------------------------ internals

    def _wait_for_pending(self) -> bool:
        """Block until every pending release's event completes (outside the lock); True if
        there was one. Only called when the cap is reached: waiting is slower than
        reusing, but cheaper than breaking the host budget."""
        with self._lock:
            events = [event for _, event in self._pending if event is not None]
        for event in events:
            synchronize = getattr(event, "synchronize", None)
            if synchronize is not None:
                synchronize()
        return bool(events)

    def _over_budget(self, nbytes: int, capacity: int) -> HostBudgetError:
        with self._lock:
            held, in_use = self._held, self._in_use_bytes
        mib = 1 << 20
        return HostBudgetError(
            f"PinnedMemoryPool: a {nbytes} B host buffer ({capacity} B bucket) would take the "
            f"pool past its host budget of {self.max_host_bytes / mib:g} MiB ({held} B held, "
            f"{in_use} B in use): the plan that asked for it was not made under this budget "
            "(a planner that ignores OffloadConfig.max_host_activation_mb, or a step that "
            "changed). Raise max_host_activation_mb, let the door's planner keep it (the "
            "default planner does; the compile door's recompute=\"auto\" recomputes what "
            "neither budget holds), or allow slower pageable memory past it with "
            "OffloadConfig(pageable_fallback=True)"
        )

    def _hand_out_locked(self, buffer: _Buffer) -> None:
        self._in_use[buffer.key] = buffer
        if buffer.pool_owned:
            self._in_use_bytes += buffer.cost
            self._peak = max(self._peak, self._held)

    def _reserve_locked(self, cost: int) -> bool:
        """Reserve ``cost`` pool-owned bytes under the cap, evicting cached buffers
        if needed. False when even an empty cache leaves no room."""
        if self._held + cost > self.max_host_bytes:
            self._evict_cached_locked(self._held + cost - self.max_host_bytes)
        if self._held + cost > self.max_host_bytes:
            return False
        self._held += cost
        return True

    def _evict_cached_locked(self, need: int) -> None:
        # Largest first: fewest evictions for the room we need.
        for capacity in sorted(self._free, reverse=True):
            bucket = self._free[capacity]
            while bucket and need > 0:
                evicted = bucket.pop()
                self._held -= evicted.cost
                self._cached_bytes -= evicted.cost
                need -= evicted.cost
                self._host_cache_dirty = self.pin
            if not bucket:
                del self._free[capacity]
            if need <= 0:
                return

    def _acquire_pageable(self, nbytes: int, *, why: str) -> torch.Tensor:
        # Exact size: pageable buffers are never cached, so rounding up would only waste.
        # At least one byte, so that the buffer has a real (unique) storage address.
        capacity = max(nbytes, 1)
        tensor = host_buffer(capacity)
        buffer = _Buffer(tensor, capacity, capacity, pool_owned=False, cacheable=False)
        with self._lock:
            self._pageable_fallbacks += 1
            self._pageable_in_use += capacity
            self._hand_out_locked(buffer)
            warn = self.pin and not self._warned_pageable
            self._warned_pageable = self._warned_pageable or warn
        if warn:
            warnings.warn(
                PageableFallbackWarning(
                    f"PinnedMemoryPool: a {nbytes} B host buffer was served from pageable "
                    f"memory because {why}. Copies to and from pageable memory block the host "
                    "behind all queued device work, so offloading stops overlapping with "
                    "compute. Raise OffloadConfig.max_host_activation_mb (this pool's cap "
                    f"is {self.max_host_bytes / (1 << 20):g} MiB) or offload less; this warning "
                    "is shown once per pool, every fallback is counted in "
                    "PoolStats.pageable_fallbacks"
                ),
                stacklevel=3,
            )
        return tensor

    @staticmethod
    def _allocate(capacity: int, *, pin: bool) -> torch.Tensor | None:
        try:
            if not pin:
                return host_buffer(capacity)
            tensor = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:
            # Out of pinnable memory (or pinning refused): the caller falls back to pageable.
            return None
        label_host(tensor)
        return tensor

    def _flush_host_cache(self) -> None:
        """Empty torch's host cache if the pool freed pinned buffers since the last time
        (outside the lock: the call may take a while)."""
        with self._lock:
            dirty, self._host_cache_dirty = self._host_cache_dirty, False
        if dirty:
            self._empty_host_cache()

    @staticmethod
    def _empty_host_cache() -> None:
        # Freed pinned blocks stay pinned in torch's caching host allocator until this.
        empty = getattr(torch.accelerator, "empty_host_cache", None)
        if empty is not None:
            empty()

    @staticmethod
    def _host_allocator_pinned_bytes() -> int | None:
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accelerator is None:
            return None
        stats_fn = getattr(torch.get_device_module(accelerator), "host_memory_stats", None)
        if stats_fn is None:
            return None
        try:
            return int(stats_fn().get("allocated_bytes.current", 0))
        except RuntimeError:
            return None

    def _pend_locked(self, record: _Buffer, event: CompletionEvent | None) -> None:
        """Move a handed-out buffer to the pending list (reaped once ``event`` is done)."""
        if record.pool_owned:
            self._in_use_bytes -= record.cost
            self._pending_bytes += record.cost
        else:
            self._pageable_in_use -= record.capacity
        self._pending.append((record, event))

    def _reap_locked(self) -> None:
        while self._released_soon:
            record = self._in_use.pop(_storage_key(self._released_soon.popleft()), None)
            if record is not None:  # else released already, or never ours
                self._pend_locked(record, None)
        still_pending: list[tuple[_Buffer, CompletionEvent | None]] = []
        for buffer, event in self._pending:
            if event is not None and not event.query():
                still_pending.append((buffer, event))
                continue
            if not buffer.pool_owned:
                continue  # pageable: just drop it
            self._pending_bytes -= buffer.cost
            if buffer.cacheable:
                self._free.setdefault(buffer.capacity, []).append(buffer)
                self._cached_bytes += buffer.cost
            else:
                self._held -= buffer.cost  # dedicated buffers are freed, not cached
                self._host_cache_dirty = self.pin
        self._pending = still_pending

    def _why_not_in_use_locked(self, key: int) -> str:
        released = any(b.key == key for b, _ in self._pending) or any(
            b.key == key for bucket in self._free.values() for b in bucket
        )
        if released:
            return (
                "PinnedMemoryPool.release: buffer was already released (each acquire() is "
                "matched by exactly one release()); drop your reference after releasing it"
            )
        return (
            "PinnedMemoryPool.release: this tensor was not handed out by this pool (or was "
            "released already and its storage freed); only release buffers returned by acquire()"
        )
