"""Op limits that may differ per storage: where a reload may start, where a release may go.

A compile region's trace has one limit for every storage: no reload before the first
backward op, no release after the last forward op (a region's backward graph cannot run
a copy before it starts; its forward graph must have freed its bytes by its end). A
*step* laid out as one trace (several regions and invocations, :mod:`..plan.step.layout`)
has one such pair per invocation, so each storage has its own.

:data:`OpLimit` is either form: an ``int`` (every storage) or a mapping from storage to
op (a storage it does not name has no limit: the caller's default). Pure; no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Union

from .trace import StorageId

__all__ = ["OpLimit", "op_limit"]

OpLimit = Union[int, Mapping[StorageId, int]]
"""One op for every storage, or one per storage (see the module docstring)."""


def op_limit(limit: OpLimit | None, storage: StorageId, default: int) -> int:
    """``limit`` for ``storage``: the int itself, the mapping's entry, else ``default``."""
    if limit is None:
        return default
    if isinstance(limit, int):
        return limit
    return limit.get(storage, default)
