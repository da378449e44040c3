"""Everything that moves bytes: devices, transfer ops, host pool, residency manager.

Public here (``__all__``) is what the front doors, benchmarks, examples and users build
with: the two schedule executors (:class:`ResidencyManager`, :class:`TransferRuntime`),
the pinned host pool and its stats, the copy engine and its ``Transfer`` handles, device
queries, the bandwidth probe, the device-memory meter (with the host labels it honours),
the run statistics, and every error and warning the runtime raises.

Helpers stay in their defining submodule and are imported from there, never from this
package: the transfer-op handles and ``dense_layout`` (:mod:`.op_declarations`, which the
pure passes import, and :mod:`.ops` with the real kernels), buffer states
(:mod:`.physical_buffer`), host-sync accounting (:mod:`.host_sync`), pool sizing
(``bucket_bytes``, ``pinned_cost`` in :mod:`.pinned_pool`), host-copy states and
``current_transfer_runtime`` (:mod:`.transfer_context`), ``DeviceTimer``
(:mod:`.bandwidth`).

Invariant: importing this package imports none of its submodules. Each public name is
loaded on first access (PEP 562), so ``from hyper_offload.runtime.op_declarations import
COPY_D2H`` in a pass loads the op declarations and nothing of the pool, engines or
residency manager. In particular importing the package no longer registers the real
transfer-op kernels: code that runs graphs holding transfer ops imports
:mod:`hyper_offload.runtime.ops` (the compile backend does).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# Public name -> defining submodule, loaded on first access.
_LAZY = {
    "DEFAULT_TRANSFER_BANDWIDTH": ".bandwidth",
    "TransferBandwidth": ".bandwidth",
    "profile_transfer_bandwidth": ".bandwidth",
    "Transfer": ".device",
    "TransferDirection": ".device",
    "TransferEngine": ".device",
    "is_accelerator": ".device",
    "pin_memory_available": ".device",
    "resolve_device": ".device",
    "DataLostError": ".errors",
    "OffloadRuntimeError": ".errors",
    "PoolMisuseError": ".errors",
    "ResidencyMisuseError": ".errors",
    "TransferFailedError": ".errors",
    "DeviceMemoryMeter": ".memory_meter",
    "MemorySample": ".memory_meter",
    "is_host_labelled": ".memory_meter",
    "label_host": ".memory_meter",
    "PageableFallbackWarning": ".pinned_pool",
    "PinnedMemoryPool": ".pinned_pool",
    "PoolStats": ".pinned_pool",
    "ResidencyManager": ".residency",
    "RuntimeStats": ".stats",
    "TransferMisuseError": ".transfer_context",
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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # cache: later lookups skip __getattr__
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
