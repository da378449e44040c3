"""What the replay checks and keeps per op: the op guide, size drift, and last copies.

``OpGuide``: the per-op facts the eager replay path checks on its hot path.

Built once from a trace so replay never re-parses the trace: for each op, how many
tensor leaves it outputs and which storage each leaf binds to.

``SizeDrift``: replay a plan on a step that runs the same ops with other sizes.

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

``LastCopies``: the replay drops a storage's last copy only once nothing can read it.

A plan frees a storage's bytes for good (``RELEASE_DEVICE`` of a storage with no host
copy, ``RELEASE_HOST`` of an offloaded one) after the last op that uses it: its last
access, or the end of its hold (``ActivationTrace.held_until``: the warmup saw the last
reference die there). In a step that runs its warmup's ops, nothing references the
storage at the next op any more. In a step that does not (a branch that reads an early
activation again, a layer unfrozen so autograd now saves its input, a hook that keeps an
output), something still does, and dropping the bytes would leave it a 0-byte storage:
a later read found "device and host copies were both released" every step, and a kernel
reading it would crash the process (TORCH_NOTES).

So a planned last-copy drop is deferred to the start of the next op
(:meth:`~LastCopies.defer`, :meth:`~LastCopies.settle`): by then the step's own references
are gone in a step that matches its warmup, and the drop happens before the op allocates
(the resident curve stays the plan's). A storage still referenced there is *kept*: its
bytes go to the host instead (as the plan counted them freed, the device curve stays the
plan's; on the device if the host budget has no room), and a later read of it is the
divergence the replay reports (:meth:`~LastCopies.divergence`): it hands the step to a
warmup, before any kernel touches it.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from hyper_offload.errors import ReplayMismatchError
from hyper_offload.passes.ir.schedule import ActionKind, ResidencyAction
from hyper_offload.passes.ir.trace import ActivationTrace, StorageId
from hyper_offload.runtime import ResidencyManager
from hyper_offload.runtime.physical_buffer import BufferState

from .dispatch_mode import owns_storage

__all__ = [
    "LastCopies",
    "OpGuide",
    "OpGuideEntry",
    "Settled",
    "SizeDrift",
    "drop_if_unreferenced",
    "grown_sizes",
    "mismatch_error",
    "short_step_error",
    "wait_for_early_reloads",
]


@dataclass(frozen=True)
class OpGuideEntry:
    """Invariant: ``len(leaf_storages) == output_leaf_count``."""

    name: str
    output_leaf_count: int
    leaf_storages: tuple[StorageId, ...]

    def __repr__(self) -> str:
        return f"{self.name}->{list(self.leaf_storages)}"


@dataclass(frozen=True)
class OpGuide:
    entries: tuple[OpGuideEntry, ...]

    @classmethod
    def from_trace(cls, trace: ActivationTrace) -> OpGuide:
        return cls(
            tuple(
                OpGuideEntry(op.name, len(op.outputs), tuple(op.outputs)) for op in trace.ops
            )
        )

    def __len__(self) -> int:
        return len(self.entries)

    def storage_of_leaf(self, op_index: int, leaf_index: int) -> StorageId:
        return self.entries[op_index].leaf_storages[leaf_index]

    def check_op(self, op_index: int, name: str, leaf_count: int) -> OpGuideEntry:
        """Return the entry for ``op_index`` or raise if the replayed op differs."""
        if op_index < 0:  # a negative index would silently check the last ops
            raise ReplayMismatchError(
                f"replay op {op_index} ({name}): op indices start at 0; count replayed ops "
                "from the start of the step"
            )
        if op_index >= len(self.entries):
            raise ReplayMismatchError(
                f"replay op {op_index} ({name}): the warmup step recorded only "
                f"{len(self.entries)} ops; the model must run the same ops every step "
                "(wrap data-dependent control flow in @skip_offload)"
            )
        entry = self.entries[op_index]
        if entry.name != name or entry.output_leaf_count != leaf_count:
            raise ReplayMismatchError(
                f"replay op {op_index}: warmup recorded {entry.name} with "
                f"{entry.output_leaf_count} output tensors, replay ran {name} with {leaf_count}; "
                "the step's op sequence changed (wrap data-dependent control flow in "
                "@skip_offload, or start a new OffloadSession)"
            )
        return entry

    def leaf_storages(self) -> Sequence[tuple[StorageId, ...]]:
        return [e.leaf_storages for e in self.entries]


def mismatch_error(
    entries: Sequence[OpGuideEntry], index: int, func: Any, found_leaves: int
) -> ReplayMismatchError:
    """The error for replay op ``index`` running ``func`` with ``found_leaves`` output
    leaves where the warmup recorded ``entries`` (the model's ops)."""
    name = func if isinstance(func, str) else str(func)
    fix = ("wrap data-dependent code in @skip_offload, call session.reset() to re-warm, or "
           "set OffloadConfig(rewarm_on_mismatch=True)")
    if index >= len(entries):
        return ReplayMismatchError(
            f"replay op {index}: the warmup step recorded only {len(entries)} ops, but the "
            f"step ran {name} ({found_leaves} output leaves) as op {index}; the model must run "
            f"the same ops every step ({fix})"
        )
    entry = entries[index]
    return ReplayMismatchError(
        f"replay op {index}: warmup recorded {entry.name} with {entry.output_leaf_count} output "
        f"leaves, replay ran {name} with {found_leaves}; the step's op sequence changed "
        f"(another branch or shape). {fix[0].upper()}{fix[1:]}"
    )


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


    def evict(self, manager: ResidencyManager, op: int, loading: Collection[StorageId],
              excess: int, stats: Any) -> int:
        """Move :meth:`victims` of op ``op`` to the host until ``excess`` bytes left the
        device (copy, release, counted in ``stats``: the step's ``StepStats``); the bytes
        moved. The caller holds the dispatch modes off (these copies are no ops of the model)."""
        moved = 0
        for sid in self.victims(manager, op, loading):
            if moved >= excess:
                break
            nbytes = manager.buffer(sid).nbytes
            manager.copy_d2h(sid)
            manager.release_device(sid)
            self.evicted.add(sid)
            moved += nbytes
            stats.evictions += 1
            stats.bytes_d2h += nbytes
            stats.transfers += 1
        return moved
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


class Settled(NamedTuple):
    """What :meth:`LastCopies.settle` did: bytes kept on the device that the plan counts
    freed, bytes copied to the host, and the storages kept (newly) this time."""

    kept_on_device: int
    copied: int
    kept: tuple[StorageId, ...]


class LastCopies:
    """Deferred last-copy drops of one replay step and the storages kept instead.

    Invariant: a storage in :attr:`pending` has the drop named there still to do, and
    is bound in ``manager``; a storage in :attr:`kept` was referenced where its plan
    frees it, and its bytes exist (device or host) until the end of the step."""

    def __init__(self, manager: ResidencyManager) -> None:
        self.manager = manager
        self.pending: dict[StorageId, tuple[ActionKind, int]] = {}
        """Storage -> (the planned drop, the op after which the plan runs it)."""
        self.kept: dict[StorageId, int] = {}
        """Storage -> the op after which its plan dropped it; still referenced there."""

    def __bool__(self) -> bool:
        return bool(self.pending)

    def is_last_copy(self, action: ResidencyAction) -> bool:
        """Whether ``action`` frees the only copy of its storage's bytes."""
        kind = action.kind
        if kind is ActionKind.RELEASE_DEVICE:
            return self.manager.state(action.storage) is BufferState.DEVICE
        if kind is ActionKind.RELEASE_HOST:
            return self.manager.state(action.storage) is BufferState.HOST
        return False

    def defer(self, action: ResidencyAction, op: int) -> None:
        """Drop now if nothing references the storage, else at the next
        :meth:`~LastCopies.settle`."""
        if self.manager.buffer(action.storage).referenced():
            self.pending[action.storage] = (action.kind, op)
        else:
            self.manager.apply(action)

    def settle(self, reading: Collection[int] = ()) -> Settled:
        """Run the pending drops whose storage nothing references any more; keep the
        others (module docstring). ``reading``: ``_cdata`` of the storages the op about
        to run reads: one of those is kept on the device (the read is reported)."""
        manager = self.manager
        kept_on_device = copied = 0
        kept = []
        for sid, (kind, op) in self.pending.items():
            buffer = manager.buffer(sid)
            if not buffer.referenced():
                manager.apply(ResidencyAction(kind, sid))
                continue
            self.kept[sid] = op
            kept.append(sid)
            if kind is ActionKind.RELEASE_HOST:
                continue  # the host copy stays; a read pages it back
            if buffer.storage._cdata not in reading and manager.pool.has_room(buffer.nbytes):
                manager.copy_d2h(sid)
                manager.release_device(sid)
                copied += buffer.nbytes
            else:
                kept_on_device += buffer.nbytes
        self.pending.clear()
        return Settled(kept_on_device, copied, tuple(kept))

    def divergence(self, sids: Iterable[StorageId | None], index: int, where: Any) -> str | None:
        """Why op ``index`` (``where``) is one the plan does not know: the first of ``sids``
        (its inputs) that was kept is read after what its warmup recorded as its last use;
        None if none was kept."""
        for sid in sids:
            if sid is not None and sid in self.kept:
                return (f"replay op {index} ({where}): reads storage {sid}, which its warmup "
                        f"saw freed after op {self.kept[sid]} (its last use); the step runs "
                        "other ops than its warmup (another branch, a layer frozen or unfrozen)")
        return None

    def held_by_communication(self, comm: Collection[StorageId]) -> bool:
        """Whether a collective's buffer (``comm``) among the pending and kept last copies
        is still referenced: a gloo thread holds it a moment past the collective's wait
        (:func:`~.executor_base.settle_communication`)."""
        manager = self.manager
        return any(sid in comm and sid in manager and manager.buffer(sid).referenced()
                   for sid in (*self.pending, *self.kept))

    def still_referenced(self) -> list[StorageId]:
        """Kept storages something still references (at the end of the step: the step
        keeps tensors its warmup saw freed)."""
        manager = self.manager
        return [sid for sid in self.kept
                if sid in manager and manager.buffer(sid).referenced()]


def drop_if_unreferenced(manager: ResidencyManager, sid: StorageId) -> None:
    """A storage moved off the device outside the plan (an online eviction, a kept last
    copy) that nothing references any more: drop both copies (at the end of a step)."""
    if sid in manager and not manager.is_resident(sid) and not manager.buffer(sid).referenced():
        if manager.has_host_copy(sid):
            manager.release_host(sid)
        manager.unbind(sid)


def short_step_error(entries: Sequence[Any], index: int, num_ops: int) -> ReplayMismatchError:
    """The step ended after ``index`` of its plan's ``num_ops`` ops (``entries``: the
    :class:`OpGuide` entries, named by ``.name``)."""
    return ReplayMismatchError(
        f"replay: the step ended after {index} ops, but the warmup step recorded "
        f"{num_ops} (next expected: op {index}, {entries[index].name}); "
        "run the same forward and backward every step, or call session.reset()"
    )


def wait_for_early_reloads(manager: ResidencyManager, loading: dict[int, StorageId],
                           tensors: Iterable[torch.Tensor]) -> int:
    """Make the compute stream wait for the in-flight H2D of every input in ``tensors``
    whose reload started early (``loading``: ``_cdata`` -> id, updated); the waits made."""
    waited = 0
    for tensor in tensors:
        if not owns_storage(tensor):
            continue
        sid = loading.pop(tensor.untyped_storage()._cdata, None)
        if sid is not None:
            with _disable_current_modes():  # a stream wait: never an op of the model
                manager.wait_h2d(sid)
            waited += 1
    return waited
