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
still in flight first makes the compute stream wait for that H2D
(:meth:`~ReplayExecutor.guard`), so no kernel reads half-copied bytes; the planned
WAIT_H2D then costs nothing.

Last copies. A planned drop of a storage's only copy waits until nothing references the
storage (:mod:`.replay_checks`); one still referenced where its warmup saw it die is kept,
and a read of it is a step whose ops changed, reported before any kernel reads it.

The end of the step is the plan's last op (:data:`~hyper_offload.passes.ir.trace.STEP_END`):
:meth:`ReplayExecutor.finish` runs its actions (reloads of retained storages the plan
moved out in their last gap) and samples the resident bytes there.

A structural mismatch raises :class:`~hyper_offload.errors.ReplayMismatchError` naming
the op index, the expected and found op and their output leaf counts, unless the step
may re-warm: then a warmup takes the step over (``take_over``). An op that raised inside
the step (the user caught it) hands the rest of the step to a warmup too. The offending
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
from hyper_offload.passes.plan.report import ResidencyPlanner
from hyper_offload.runtime import ResidencyManager
from hyper_offload.runtime.physical_buffer import BufferState

from .dispatch_mode import (
    estimate_new_bytes, flat_tensors, owns_storage, result_tensors, tensor_leaves,
)
from .executor_base import BaseExecutor, settle_communication
from .plan_result import WarmupResult, region_saved_bytes, replan
from .replay_checks import (
    LastCopies, OpGuide, SizeDrift, drop_if_unreferenced, grown_sizes, mismatch_error,
    short_step_error, wait_for_early_reloads,
)
from .warmup import WarmupExecutor

__all__ = ["ReplayExecutor"]

_RELEASES = (ActionKind.RELEASE_DEVICE, ActionKind.RELEASE_HOST)
_STEP_COUNTERS = ("bytes_d2h", "bytes_h2d", "transfers", "bytes_to_disk", "bytes_from_disk",
                  "demand_loads", "rescued")
"""The :class:`~.executor_base.StepStats` counters a step that a warmup took over sums:
what the replayed ops did, then what the warmup did."""


