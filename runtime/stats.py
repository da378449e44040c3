"""``RuntimeStats``: one snapshot of what the runtime did, for every stats view.

Both executors of a schedule (:class:`~hyper_offload.runtime.residency.ResidencyManager`
and :class:`~hyper_offload.runtime.transfer_context.TransferRuntime`) return it from
``stats()``, so a front door prints the same figures whichever path ran: host blocks
(with reasons), the host pool's figures including its pageable fallbacks, and the
transfers still in flight.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .host_sync import HostSyncCounter
from .pinned_pool import PoolStats

__all__ = ["RuntimeStats", "runtime_stats"]


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
