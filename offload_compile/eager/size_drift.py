"""``SizeDrift``: replay a plan on a step that runs the same ops with other sizes.

MoE routing (how many tokens each expert gets) and packed or bucketed batches change
tensor sizes every step while the op sequence stays the warmup's. The plan's decisions
(which storage moves where) still apply: copies are copies, whatever their size. What
no longer holds is its byte count. The rule:

* **Within the planned sizes** (every storage at most as large as the plan assumed) the
  plan keeps its predicted peak: the resident curve only grows with the sizes, so the
  step runs the plan as it is.
* **A storage larger than planned** puts the step at risk of the budget. From the first
  such storage on, before each op the replay makes room the way the warmup does
  (online eviction: copy to the host and free the storage whose next use is furthest
  away, never one the op or an in-flight collective reads; a later read pages it back)
  until the op's outputs (sized from its real arguments) fit under the budget, or
  under the plan's own bytes at that op where the plan itself is over the budget (an op
  whose operands do not fit).
  Evictions are counted in ``StepStats.evictions``. Planned actions the eviction made
  moot (a copy of a storage already on the host, a release of one already released)
  are skipped.
* **The plan is remade when it no longer holds the budget by itself**: at the end of a
  step that had to evict online (a larger step that still fit needs nothing), for each
  storage's largest size seen (:func:`grown_sizes`): same trace structure, planning
  only, no re-trace. A re-plan raises the sizes planned for, so each one answers a new
  maximum; sizes converge and later steps run the plan without evictions. Only a
  different op sequence re-warms (or raises), as before.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping

from hyper_offload.passes.ir.schedule import ActionKind, ResidencyAction
from hyper_offload.passes.ir.trace import ActivationTrace, StorageId
from hyper_offload.runtime import ResidencyManager

__all__ = ["SizeDrift", "grown_sizes"]


class SizeDrift:
    """One replay step's storages whose sizes differ from the plan's, and what the
    online eviction did about them.

    Invariant: ``evicted`` holds the storages this step moved to the host outside the
    plan; :meth:`applicable` is true for every planned action of any other storage.
    """

    def __init__(self, trace: ActivationTrace) -> None:
        self.trace = trace
        self.observed: dict[StorageId, int] = {}
        """Storage -> bytes this step, where they differ from the plan's."""
        self.evicted: set[StorageId] = set()
        self.grown = False
        """Whether a storage of this step is larger than the plan assumed (from then on
        the replay makes room before each op)."""
        self._uses: dict[StorageId, list[int]] | None = None

    @property
    def needs_replan(self) -> bool:
        """The step had to evict outside the plan: the plan is remade at its end."""
        return bool(self.evicted)

    def note(self, sid: StorageId, nbytes: int) -> None:
        self.observed[sid] = nbytes
        self.grown = self.grown or nbytes > self.trace.storage_sizes[sid]

    def victims(
        self, manager: ResidencyManager, op: int, busy: Collection[StorageId]
    ) -> list[StorageId]:
        """Resident storages op ``op`` does not access, furthest next use first (never
        used again: first of all); ``busy`` ones (a reload in flight) are left alone."""
        if self._uses is None:
            self._uses = {}
            for index, trace_op in enumerate(self.trace.ops):
                for access in trace_op.accesses:
                    self._uses.setdefault(access.storage, []).append(index)
        protected = {access.storage for access in self.trace.ops[op].accesses}
        ranked = []
        for sid in manager:
            if sid in protected or sid in busy or not manager.is_resident(sid):
                continue
            uses = self._uses.get(sid, [])
            later = bisect.bisect_left(uses, op)
            ranked.append((uses[later] if later < len(uses) else len(self.trace.ops), sid))
        return [sid for _, sid in sorted(ranked, reverse=True)]

    def applicable(self, manager: ResidencyManager, action: ResidencyAction) -> bool:
        """Whether a planned action still applies after the online eviction."""
        sid = action.storage
        if sid not in self.evicted:
            return True
        kind = action.kind
        if kind in (ActionKind.COPY_D2H, ActionKind.RELEASE_DEVICE, ActionKind.WAIT_H2D):
            return manager.is_resident(sid)  # evicted and not paged back: done, or moot
        if kind in (ActionKind.RELEASE_HOST, ActionKind.SPILL_TO_DISK):
            return manager.has_host_copy(sid)
        if kind is ActionKind.RELEASE_DISK:
            return manager.on_disk(sid)
        return True  # COPY_H2D, LOAD_FROM_DISK (skipped when the bytes are there already)


def grown_sizes(trace: ActivationTrace, observed: Mapping[StorageId, int]) -> dict[StorageId, int]:
    """Each storage's largest size seen: the plan's, or this step's where larger."""
    sizes = dict(trace.storage_sizes)
    for sid, nbytes in observed.items():
        sizes[sid] = max(sizes[sid], nbytes)
    return sizes
