"""``HostSyncCounter``: how many times the runtime blocked the host, and why.

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

__all__ = ["HostSyncCounter", "SyncReason"]


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
