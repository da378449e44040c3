"""Per-storage limits of a plan: where an op limit lies, what a host buffer holds.

Op limits that may differ per storage: where a reload may start, where a release may go.

A compile region's trace has one limit for every storage: no reload before the first
backward op, no release after the last forward op (a region's backward graph cannot run
a copy before it starts; its forward graph must have freed its bytes by its end). A
*step* laid out as one trace (several regions and invocations, :mod:`..plan.step.layout`)
has one such pair per invocation, so each storage has its own.

:data:`OpLimit` is either form: an ``int`` (every storage) or a mapping from storage to
op (a storage it does not name has no limit: the caller's default). Pure; no torch.

What an offloaded storage costs on the host: the bytes of the buffer that holds it.

The runtime's host pool (:mod:`hyper_offload.runtime.pinned_pool`) serves every request
from a power-of-two size bucket, so a plan that counts raw storage bytes under-counts
what the host really holds (up to 2x). Planners that keep a host budget count
:func:`host_bucket_bytes` instead; the pool imports the same function, so the two can
never disagree. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Union

from .trace import StorageId

__all__ = [
    "MAX_BUCKET_BYTES",
    "MIN_BUCKET_BYTES",
    "OpLimit",
    "host_bucket_bytes",
    "op_limit",
]


MIN_BUCKET_BYTES = 1 << 10
MAX_BUCKET_BYTES = 1 << 31


def host_bucket_bytes(nbytes: int) -> int:
    """Capacity of the host buffer that serves a request of ``nbytes``.

    A power of two in ``[MIN_BUCKET_BYTES, MAX_BUCKET_BYTES]``, or ``nbytes`` itself for
    requests above ``MAX_BUCKET_BYTES`` (a dedicated buffer of exactly that size).
    """
    if nbytes > MAX_BUCKET_BYTES:
        return nbytes
    return max(MIN_BUCKET_BYTES, 1 << max(0, nbytes - 1).bit_length())


OpLimit = Union[int, Mapping[StorageId, int]]
"""One op for every storage, or one per storage (see the module docstring)."""


def op_limit(limit: OpLimit | None, storage: StorageId, default: int) -> int:
    """``limit`` for ``storage``: the int itself, the mapping's entry, else ``default``."""
    if limit is None:
        return default
    if isinstance(limit, int):
        return limit
    return limit.get(storage, default)
