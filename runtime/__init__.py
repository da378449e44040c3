"""Everything that moves bytes: devices, transfer ops, host pool, residency manager.

Importing this package registers the ``hyper_offload::`` transfer custom ops.
"""

from . import ops  # noqa: F401  (registers the hyper_offload:: transfer ops)
from .bandwidth import (
    DEFAULT_TRANSFER_BANDWIDTH,
    DeviceTimer,
    TransferBandwidth,
    profile_transfer_bandwidth,
)
from .device import (
    Transfer,
    TransferDirection,
    TransferEngine,
    is_accelerator,
    pin_memory_available,
    resolve_device,
)
from .errors import (
    DataLostError,
    OffloadRuntimeError,
    PoolMisuseError,
    ResidencyMisuseError,
    TransferFailedError,
)
from .host_sync import HostSyncCounter, SyncReason
from .memory_meter import DeviceMemoryMeter, MemorySample, is_host_labelled, label_host
from .ops import COPY_D2H, COPY_H2D, RELEASE_HOST, TRANSFER_OPS, WAIT_TRANSFER, dense_layout
from .physical_buffer import BufferState, PhysicalBuffer
from .pinned_pool import (
    PageableFallbackWarning,
    PinnedMemoryPool,
    PoolStats,
    bucket_bytes,
    pinned_cost,
)
from .residency import ResidencyManager
from .stats import RuntimeStats
from .transfer_context import (
    HostCopyState,
    TransferMisuseError,
    TransferRuntime,
    current_transfer_runtime,
)

__all__ = [
    "BufferState",
    "COPY_D2H",
    "COPY_H2D",
    "DEFAULT_TRANSFER_BANDWIDTH",
    "DataLostError",
    "DeviceMemoryMeter",
    "DeviceTimer",
    "HostCopyState",
    "HostSyncCounter",
    "MemorySample",
    "OffloadRuntimeError",
    "PageableFallbackWarning",
    "PhysicalBuffer",
    "PinnedMemoryPool",
    "PoolMisuseError",
    "PoolStats",
    "RELEASE_HOST",
    "ResidencyManager",
    "ResidencyMisuseError",
    "RuntimeStats",
    "SyncReason",
    "TRANSFER_OPS",
    "Transfer",
    "TransferBandwidth",
    "TransferDirection",
    "TransferEngine",
    "TransferFailedError",
    "TransferMisuseError",
    "TransferRuntime",
    "WAIT_TRANSFER",
    "bucket_bytes",
    "current_transfer_runtime",
    "dense_layout",
    "is_accelerator",
    "is_host_labelled",
    "label_host",
    "pin_memory_available",
    "pinned_cost",
    "profile_transfer_bandwidth",
    "resolve_device",
]
