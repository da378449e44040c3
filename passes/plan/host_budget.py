"""The host budget: how many bytes a plan keeps alive in host buffers at once.

Offloaded bytes live somewhere: each write epoch with an offloaded gap holds one host
buffer from its ``COPY_D2H`` (``post[d2h_op]``) until its ``RELEASE_HOST`` (``post`` of
its last reload, :mod:`.choice_lowering`). The buffer is a pool bucket
(:func:`~..ir.host.host_bucket_bytes`), not the storage's raw size. Local ranks share one
machine's memory, so a rank's share of it (``OffloadConfig.max_host_activation_mb``) is a
budget like the device's, and a planner must never exceed it: a node that runs out of
host memory dies, where one that keeps a few more bytes on the device (or recomputes
them) only runs slower.

Two pieces, both pure:

* :func:`host_curve`: the independent measure. It simulates ``COPY_D2H`` /
  ``RELEASE_HOST`` of any schedule and returns the bucketed host bytes held at every op
  (and inside every slot): what a plan asks of the host pool.
* :class:`HostLedger`: the planners' bookkeeping. Candidates are offered in the
  planner's order; one is accepted only if its epoch's host interval (extended to its
  reload) stays within the budget at every op it covers. Intervals are counted over ops
  ``d2h_op .. end`` inclusive, one op more than the buffer really lives (it is acquired
  in ``post[d2h_op]``), so the ledger never under-counts :func:`host_curve`.

Invariant (tested with hypothesis): a choice filtered by :func:`fit_host_budget` lowers
to a schedule whose :func:`host_curve` never exceeds the budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from hyper_offload.errors import ConfigurationError

from ..analysis.candidates import OffloadCandidate
from ..ir.host import host_bucket_bytes
from ..ir.schedule import ActionKind, ResidencySchedule
from ..ir.trace import ActivationTrace, StorageId
from .segment_tree import RangeAddMaxTree

__all__ = ["HostCurve", "HostLedger", "fit_host_budget", "host_curve"]


class HostCurve(NamedTuple):
    """Bucketed host bytes held during each op (after its ``pre`` actions); ``peak`` is
    the highest point anywhere, inside ``post`` slots included."""

    values: tuple[int, ...]
    peak: int


_ACQUIRE = (ActionKind.COPY_D2H, ActionKind.LOAD_FROM_DISK)
_GIVE_BACK = (ActionKind.RELEASE_HOST, ActionKind.SPILL_TO_DISK)


def host_curve(trace: ActivationTrace, schedule: ResidencySchedule) -> HostCurve:
    """Simulate the host side of ``schedule``: a ``COPY_D2H`` (or ``LOAD_FROM_DISK``) of
    a storage with no host buffer acquires one bucket, ``RELEASE_HOST`` (or
    ``SPILL_TO_DISK``) gives it back: a buffer counts only while it holds bytes (the rules
    of ``check_schedule``, which judges everything else). The runtime returns a spilled
    buffer once its write completes and waits for pending writes before it takes the pool
    past its cap (:mod:`hyper_offload.runtime.disk_store`), so this curve bounds the
    pool's high-water."""
    held: dict[StorageId, int] = {}
    total = peak = 0
    values = []

    def run(actions: Sequence) -> None:
        nonlocal total, peak
        for action in actions:
            if action.kind in _ACQUIRE and action.storage not in held:
                size = host_bucket_bytes(trace.storage_sizes.get(action.storage, 0))
                held[action.storage] = size
                total += size
                peak = max(peak, total)
            elif action.kind in _GIVE_BACK and action.storage in held:
                total -= held.pop(action.storage)

    for op in range(schedule.num_ops):
        run(schedule.pre[op])
        values.append(total)
        run(schedule.post[op])
    return HostCurve(tuple(values), peak)


class HostLedger:
    """Host bytes per op of the candidates accepted so far (module docstring).

    ``budget_bytes=None`` accepts everything (no host budget) and keeps no tree.
    """

    def __init__(self, num_ops: int, budget_bytes: int | None) -> None:
        if budget_bytes is not None and (
            isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0
        ):
            raise ConfigurationError(
                f"HostLedger: host budget must be None or an int of bytes >= 0, got "
                f"{budget_bytes!r}"
            )
        self.budget_bytes = budget_bytes
        self._tree = None if budget_bytes is None or num_ops == 0 else RangeAddMaxTree(
            [0] * num_ops)
        self._ends: dict[tuple[StorageId, int], int] = {}
        self.rejected = 0
        """How many candidates :meth:`take` refused for want of host room."""

    def _extension(self, cand: OffloadCandidate) -> tuple[int, int] | None:
        """The ops (half-open) ``cand`` adds to its epoch's host interval, if any."""
        end = self._ends.get(cand.epoch)
        if end is None:
            return cand.d2h_op, cand.end + 1
        return (end + 1, cand.end + 1) if cand.end > end else None

    def fits(self, cand: OffloadCandidate) -> bool:
        """Whether accepting ``cand`` keeps every op within the host budget."""
        if self._tree is None:
            return True
        extension = self._extension(cand)
        if extension is None:
            return True
        size = host_bucket_bytes(cand.size)
        return self._tree.max(*extension) + size <= self.budget_bytes

    def take(self, cand: OffloadCandidate) -> bool:
        """Accept ``cand`` if it fits (recording its host interval); False, and counted in
        :attr:`rejected`, if it does not."""
        if not self.fits(cand):
            self.rejected += 1
            return False
        extension = self._extension(cand)
        if extension is not None:
            if self._tree is not None:
                self._tree.add(*extension, host_bucket_bytes(cand.size))
            self._ends[cand.epoch] = cand.end
        return True


def fit_host_budget(
    num_ops: int, chosen: Sequence[OffloadCandidate], budget_bytes: int | None
) -> tuple[list[OffloadCandidate], int]:
    """``chosen`` without the candidates that would break the host budget, taken in the
    given order (the planner's priority): ``(kept, how many were dropped)``."""
    if budget_bytes is None:
        return list(chosen), 0
    ledger = HostLedger(num_ops, budget_bytes)
    kept = [cand for cand in chosen if ledger.take(cand)]
    return kept, ledger.rejected