class ReplayExecutor(BaseExecutor):
    phase = "replay"

    def __init__(
        self,
        manager: ResidencyManager,
        device: torch.device,
        plan: WarmupResult,
        *,
        take_over: Callable[[str, bool], WarmupExecutor] | None = None,
        rewarm_allowed: bool = False,
        planner: ResidencyPlanner | None = None,
    ) -> None:
        """``take_over(reason, ops_changed)``: build a warmup executor that takes the step
        over, because its ops changed (``ops_changed``; only if ``rewarm_allowed``: the
        session settling, or ``OffloadConfig.rewarm_on_mismatch``; else the mismatch
        raises) or an op raised inside it (the user caught the error).
        ``planner``: remakes the plan after a step with larger sizes (:mod:`.replay_checks`)."""
        super().__init__(manager, device)
        self.plan = plan
        self.take_over = take_over
        self.rewarm = take_over if rewarm_allowed else None
        """Set when a step whose ops changed may re-warm (a warmup takes it over)."""
        self.successor: WarmupExecutor | None = None  # type: ignore[assignment]
        """The warmup executor that took the step over after a mismatch, if any."""
        self._region_holds = {plan.trace.accesses_of(sid)[0][0]: (sid, nbytes)
                              for sid, nbytes in plan.virtual.items()}
        """Op -> the virtual storage an opaque region's forward op there holds (.plan_result)."""
        self._region_end: tuple[Any, ...] | None = None  # a region's forward end, until its op ends
        self._region_extra: dict[int, int] = {}  # release op -> region bytes beyond the plan's
        self._call: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None
        self.guide = OpGuide.from_trace(plan.trace)
        self._entries = self.guide.entries
        self._funcs = plan.funcs
        self._pre = plan.replay_pre
        self._post = plan.replay_post
        self._virtual = plan.virtual_delta
        """Op -> (bytes an opaque region's forward op holds from there, bytes released
        after the op): counted like the warmup counted them (.plan_result)."""
        self._held = 0
        self._num_ops = len(self._funcs)
        """Ops of the model the plan replays (its trace also has the step-end op)."""
        self.last_copies = LastCopies(manager)
        self._diverged: str | None = None  # why this op is one the plan does not know
        self._tainted: str | None = None  # an op raised and the user went on
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
        """Reads of a storage with an H2D in flight that waited for it in
        :meth:`~ReplayExecutor.guard` (reads the trace did not record; 0 for a step that
        matches its trace)."""

    def taint(self, reason: str) -> None:
        self._tainted = reason

    def on_op_begin(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._tainted is not None and self._can_hand_over():
            self._hand_over_before(func, args, kwargs)
            return
        i = self.index
        if self.last_copies:
            self._settle(flat_tensors(args, kwargs))
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
        if self.successor is not None:  # handed over before the op ran
            return self.successor.on_op_end(result)
        if self.rewarm is None:
            self._region_end = None
            return self._end_op(result)
        try:
            result = self._end_op(result)
        except ReplayMismatchError as error:
            if not self._can_hand_over() or self._call is None:
                raise  # inside an opaque region: no safe point to hand the step over
            return self._hand_over(result, str(error))
        self._call = self._region_end = None  # hold the op's tensors: never past the op
        return result

    def _can_hand_over(self) -> bool:
        """Whether a warmup can take the step over here: outside opaque regions (their
        inner ops are not traced) and outside an open accumulation op."""
        return (self.take_over is not None and not self.opaque_depth
                and not self.backward_regions and self.grad_node is None)

    def _successor(self, reason: str, ops_changed: bool) -> WarmupExecutor:
        """The warmup that records the rest of the step, from the current op on."""
        assert self.take_over is not None
        if self.last_copies:
            self._settle(())
        successor = self.take_over(reason, ops_changed)
        successor.continue_from(self.plan, self.index, self.bound)
        stats = successor.stats  # the step's figures: the replayed ops', then the warmup's
        for counter in _STEP_COUNTERS:
            setattr(stats, counter, getattr(stats, counter) + getattr(self.stats, counter))
        stats.peak_resident_bytes = max(stats.peak_resident_bytes, self.stats.peak_resident_bytes)
        stats.region_bytes = max(stats.region_bytes, self.stats.region_bytes)
        stats.resident_curve[:0] = self.stats.resident_curve
        self.successor = successor
        self.closed = True
        return successor

    def _hand_over(self, result: Any, reason: str) -> Any:
        """Let a warmup executor record the rest of the step (re-warm on mismatch): the
        op ran here, the warmup records it (a region's op with what the region keeps
        for its backward)."""
        assert self._call is not None
        func, args, kwargs = self._call
        region_end, self._call, self._region_end = self._region_end, None, None
        successor = self._successor(reason, True)
        successor.on_op_begin(func, args, kwargs)
        if region_end is not None:
            successor.region_forward_end(*region_end)
        return successor.on_op_end(result)

    def region_forward_end(self, region: Any, outputs: list[torch.Tensor], start: Any) -> None:
        """Name the virtual storage the plan holds for this region (released at its
        backward by whoever runs the step then), keep what a warmup taking the step over
        at this op must record, and count what the region keeps beyond the plan's bytes
        (larger sizes, or a recompiled body that saves more: like a storage larger than
        planned, :mod:`.replay_checks`), so the step's count stays what the device holds."""
        held = region.held = self._region_holds.get(self.index)
        self._region_end = (region, outputs, start)
        if held is None:
            return
        sid, planned = held
        measured = region_saved_bytes(outputs, start, self.device, region.input_keys,
                                      self._is_bound)
        if measured > planned:
            self.drift.note(sid, measured)
            release = self.plan.trace.accesses_of(sid)[-1][0]
            self._region_extra[release] = self._region_extra.get(release, 0) + measured - planned
            self._count_region_bytes(measured - planned, 0)

    def _is_bound(self, tensor: torch.Tensor) -> bool:
        return owns_storage(tensor) and tensor.untyped_storage()._cdata in self.bound

    def _hand_over_before(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An op raised earlier in the step and the user went on: a warmup records the
        rest (its online eviction keeps the budget; the session discards its trace)."""
        successor = self._successor(f"replay: {self._tainted}", False)
        successor.on_op_begin(func, args, kwargs)

    def _end_op(self, result: Any) -> Any:
        i = self.index
        if self._diverged is not None:
            reason, self._diverged = self._diverged, None
            self._mismatched = None
            raise ReplayMismatchError(reason)
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
            self._count_region_bytes(0, -virtual[1] - self._region_extra.pop(i, 0))
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
        """Run schedule actions and keep :attr:`_loading` (reloads in flight) current;
        a drop of a storage's last copy waits until nothing references it
        (:mod:`.replay_checks`; counted as done, as the plan counts it)."""
        if self.drift.evicted:
            actions = tuple(a for a in actions if self.drift.applicable(self.manager, a))
        batch: list[ResidencyAction] = []
        for action in actions:  # in order: a COPY_D2H before a release makes it no drop
            if action.kind in _RELEASES:
                self._apply_batch(batch)
                if self.last_copies.is_last_copy(action):
                    if action.kind is ActionKind.RELEASE_DEVICE:
                        self._resident -= self.manager.buffer(action.storage).nbytes
                        self._loading.pop(self.manager.buffer(action.storage).storage._cdata, None)
                    self.last_copies.defer(action, self.index)
                    continue
            batch.append(action)
        self._apply_batch(batch)

    def _apply_batch(self, batch: list[ResidencyAction]) -> None:
        """Run ``batch`` (and empty it), keeping :attr:`_loading` current."""
        if not batch:
            return
        super().apply_actions(tuple(batch))
        for action in batch:
            kind = action.kind
            if kind is ActionKind.COPY_H2D:
                self._loading[self.manager.buffer(action.storage).storage._cdata] = action.storage
            elif self._loading and kind in (ActionKind.WAIT_H2D, ActionKind.RELEASE_DEVICE):
                key = self.manager.buffer(action.storage).storage._cdata
                self._loading.pop(key, None)
        batch.clear()

    def guard(self, where: Any, tensors: Iterable[torch.Tensor]) -> set[int]:
        """:meth:`BaseExecutor.guard`, after settling deferred last-copy drops and waiting
        for the in-flight H2D of any input whose reload started early and was not waited
        for yet (a read the trace did not record); then a read of a storage kept past its
        plan's drop marks the op as one the plan does not know (:meth:`_end_op`). Costs
        nothing while no drop is pending, no reload in flight and nothing was kept."""
        if self._loading or self.last_copies or self.last_copies.kept:
            tensors = tuple(tensors)
            if self.last_copies:
                self._settle(tensors)
            if self._loading:
                self.early_reload_waits += wait_for_early_reloads(self.manager, self._loading,
                                                                  tensors)
        keys = super().guard(where, tensors)
        if self.last_copies.kept and self._diverged is None:
            self._diverged = self.last_copies.divergence(
                (self.bound.get(key) for key in keys), self.index, where)
        return keys

    def _settle(self, tensors: Iterable[torch.Tensor]) -> None:
        """Run the deferred last-copy drops (:meth:`LastCopies.settle`), counting what
        was kept instead."""
        reading = {t.untyped_storage()._cdata for t in tensors if t.layout is torch.strided}
        with _disable_current_modes():
            settled = self.last_copies.settle(reading)
        self._resident += settled.kept_on_device
        if settled.copied:
            self.stats.bytes_d2h += settled.copied
            self.stats.transfers += len(settled.kept)
        self.stats.rescued += len(settled.kept)

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
        raise mismatch_error(self._entries[: self._num_ops], self.index, func, found_leaves)

    def _make_room(self, i: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A larger-than-planned step: evict online until op ``i``'s outputs fit the
        budget (:mod:`.replay_checks`), sized from the arguments it is about to run on (a
        meta run), not from the plan, whose sizes this step outgrows."""
        incoming = sum(self._sizes[sid] for sid in self._entries[i].leaf_storages)
        if incoming and not isinstance(func, str):
            incoming = max(incoming, estimate_new_bytes(func, args, kwargs, self.device))
        bound = max(self.plan.trace.budget_bytes, self.plan.report.resident_bytes[i])
        excess = self._resident + incoming - bound
        if excess <= 0:
            return
        with _disable_current_modes():
            self._resident -= self.drift.evict(self.manager, i, set(self._loading.values()),
                                               excess, self.stats)

    # ------------------------------------------------------------------ end of step

    def finish(self) -> Any:
        self.begin_finish("replayed")
        self.closed = True
        if self.index != self._num_ops:
            return self._finish_short()
        manager = self.manager
        with _disable_current_modes():
            manager.wait_for_transfers()
            comm = self.plan.comm_buffers
            settle_communication(lambda: self.last_copies.held_by_communication(comm))
            if self.last_copies:
                self._settle(())
        kept = self.last_copies.still_referenced()
        if kept and self.rewarm is not None:  # plan again, with what the step keeps retained
            return self._successor(
                f"replay: the step keeps storages {kept[:10]} its warmup saw freed", True).finish()
        self._run_step_end()
        with _disable_current_modes():
            for sid in (*self.drift.evicted, *self.last_copies.kept):
                drop_if_unreferenced(manager, sid)
            manager.reset(restore_offloaded=True)
        self.bound.clear()
        self.stats.end_resident_bytes = self.plan.trace.retained_bytes
        if self.drift.needs_replan and self.planner is not None:  # for the largest sizes seen
            return replan(self.plan, grown_sizes(self.plan.trace, self.drift.observed),
                          self.planner)
        return None

    def _finish_short(self) -> Any:
        """The step ran fewer ops than its plan: a warmup re-plans what it did run (if
        the step may re-warm), else the mismatch is reported."""
        if self.rewarm is not None and not self.opaque_depth:
            return self._successor(
                f"replay: the step ended after {self.index} ops, the warmup recorded "
                f"{self._num_ops}", True).finish()
        raise short_step_error(self._entries, self.index, self._num_ops)

    def _run_step_end(self) -> None:
        """The plan's step-end op: reload what it moved out of the device in a retained
        storage's last gap, and sample the resident bytes there (what outlives the step
        is on the device)."""
        end = self._num_ops
        if end >= len(self._pre):
            return  # a plan without a step-end op (none the warmup makes today)
        if self._pre[end]:
            self.apply_actions(self._pre[end])
        self.sample()
        if self._post[end]:
            self.apply_actions(self._post[end])
