"""``ReplayExecutor``: run the planned ``ResidencySchedule`` around the replayed ops.

Design section 4.3. For op ``i`` of the step::

    check func is the op warmup recorded at i      (identity compare: the hot path)
    run schedule.pre[i] through the ResidencyManager (COPY_H2D, WAIT_H2D)
    guard the inputs (an offloaded input is demand-paged; a released one raises)
    run the op
    bind each fresh output storage under the id the OpGuide names for (i, leaf)
    check the output leaves against the OpGuide (count and storage ids)
    run schedule.post[i] (COPY_D2H, RELEASE_DEVICE, RELEASE_HOST)

Every storage the step creates is bound in the manager, so the schedule can free its
device bytes right after its last use (``RELEASE_DEVICE`` resizes it to 0 bytes) even
while autograd still holds tensors on it; the manager keeps the storage objects (not
their bytes) until the end of the step. The resident-bytes curve after each op is
therefore exactly what ``check_schedule`` predicts for the plan.

Early reloads. The schedule comes from the shared planning pipeline, which places a
reload's ``COPY_H2D`` several ops before the ``WAIT_H2D`` of the op that reads it, so the
copy overlaps those ops. The trace guarantees none of them reads the storage, and the
bytes count as resident from the COPY_H2D on (as ``check_schedule`` counts them). A read
the trace could not see (a closure inside an opaque region) of a storage whose H2D is
still in flight first makes the compute stream wait for that H2D (:meth:`guard`), so
no kernel reads half-copied bytes; the planned WAIT_H2D then costs nothing.

A structural mismatch raises :class:`~hyper_offload.passes.ReplayMismatchError` naming
the op index, the expected and found op and their output leaf counts. The offending
op has already run by then (its inputs were guarded, so it never read released bytes)
so that its leaf count can be reported; no schedule action runs for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from hyper_offload.errors import ReplayMismatchError
from hyper_offload.passes.ir.schedule import ActionKind, ResidencyAction
from hyper_offload.passes.ir.trace import StorageId
from hyper_offload.passes.plan.protocol import ResidencyPlanner
from hyper_offload.runtime import ResidencyManager
from hyper_offload.runtime.physical_buffer import BufferState

from .dispatch_mode import flat_tensors, owns_storage, result_tensors, tensor_leaves
from .executor_base import BaseExecutor, OffloadSessionError, settle_communication
from .op_guide import OpGuide
from .size_drift import SizeDrift, grown_sizes
from .warmup import WarmupExecutor, WarmupResult, estimate_new_bytes, replan

__all__ = ["ReplayExecutor"]


class ReplayExecutor(BaseExecutor):
    phase = "replay"

    def __init__(
        self,
        manager: ResidencyManager,
        device: torch.device,
        plan: WarmupResult,
        *,
        rewarm: Callable[[str], WarmupExecutor] | None = None,
        planner: ResidencyPlanner | None = None,
    ) -> None:
        """``rewarm(reason)``: on a structural mismatch, build a warmup executor that takes
        the step over (the session settling, or ``OffloadConfig.rewarm_on_mismatch``);
        ``None`` raises instead.
        ``planner``: remakes the plan after a step with larger sizes (:mod:`.size_drift`)."""
        super().__init__(manager, device)
        self.plan = plan
        self.rewarm = rewarm
        self.successor: WarmupExecutor | None = None
        """The warmup executor that took the step over after a mismatch, if any."""
        self._call: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None
        self.guide = OpGuide.from_trace(plan.trace)
        self._entries = self.guide.entries
        self._funcs = plan.funcs
        self._pre = plan.replay_pre
        self._post = plan.replay_post
        self._virtual = plan.virtual_delta
        """Op -> (bytes an opaque region's forward op holds from there, bytes released
        after the op): counted like the warmup counted them (.region_saved)."""
        self._held = 0
        self._num_ops = len(self._funcs)
        self._sizes = plan.trace.storage_sizes
        self._hand_back = plan.hand_back
        self._foreign = plan.foreign
        self._foreign_refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        """``_cdata`` -> FSDP's buffers this step created (weakly: an address may be
        reused once one dies)."""
        self.drift = SizeDrift(plan.trace)
        """Sizes that differ from the plan's this step, and the online eviction's doing."""
        self.planner = planner
        self._keys: Any = set()
        self._mismatched: Any = None  # the unexpected func, while it runs
        self._loading: dict[int, StorageId] = {}
        """``_cdata`` -> id of storages whose COPY_H2D ran and whose WAIT_H2D has not."""
        self.early_reload_waits = 0
        """Reads of a storage with an H2D in flight that waited for it in :meth:`guard`
        (reads the trace did not record; 0 for a step that matches its trace)."""

    def on_op_begin(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        i = self.index
        if i >= self._num_ops or (func is not self._funcs[i] and func != self._funcs[i]):
            if self.op_error is not None:
                # An op raised and its error is propagating (or was caught): ops of the
                # unwinding (a profiler's record_function exit) are no mismatch of the
                # step. Stop replaying; the error in flight stays the one raised.
                self.failed = True
                self.guard(func, flat_tensors(args, kwargs))
                return
            self._mismatched = func  # run it (guarded), then report its leaf count too
        else:
            pre = self._pre[i]
            if pre:
                self.apply_actions(pre)
            if self.drift.grown:
                self._make_room(i, func, args, kwargs)
        if self.rewarm is not None:
            self._call = (func, args, kwargs)
        inputs = flat_tensors(args, kwargs)
        self._keys = self.guard(func, inputs)
        if isinstance(func, str):  # a virtual op: inputs may die inside the region
            self._keys = self.live_inputs(inputs, self.device)

    def on_op_end(self, result: Any) -> Any:
        if self.rewarm is None:
            return self._end_op(result)
        try:
            result = self._end_op(result)
        except ReplayMismatchError as error:
            if self.opaque_depth or self.backward_regions or self._call is None:
                raise  # inside an opaque region: no safe point to hand the step over
            return self._hand_over(result, str(error))
        self._call = None  # holds the op's arguments: never past the op
        return result

    def _hand_over(self, result: Any, reason: str) -> Any:
        """Let a warmup executor record the rest of the step (re-warm on mismatch)."""
        assert self.rewarm is not None and self._call is not None
        successor = self.rewarm(reason)
        successor.continue_from(self.plan, self.index, self.bound)
        successor.stats.demand_loads = self.stats.demand_loads
        self.successor = successor
        self.closed = True
        func, args, kwargs = self._call
        self._call = None
        successor.on_op_begin(func, args, kwargs)
        return successor.on_op_end(result)

    def _end_op(self, result: Any) -> Any:
        i = self.index
        if self._mismatched is not None:
            func, self._mismatched = self._mismatched, None
            self._raise_mismatch(func, self._count_leaves(result))
        expected = self._entries[i].leaf_storages
        bound = self.bound
        keys = self._keys
        on_device = self.on_device
        found = 0
        for tensor in result_tensors(result):
            if not on_device(tensor) or not owns_storage(tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            sid = bound.get(key)
            if sid is None:
                if self.is_input_alias(storage, keys) or self._is_foreign(storage):
                    continue  # alias of a storage that existed before the step, or FSDP's
                if found >= len(expected) or expected[found] in self.manager:
                    self._raise_mismatch(self._funcs[i], self._count_leaves(result))
                sid = expected[found]
                if sid in self._foreign:  # FSDP's buffer: left in place, never bound
                    self._foreign_refs[key] = weakref.ref(storage)
                    found += 1
                    continue
                if storage.nbytes() != self._sizes[sid]:  # same op, other sizes
                    self.drift.note(sid, storage.nbytes())
                self.manager.bind(sid, tensor)
                bound[key] = sid
                self._resident += storage.nbytes()
            elif found >= len(expected) or expected[found] != sid:
                self._raise_mismatch(self._funcs[i], self._count_leaves(result))
            elif storage.nbytes() != self.manager.buffer(sid).nbytes:  # the op resized it
                self._resident += self.manager.adopt_resize(sid)
                self.drift.note(sid, storage.nbytes())
            found += 1
        if found != len(expected):
            self._raise_mismatch(self._funcs[i], found)
        virtual = self._virtual.get(i) if self._virtual else None
        if virtual is not None:
            self._count_region_bytes(virtual[0], 0)
        self.sample()
        if virtual is not None:
            self._count_region_bytes(0, -virtual[1])
        post = self._post[i]
        if post:
            self.apply_actions(post)
        if i in self._hand_back:
            self._return_gradients(self._hand_back[i])
        self.index = i + 1
        return result

    def _count_region_bytes(self, made: int, freed: int) -> None:
        """Count the bytes an opaque region holds (``made``), or no longer (``freed``
        negative: after the op is sampled, as the plan's release)."""
        self._resident += made + freed
        self._held += made + freed
        self.stats.region_bytes = max(self.stats.region_bytes, self._held)

    def _return_gradients(self, sids: tuple[StorageId, ...]) -> None:
        """After an ``AccumulateGrad`` op: the incoming gradients it read last are
        autograd's again (``.grad`` keeps one, or it dies at once: not held to the step's
        end by the manager; the plan counts it to the end, retained)."""
        manager = self.manager
        with _disable_current_modes():
            for sid in sids:
                if sid in manager and manager.is_resident(sid):
                    key = manager.buffer(sid).storage._cdata
                    manager.unbind(sid)
                    self.bound.pop(key, None)

    def _is_foreign(self, storage: torch.UntypedStorage) -> bool:
        if not self._foreign_refs:
            return False
        ref = self._foreign_refs.get(storage._cdata)
        return ref is not None and ref() is storage

    # ------------------------------------------------------------------ early reloads

    def apply_actions(self, actions: tuple[ResidencyAction, ...]) -> None:
        """Run schedule actions and keep :attr:`_loading` (reloads in flight) current."""
        if self.drift.evicted:
            actions = tuple(a for a in actions if self.drift.applicable(self.manager, a))
        super().apply_actions(actions)
        for action in actions:
            kind = action.kind
            if kind is ActionKind.COPY_H2D:
                self._loading[self.manager.buffer(action.storage).storage._cdata] = action.storage
            elif self._loading and kind in (ActionKind.WAIT_H2D, ActionKind.RELEASE_DEVICE):
                key = self.manager.buffer(action.storage).storage._cdata
                self._loading.pop(key, None)

    def guard(self, where: Any, tensors: Iterable[torch.Tensor]) -> set[int]:
        """:meth:`BaseExecutor.guard`, after waiting for the in-flight H2D of any input
        whose reload started early and was not waited for yet (a read the trace did not
        record). Costs nothing while no reload is in flight."""
        if self._loading:
            tensors = tuple(tensors)
            self._wait_for_early_reloads(tensors)
        return super().guard(where, tensors)

    def _wait_for_early_reloads(self, tensors: tuple[torch.Tensor, ...]) -> None:
        loading = self._loading
        for tensor in tensors:
            if not owns_storage(tensor):
                continue
            sid = loading.pop(tensor.untyped_storage()._cdata, None)
            if sid is not None:
                with _disable_current_modes():  # a stream wait: never an op of the model
                    self.manager.wait_h2d(sid)
                self.early_reload_waits += 1

    def storage_ids(self, tensors: Any) -> tuple[int, ...]:
        sids: dict[int, None] = {}
        for tensor in tensors:
            if tensor.device == self.device and owns_storage(tensor):
                sid = self.bound.get(tensor.untyped_storage()._cdata)
                if sid is not None:
                    sids[sid] = None
        return tuple(sids)

    def storage_of(self, sid: int) -> torch.UntypedStorage | None:
        # A RELEASED storage was dead at this point of the warmup step (the plan freed it
        # after its last recorded use), so a region's backward cannot be reading it.
        if sid not in self.manager or self.manager.state(sid) is BufferState.RELEASED:
            return None
        return self.manager.buffer(sid).storage

    # ------------------------------------------------------------------ checks

    def _count_leaves(self, result: Any) -> int:
        """Output leaves as warmup counted them: tracked or fresh storages."""
        count = 0
        for tensor in tensor_leaves(result):
            if tensor.device != self.device or not owns_storage(tensor):
                continue
            storage = tensor.untyped_storage()
            if storage._cdata in self.bound or not self.is_input_alias(storage, self._keys):
                count += 1
        return count

    def _raise_mismatch(self, func: Any, found_leaves: int) -> None:
        i = self.index
        name = func if isinstance(func, str) else str(func)
        if i >= self._num_ops:
            raise ReplayMismatchError(
                f"replay op {i}: the warmup step recorded only {self._num_ops} ops, but the "
                f"step ran {name} ({found_leaves} output leaves) as op {i}; the model must run "
                "the same ops every step (wrap data-dependent code in @skip_offload, call "
                "session.reset() to re-warm, or set OffloadConfig(rewarm_on_mismatch=True))"
            )
        entry = self._entries[i]
        raise ReplayMismatchError(
            f"replay op {i}: warmup recorded {entry.name} with {entry.output_leaf_count} output "
            f"leaves, replay ran {name} with {found_leaves}; the step's op sequence changed "
            "(another branch or shape). Wrap data-dependent code in @skip_offload, call "
            "session.reset() to re-warm, or set OffloadConfig(rewarm_on_mismatch=True)"
        )

    def _make_room(self, i: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A larger-than-planned step: evict online until op ``i``'s outputs fit the
        budget (:mod:`.size_drift`), sized from the arguments it is about to run on (a
        meta run), not from the plan, whose sizes this step outgrows."""
        incoming = sum(self._sizes[sid] for sid in self._entries[i].leaf_storages)
        if incoming and not isinstance(func, str):
            incoming = max(incoming, estimate_new_bytes(func, args, kwargs, self.device))
        bound = max(self.plan.trace.budget_bytes, self.plan.report.resident_bytes[i])
        excess = self._resident + incoming - bound
        if excess <= 0:
            return
        manager, stats = self.manager, self.stats
        with _disable_current_modes():
            for sid in self.drift.victims(manager, i, set(self._loading.values())):
                if excess <= 0:
                    break
                nbytes = manager.buffer(sid).nbytes
                manager.copy_d2h(sid)
                manager.release_device(sid)
                self.drift.evicted.add(sid)
                self._resident -= nbytes
                excess -= nbytes
                stats.evictions += 1
                stats.bytes_d2h += nbytes
                stats.transfers += 1

    # ------------------------------------------------------------------ end of step

    def _stranded(self, among: Iterable[int] | None = None) -> list[int]:
        """Released storages (among ``among``, default all) a tensor still points at."""
        manager = self.manager
        return [
            sid
            for sid in (manager if among is None else (s for s in among if s in manager))
            if manager.state(sid) is BufferState.RELEASED
            and torch._C._storage_Use_Count(manager.buffer(sid).storage._cdata) > 1
        ]

    def finish(self) -> Any:
        self.begin_finish("replayed")
        self.closed = True
        if self.index != self._num_ops and self.rewarm is not None and not self.opaque_depth:
            successor = self.rewarm(  # the step ran fewer ops: re-plan what it did run
                f"replay: the step ended after {self.index} ops, the warmup recorded "
                f"{self._num_ops}")
            successor.continue_from(self.plan, self.index, self.bound)
            self.successor = successor
            return successor.finish()
        if self.index != self._num_ops:
            raise ReplayMismatchError(
                f"replay: the step ended after {self.index} ops, but the warmup step recorded "
                f"{self._num_ops} (next expected: op {self.index}, {self._entries[self.index].name}); "
                "run the same forward and backward every step, or call session.reset()"
            )
        manager = self.manager
        with _disable_current_modes():
            manager.wait_for_transfers()
            settle_communication(lambda: bool(self._stranded(self.plan.comm_buffers)))
            stranded = self._stranded()
            for sid in self.drift.evicted:  # dead while evicted: drop both copies
                buffer = manager.buffer(sid)
                if not buffer.is_resident and torch._C._storage_Use_Count(buffer.storage._cdata) <= 1:
                    if manager.has_host_copy(sid):
                        manager.release_host(sid)
                    manager.unbind(sid)
            manager.reset(restore_offloaded=True)
        self.bound.clear()
        self.stats.end_resident_bytes = self.plan.trace.retained_bytes
        if stranded:
            shown = ", ".join(str(s) for s in stranded[:10])
            raise OffloadSessionError(
                f"replay: storages [{shown}] are still referenced after the step, but the "
                "warmup step saw them freed, so the schedule released their bytes after their "
                "last recorded use; do not read those tensors. Keep the same references in "
                "every step (or call session.reset() to re-warm with the new ones)"
            )
        if self.drift.needs_replan and self.planner is not None:  # for the largest sizes seen
            return replan(self.plan, grown_sizes(self.plan.trace, self.drift.observed),
                          self.planner)
        return None
