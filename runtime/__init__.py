"""Everything that moves bytes: devices, transfer ops, host pool, residency manager.

Public here (``__all__``) is what the front doors, benchmarks, examples and users build
with: the two schedule executors (:class:`ResidencyManager`, :class:`TransferRuntime`),
the pinned host pool and its stats, the copy engine and its ``Transfer`` handles, device
queries, the bandwidth probe, the device-memory meter (with the host labels it honours),
the run statistics, and every error and warning the runtime raises (defined in
:mod:`hyper_offload.errors`).

Helpers stay in their defining submodule and are imported from there, never from this
package: the op handles and ``dense_layout`` (declared in :mod:`hyper_offload.passes.ir.ops`,
which the pure passes import, and re-exported by :mod:`.ops` with the real kernels), buffer states
(:mod:`.physical_buffer`), host-sync accounting (:mod:`.stats`), pool sizing
(``bucket_bytes``, ``pinned_cost`` in :mod:`.pinned_pool`), host-copy states
(:mod:`.transfer_records`), ``current_transfer_runtime`` (:mod:`.transfer_context`),
``current_keep`` (:mod:`.transfer_records`), ``DeviceTimer`` (:mod:`.device`), the
saved-bytes readers (:mod:`.saved_bytes`; :mod:`hyper_offload.compiler` re-exports them).

Invariant: importing this package imports none of its submodules (nor torch). Each
public name is loaded on first access (PEP 562), so ``from hyper_offload.runtime import
DataLostError`` loads nothing of the pool, engines or residency manager. In particular
importing the package does not register the real kernels of the ``hyper_offload`` ops:
code that runs graphs holding them imports :mod:`hyper_offload.runtime.ops` (the compile
backend does).
"""

from __future__ import annotations

from hyper_offload._lazy import lazy_getattr
from hyper_offload.errors import (
    DataLostError,
    OffloadRuntimeError,
    PageableFallbackWarning,
    PoolMisuseError,
    ResidencyMisuseError,
    TransferFailedError,
    TransferMisuseError,
)

# Public name -> defining submodule, loaded on first access (the errors above are
# defined in hyper_offload.errors, a leaf every layer imports).
_LAZY = {
    "DEFAULT_TRANSFER_BANDWIDTH": ".device",
    "TransferBandwidth": ".device",
    "profile_transfer_bandwidth": ".device",
    "Transfer": ".transfer",
    "TransferDirection": ".transfer",
    "TransferEngine": ".transfer",
    "is_accelerator": ".device",
    "pin_memory_available": ".device",
    "resolve_device": ".device",
    "DeviceMemoryMeter": ".memory_meter",
    "MemorySample": ".memory_meter",
    "is_host_labelled": ".memory_meter",
    "label_host": ".memory_meter",
    "PinnedMemoryPool": ".pinned_pool",
    "PoolStats": ".stats",
    "ResidencyManager": ".residency",
    "RuntimeStats": ".stats",
    "TransferRuntime": ".transfer_context",
}

__all__ = [
    "DEFAULT_TRANSFER_BANDWIDTH",
    "DataLostError",
    "DeviceMemoryMeter",
    "MemorySample",
    "OffloadRuntimeError",
    "PageableFallbackWarning",
    "PinnedMemoryPool",
    "PoolMisuseError",
    "PoolStats",
    "ResidencyManager",
    "ResidencyMisuseError",
    "RuntimeStats",
    "Transfer",
    "TransferBandwidth",
    "TransferDirection",
    "TransferEngine",
    "TransferFailedError",
    "TransferMisuseError",
    "TransferRuntime",
    "is_accelerator",
    "is_host_labelled",
    "label_host",
    "pin_memory_available",
    "profile_transfer_bandwidth",
    "resolve_device",
]


__getattr__ = lazy_getattr(__name__, _LAZY)
