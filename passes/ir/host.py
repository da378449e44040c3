"""What an offloaded storage costs on the host: the bytes of the buffer that holds it.

The runtime's host pool (:mod:`hyper_offload.runtime.pinned_pool`) serves every request
from a power-of-two size bucket, so a plan that counts raw storage bytes under-counts
what the host really holds (up to 2x). Planners that keep a host budget count
:func:`host_bucket_bytes` instead; the pool imports the same function, so the two can
never disagree. Pure: no torch.
"""

from __future__ import annotations

__all__ = ["MAX_BUCKET_BYTES", "MIN_BUCKET_BYTES", "host_bucket_bytes"]

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
