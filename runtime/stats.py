"""What the runtime counts: host syncs, pool figures, and one snapshot of both.

``RuntimeStats``: one snapshot of what the runtime did, for every stats view.

Both executors of a schedule (:class:`~hyper_offload.runtime.residency.ResidencyManager`
and :class:`~hyper_offload.runtime.transfer_context.TransferRuntime`) return it from
``stats()``, so a front door prints the same figures whichever path ran: host blocks
(with reasons), the host pool's figures including its pageable fallbacks, and the
transfers still in flight.

``HostSyncCounter``: how many times the runtime blocked the host, and why.

On an accelerator the host runs ahead of the device; every time the runtime makes the
host wait for a copy (an event or stream synchronize, a copy into pageable memory, a
synchronous fallback copy) the device's queue drains and overlap is lost. The normal
offload → prefetch → wait → release cycle needs *no* such wait: copies are ordered by
stream waits. This counter makes that claim checkable, and makes the exceptions
(pageable fallbacks, demand paging of a storage the schedule forgot, exception-path
drains) visible in every stats view.

Invariant: ``total == sum(by_reason().values())``; counts only grow. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "HostSyncCounter",
    "PoolStats",
    "RuntimeStats",
    "SyncReason",
    "runtime_stats",
]


class SyncReason:
    """Reasons the runtime records (plain strings so callers can add their own)."""

    SYNCHRONIZE = "transfer synchronize"
    """A pending transfer was synchronized (exception path, explicit request)."""
    WAIT_WITHOUT_STREAMS = "wait on a device without streams"
    """``Transfer.wait`` on a device whose host is its compute stream (CPU test doubles)."""
    PAGEABLE_COPY = "async copy with pageable host memory"
    """The host side is not pinned: CUDA completes the copy before returning."""
    CROSS_DEVICE_COPY = "synchronous cross-device fallback copy"
    """The device side lives on another device than the engine's copy stream."""
    ENGINE_DRAIN = "copy stream drained"
    """``TransferEngine.synchronize`` (exception paths, ``sync_all_transfers``)."""


class HostSyncCounter:
    """Counts host blocks by reason; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def record(self, reason: str) -> None:
        """Count one host block for ``reason``."""
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def by_reason(self) -> dict[str, int]:
        """A copy of the counts, per reason."""
        with self._lock:
            return dict(self._counts)

    def __repr__(self) -> str:
        counts = self.by_reason()
        detail = ", ".join(f"{reason}: {n}" for reason, n in sorted(counts.items()))
        return f"HostSyncCounter({sum(counts.values())}{' — ' + detail if detail else ''})"


@dataclass(frozen=True)
class RuntimeStats:
    """Invariant: ``host_syncs == sum(host_syncs_by_reason.values())``."""

    host_syncs: int
    """Times the runtime blocked the host (0 on the normal path)."""
    host_syncs_by_reason: Mapping[str, int]
    pool: PoolStats
    """The host pool's figures (pinned bytes, pageable fallbacks, hits/misses)."""
    transfers_in_flight: int
    extra: Mapping[str, object] = field(default_factory=dict)

    @property
    def pageable_fallbacks(self) -> int:
        """Host buffers served from pageable memory (each copy through one blocks)."""
        return self.pool.pageable_fallbacks

    def summary(self) -> dict[str, object]:
        """Flat, JSON-friendly figures."""
        return {
            "host_syncs": self.host_syncs,
            "host_syncs_by_reason": dict(self.host_syncs_by_reason),
            "transfers_in_flight": self.transfers_in_flight,
            **{f"pool_{key}": value for key, value in self.pool.summary().items()},
            **self.extra,
        }

    def __str__(self) -> str:
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self.host_syncs_by_reason.items()))
        return (
            f"host syncs: {self.host_syncs}{f' ({reasons})' if reasons else ''}; "
            f"{self.transfers_in_flight} transfer(s) in flight; {self.pool}"
        )


def runtime_stats(
    counters: Iterable[HostSyncCounter], pool: PoolStats, transfers_in_flight: int
) -> RuntimeStats:
    """Merge the host-sync counters of several engines into one snapshot."""
    merged: dict[str, int] = {}
    for counter in counters:
        for reason, count in counter.by_reason().items():
            merged[reason] = merged.get(reason, 0) + count
    return RuntimeStats(sum(merged.values()), merged, pool, transfers_in_flight)


@dataclass(frozen=True)
class PoolStats:
    """Snapshot of a pool's bookkeeping; ``pinned_*`` count the pool's own buffers at the
    bytes they really pin (:func:`~.pinned_pool.pinned_cost` when ``pinned``; their capacity else)."""

    pinned: bool
    """Whether pool-owned buffers are page-locked."""
    pinned_bytes_in_use: int
    """Capacity of pool-owned buffers handed out and not yet released."""
    pinned_bytes_pending: int
    """Capacity of released pool-owned buffers whose event has not completed yet."""
    pinned_bytes_cached: int
    """Capacity of free pool-owned buffers ready for reuse."""
    pinned_bytes_peak: int
    """Peak of in-use + pending + cached (the pool's footprint) since creation."""
    pageable_bytes_in_use: int
    """Bytes of pageable fallback buffers handed out and not yet released."""
    pageable_fallbacks: int
    """How many requests were served with pageable memory (cap reached or pin failed)."""
    hits: int
    """Requests served from a cached buffer."""
    misses: int
    """Requests that needed a new allocation (pool-owned or pageable)."""
    buffers_in_use: int
    """Buffers (pool-owned and pageable) handed out and not yet released."""
    pending_releases: int
    """Released buffers (pool-owned and pageable) still waiting for their event."""
    host_allocator_pinned_bytes: int | None = None
    """What the accelerator's caching host allocator holds for the whole process (active
    + cached pinned blocks, ``torch.cuda.host_memory_stats()['allocated_bytes.current']``);
    ``None`` where no such statistic exists (CPU, unpinned pools)."""

    def summary(self) -> dict[str, object]:
        """The figures a user needs, as one flat dict (JSON-friendly)."""
        return {
            "pinned": self.pinned,
            "pinned_bytes_held": self.pinned_bytes_held,
            "pinned_bytes_peak": self.pinned_bytes_peak,
            "pageable_fallbacks": self.pageable_fallbacks,
            "pageable_bytes_in_use": self.pageable_bytes_in_use,
            "hits": self.hits,
            "misses": self.misses,
            "host_allocator_pinned_bytes": self.host_allocator_pinned_bytes,
        }

    def __str__(self) -> str:
        host = self.host_allocator_pinned_bytes
        return (
            f"host pool: {self.pinned_bytes_held} B {'pinned' if self.pinned else 'pooled'} "
            f"(peak {self.pinned_bytes_peak} B), {self.pageable_fallbacks} pageable "
            f"fallback(s) ({self.pageable_bytes_in_use} B in use), {self.hits} hits / "
            f"{self.misses} misses"
            + ("" if host is None else f", torch host allocator holds {host} B")
        )

    @property
    def pinned_bytes_held(self) -> int:
        """Everything the pool owns right now: in use + pending + cached."""
        return self.pinned_bytes_in_use + self.pinned_bytes_pending + self.pinned_bytes_cached
