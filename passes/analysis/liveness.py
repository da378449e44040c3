"""Liveness of a trace without any offload: per-storage intervals and the bytes curve.

Under the residency model of :mod:`..ir.trace`, a storage is on the device from its first
access to its last access (inclusive), or to the end of the step when it is retained, or
to the end of op ``held_until[s]`` when a reference holds it past its last access (then
an offload of that last stretch needs no reload: see :mod:`.candidates`).
Between two consecutive accesses lies a *gap*: the ops strictly between them are the
ones an offload of that gap can relieve.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

from ..ir.trace import AccessKind, ActivationTrace, StorageId


@dataclass(frozen=True)
class StorageLiveness:
    """Invariant: ``first <= last < end``; ``end`` is exclusive (``last + 1``, ``held_until
    + 1`` for a held storage, or num_ops for a retained one)."""

    storage: StorageId
    size: int
    first: int
    last: int
    end: int
    retained: bool
    accesses: tuple[tuple[int, AccessKind], ...]

    def __repr__(self) -> str:
        return f"s{self.storage}[{self.first},{self.end}) {self.size}B"


class Gap(NamedTuple):
    """Ops ``start + 1 .. end - 1`` lie between two consecutive accesses of ``storage``."""

    storage: StorageId
    start: int
    end: int

    def __repr__(self) -> str:
        return f"gap(s{self.storage}: {self.start}->{self.end})"

    @property
    def covered(self) -> range:
        return range(self.start + 1, self.end)


class InfeasibleOp(NamedTuple):
    """An op whose unavoidable bytes exceed the budget by ``excess_bytes``."""

    op_index: int
    required_bytes: int
    excess_bytes: int


def storage_liveness(trace: ActivationTrace) -> dict[StorageId, StorageLiveness]:
    """The device lifetime of every accessed storage when nothing is offloaded (a new
    dict each call; computed once per trace)."""
    return dict(trace.memo("storage_liveness", lambda: _storage_liveness(trace)))


def _storage_liveness(trace: ActivationTrace) -> dict[StorageId, StorageLiveness]:
    result = {}
    for storage in trace.accessed_storages():
        accesses = trace.accesses_of(storage)
        retained = storage in trace.retained
        last = accesses[-1][0]
        result[storage] = StorageLiveness(
            storage=storage,
            size=trace.storage_sizes[storage],
            first=accesses[0][0],
            last=last,
            end=trace.num_ops if retained else trace.held_end(storage) + 1,
            retained=retained,
            accesses=accesses,
        )
    return result


def access_gaps(trace: ActivationTrace) -> list[Gap]:
    """Every gap that covers at least one op, ordered by storage then position."""
    gaps = []
    for storage in trace.accessed_storages():
        ops = [index for index, _ in trace.accesses_of(storage)]
        gaps.extend(Gap(storage, a, b) for a, b in zip(ops, ops[1:]) if b - a >= 2)
    return gaps


def resident_bytes_without_offload(trace: ActivationTrace) -> list[int]:
    """Device bytes during each op when every storage lives over its full interval."""
    delta = [0] * (trace.num_ops + 1)
    for live in storage_liveness(trace).values():
        delta[live.first] += live.size
        delta[live.end] -= live.size
    return list(accumulate(delta[:-1]))


def required_bytes(trace: ActivationTrace) -> list[int]:
    """Bytes no schedule can move off the device during each op.

    That is the op's own operands plus retained storages past their last access (they
    must still be on the device at the end of the step, and offload only happens in
    gaps between accesses). A held storage past its last access is no part of it: its
    last stretch may be offloaded without a reload. A door that can reload retained
    storages at the end of its step lists them as read by a final op instead
    (:func:`~..ir.step_end.with_step_end`), which frees them here too. A new list
    each call; computed once per trace.
    """
    return list(trace.memo("required_bytes", lambda: _required_bytes(trace)))


def _required_bytes(trace: ActivationTrace) -> tuple[int, ...]:
    delta = [0] * (trace.num_ops + 1)
    for live in storage_liveness(trace).values():
        if live.retained and live.last + 1 < trace.num_ops:
            delta[live.last + 1] += live.size
            delta[trace.num_ops] -= live.size
    held = accumulate(delta[:-1])
    return tuple(trace.operand_bytes(i) + h for i, h in zip(range(trace.num_ops), held))


def infeasible_ops(trace: ActivationTrace) -> list[InfeasibleOp]:
    """Ops that cannot meet ``trace.budget_bytes`` under any schedule."""
    return [
        InfeasibleOp(i, need, need - trace.budget_bytes)
        for i, need in enumerate(required_bytes(trace))
        if need > trace.budget_bytes
    ]
