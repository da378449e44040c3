"""Errors raised by the runtime layer.

Every runtime error names *where* it broke (the object and storage id or buffer), *which
rule* was violated, and *how to fix it*. Misuse and failure are separate types so that a
caller can tell "you called this in the wrong state" (a bug in the caller or the
schedule) from "a copy failed" (the hardware or allocator said no; state was rolled back).
"""

from __future__ import annotations


__all__ = [
    "DataLostError",
    "OffloadRuntimeError",
    "PoolMisuseError",
    "ResidencyMisuseError",
    "TransferFailedError",
]


class OffloadRuntimeError(RuntimeError):
    """Base class of every error the runtime layer raises on purpose."""


class PoolMisuseError(OffloadRuntimeError):
    """A :class:`~hyper_offload.runtime.pinned_pool.PinnedMemoryPool` rule was broken
    (double release, releasing a buffer the pool never handed out, ...)."""


class ResidencyMisuseError(OffloadRuntimeError):
    """A residency state-machine rule was broken (H2D without a host copy, releasing a
    storage twice, an unknown storage id, ...). Nothing was changed."""


class TransferFailedError(OffloadRuntimeError):
    """A copy between device and host failed. The message says which copy of the data is
    still valid; the state was rolled back so that no transfer is in flight and no buffer
    is leaked. The original exception is chained as ``__cause__``."""


class DataLostError(OffloadRuntimeError):
    """The bytes of a storage were requested but neither a device nor a host copy exists
    any more (both were released). Raised instead of handing out garbage."""


class SwapStateError(OffloadRuntimeError):
    """A pipeline swap step ran out of order, or a swapped-out activation was read before
    its wait-load step. Raised before any kernel touches the missing bytes."""
