"""``WarmupExecutor``: record the step as an ``ActivationTrace``, evicting online.

Design section 4.3. Step 1 runs the model for real; for every op the executor records
which tracked storages it READs or WRITEs (WRITE for arguments the op schema marks
``Tensor(a!)``, and for the storages it creates), the storage of each output leaf, and
the op's duration (:class:`~hyper_offload.runtime.device.OpClock`: wall clock on CPU,
timing events read once at the end of the step on an accelerator, where the wall clock
would only time the launch); the planning pipeline prices the step with them. Storages are tracked by :class:`ActivationTracker`.

Online eviction ("step 1 already fits"): before an op runs, the executor estimates the
bytes of the storages the op will create (running it on ``meta`` tensors), and while
resident bytes plus that estimate exceed the budget it offloads resident storages the op
does not touch: the earliest-produced first, the larger first among one op's outputs
(``copy_d2h`` + ``release_device`` through the ``ResidencyManager``). An op that needs an
evicted storage pages it back first (``BaseExecutor.guard``), after which the storage is
unbound again so that its bytes are freed when its last tensor dies.

Holds. The tracker reports when each storage dies; one that dies ops after its last
access (a variable, autograd kept it) is *held* there (``ActivationTrace.held_until``):
the plan frees its bytes only after that op, so a replay that finds it still referenced
there knows the step changed (:mod:`.replay_checks`). An offloaded storage (held by the
manager, whose reference hides its death) is checked at every op.

``finish`` pages back what is still referenced, reads which storages survive the step
(``retained``), profiles transfer bandwidth, builds the trace and plans it with the
configured planner through the pipeline every door shares,
:func:`hyper_offload.passes.plan_residency` (plan -> check -> place prefetches -> check).
The eager step is one timeline (forward and backward run in one dispatch stream), so
``earliest_prefetch_op`` is 0: a reload may start as soon as the op after its release,
as far ahead of its read as the recorded op times need and the budget allows. The
replay then issues each ``COPY_H2D`` some ops before the ``WAIT_H2D`` of its reading op.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from hyper_offload.passes.ir.trace_op import PendingCollectives, returns_work, wait_accesses
from hyper_offload.passes.ir.trace import (
    AccessKind, ActivationTrace, StorageAccess, StorageId, TraceOp,
)
from hyper_offload.passes.plan.report import ResidencyPlanner
from hyper_offload.runtime import ResidencyManager, profile_transfer_bandwidth
from hyper_offload.runtime.device import OpClock
from hyper_offload.runtime.physical_buffer import BufferState, byte_view
from hyper_offload.runtime.pipeline.session import swap_step_running

from .dispatch_mode import (
    PARAMETER_MEMORY, ActivationTracker, argument_tensors, estimate_new_bytes, owns_storage,
    tensor_leaves, written_arguments,
)
from .executor_base import BaseExecutor, settle_communication
from .plan_result import (
    WarmupResult, hand_back, plan_warmup, refuse_swap_step, region_saved_bytes, replan,
    warmup_trace,
)

__all__ = [
    "WarmupExecutor",
    "WarmupResult",
    "replan",
]


class WarmupExecutor(BaseExecutor):
    phase = "warmup"

    def __init__(
        self,
        manager: ResidencyManager,
        device: torch.device,
        *,
        budget_bytes: int,
        planner: ResidencyPlanner,
        profile_bandwidth: bool = True,
        host_budget_bytes: int | None = None,
        disk: tuple[int, float] | None = None,
    ) -> None:
        super().__init__(manager, device)
        self.disk = disk
        """The disk tier the plan may use: (budget bytes, bandwidth GB/s); None: none."""
        self.budget_bytes = budget_bytes
        self.planner = planner
        self.host_budget_bytes = host_budget_bytes
        """Host budget the plan keeps; online eviction stops where the pool has no room
        under it (None: the pool's cap alone decides)."""
        self.host_limited = 0
        """Evictions the host budget refused during this warmup step."""
        self.profile_bandwidth = profile_bandwidth
        self.tracker = ActivationTracker(on_free=self._on_free)
        self.ops: list[TraceOp] = []
        self.funcs: list[Any] = []
        self._resident_sids: dict[StorageId, None] = {}  # insertion-ordered set
        self._writes: dict[Any, tuple[tuple[int, str], ...] | None] = {}  # None: a Work op
        self._current: (
            tuple[Any, str, dict[StorageId, AccessKind], tuple[StorageId, ...], Any, int] | None
        ) = None  # func, name, accesses, the storages its arguments read, keys, clock token
        self.clock = OpClock(device)  # op durations: wall clock on CPU, events on a GPU
        self._timed: dict[int, int] = {}  # op index -> clock token
        self.collectives = PendingCollectives()
        self.pinned: dict[StorageId, None] = {}
        """Storages a ``Work``-returning op touched (insertion-ordered set): read by
        every later op, retained, so no eviction or plan moves or frees them."""
        self.pins: dict[int, tuple[StorageId, ...]] = {}
        self._parameter_op = False  # whether the op in progress is an fsdp:: op
        self.held: dict[StorageId, int] = {}
        """Virtual storages of what open opaque regions keep for their backward (id ->
        bytes, :mod:`.plan_result`): read by every op until their backward op ends."""
        self.virtual: dict[StorageId, int] = {}
        """Every such virtual storage of the step."""
        self._region_work: set[int] = set()  # storage keys a Work op used in the open region
        self._region_ops: dict[Any, bool] = {}  # op inside a region -> whether it returns a Work
        self.ends: dict[StorageId, int] = {}
        """Storage -> the last op during which it was alive (recorded when it died)."""
        self.foreign: dict[StorageId, None] = {}
        """Storages an ``fsdp::`` op created or touched: FSDP's all-gather and
        reduce-scatter buffers, parameters' memory (:data:`PARAMETER_MEMORY`). Recorded at
        0 bytes and retained, never counted, evicted or bound: left in place."""

    # ------------------------------------------------------------------ op hooks

    def on_op_begin(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = func if isinstance(func, str) else str(func)
        if swap_step_running():
            refuse_swap_step(name, self.index)
        if self.bound:
            self._reap_offloaded()
        if func in self._writes:
            writes = self._writes[func]
        else:  # the first call of this op in the step
            writes = self._writes[func] = None if returns_work(func) else written_arguments(func)
        tensors = argument_tensors(args, kwargs, writes)
        keys: Any = self.guard(name, (t for t, _ in tensors))
        if isinstance(func, str):
            keys = self.live_inputs((t for t, _ in tensors), self.device)
        accesses: dict[StorageId, AccessKind] = {}
        for tensor, written in tensors:
            if tensor.device != self.device or not owns_storage(tensor):
                continue
            sid = self.tracker.sid_of(tensor.untyped_storage())
            if sid is not None and accesses.get(sid) is not AccessKind.WRITE:
                accesses[sid] = AccessKind.WRITE if written else AccessKind.READ
        reads = tuple(sid for sid, kind in accesses.items() if kind is AccessKind.READ)
        parameter_op = getattr(func, "namespace", None) in PARAMETER_MEMORY
        if parameter_op:
            self._make_foreign(tuple(accesses))
        if writes is None and accesses:
            self._pin(tuple(s for s in accesses if s not in self.foreign))
        for sid in self.collectives.in_flight:  # read by the communication meanwhile
            accesses.setdefault(sid, AccessKind.READ)
        for sid in self.pinned:  # a Work-returning op may still use it
            accesses.setdefault(sid, AccessKind.READ)
        for sid in self.held:  # an opaque region's own saved bytes: no gap to move them
            accesses.setdefault(sid, AccessKind.READ)
        incoming = (0 if isinstance(func, str)
                    else estimate_new_bytes(func, args, kwargs, self.device))
        self._evict(set(accesses), incoming)
        self._parameter_op = parameter_op
        self._current = (func, name, accesses, reads, keys, self.clock.start())

    def on_op_end(self, result: Any) -> Any:
        assert self._current is not None, "on_op_end without on_op_begin"
        func, name, accesses, reads, keys, token = self._current
        self._current = None
        self.clock.stop(token)
        self._timed[self.index] = token
        outputs: list[StorageId] = []
        for tensor in tensor_leaves(result):
            if tensor.device != self.device or not owns_storage(tensor):
                continue
            storage = tensor.untyped_storage()
            sid = self.tracker.sid_of(storage)
            if sid is None:
                if self.is_input_alias(storage, keys):
                    continue  # a view of (or in-place result on) a pre-existing storage
                sid = self.tracker.adopt(storage, self.index)
                if self._parameter_op:
                    self.foreign[sid] = None  # FSDP's buffer: recorded, never counted
                else:
                    self._resident += storage.nbytes()
                    self._resident_sids[sid] = None
                accesses[sid] = AccessKind.WRITE
            elif sid in self.foreign:  # a view of FSDP's memory: no output of the step
                accesses.setdefault(sid, AccessKind.READ)
                continue
            else:
                self._note_growth(sid, storage.nbytes())
                accesses.setdefault(sid, AccessKind.READ)
            outputs.append(sid)
        self._note_collective(func, accesses, reads, outputs)
        if self._region_work:  # a virtual op whose body ran Work-returning ops
            self._pin_region_work(accesses)
        self.ops.append(
            TraceOp(
                name=name,
                accesses=tuple(StorageAccess(s, k) for s, k in sorted(accesses.items())),
                outputs=tuple(outputs),
            )
        )
        self.funcs.append(func)
        self.sample()
        self.index += 1
        return result

    def _note_collective(
        self, func: Any, accesses: dict[StorageId, AccessKind], reads: tuple[StorageId, ...],
        outputs: list[StorageId],
    ) -> None:
        """An issued functional collective reads its inputs and writes its outputs until
        its ``wait_tensor``: so does the wait in the trace, and every op in between
        reads them (:meth:`on_op_begin`), so no plan or eviction moves them before it
        (:mod:`hyper_offload.passes.ir.trace_op`)."""
        self.collectives.issued(func, reads, outputs)
        wait_accesses(self.collectives, func, reads, accesses, AccessKind.READ, AccessKind.WRITE)

    def region_forward_end(self, region: Any, outputs: list[torch.Tensor], start: Any) -> None:
        nbytes = region_saved_bytes(outputs, start, self.device, region.input_keys, self._tracked)
        if nbytes == 0 or self._current is None:
            return
        sid = self.tracker.add_virtual(nbytes, self.index)
        self._current[2][sid] = AccessKind.WRITE  # created by the region's forward op
        self.held[sid] = self.virtual[sid] = nbytes
        self._resident += nbytes
        region.held = (sid, nbytes)
        self.stats.region_bytes = max(self.stats.region_bytes, sum(self.held.values()))

    def region_backward_end(self, region: Any) -> None:
        if region.held is not None and region.held[0] in self.held:
            self._resident -= self.held.pop(region.held[0])

    def _tracked(self, tensor: torch.Tensor) -> bool:
        return owns_storage(tensor) and self.tracker.sid_of(tensor.untyped_storage()) is not None

    def _make_foreign(self, sids: tuple[StorageId, ...]) -> None:
        """An ``fsdp::`` op touches ``sids``: FSDP's buffers from now on (their
        communication and their life are FSDP's), no longer counted or evictable."""
        for sid in sids:
            if sid in self.foreign:
                continue
            self.foreign[sid] = None
            self.pinned.pop(sid, None)
            if sid in self._resident_sids:
                del self._resident_sids[sid]
                self._resident -= self.tracker.entry(sid).nbytes

    def _pin(self, sids: tuple[StorageId, ...]) -> None:
        """A ``Work``-returning op at this index touches ``sids``: their communication
        ends at a ``Work.wait()`` no op shows, so they stay put to the end of the step."""
        self.pins[self.index] = sids
        self.pinned.update(dict.fromkeys(sids))

    def guard_region_op(self, func: Any, tensors: list[torch.Tensor]) -> None:
        """An op inside an opaque region: guarded, not traced; a ``Work``-returning one
        pins the region's tracked storages it touched when the region's op ends."""
        keys = self.guard(func, tensors)
        work = self._region_ops.get(func)
        if work is None:
            work = self._region_ops[func] = returns_work(func)
        if work:
            self._region_work.update(keys)

    def accumulation_inputs(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An op of the open ``AccumulateGrad`` virtual op: its tracked arguments are the
        virtual op's accesses (the incoming gradient READ; a ``.grad`` created earlier in
        the step WRITTEN by ``add_``); what it creates is not tracked."""
        if func not in self._writes:
            self._writes[func] = None if returns_work(func) else written_arguments(func)
        tensors = argument_tensors(args, kwargs, self._writes[func])
        self.guard_region_op(func, [t for t, _ in tensors])
        assert self._current is not None
        accesses = self._current[2]
        for tensor, written in tensors:
            if tensor.device == self.device and owns_storage(tensor):
                sid = self.tracker.sid_of(tensor.untyped_storage())
                if sid is not None and accesses.get(sid) is not AccessKind.WRITE:
                    accesses[sid] = AccessKind.WRITE if written else AccessKind.READ

    def _pin_region_work(self, accesses: dict[StorageId, AccessKind]) -> None:
        touched, self._region_work = self._region_work, set()
        sids = []
        for sid in accesses:
            storage = self.tracker.storage(sid)
            if storage is not None and storage._cdata in touched:
                sids.append(sid)
                accesses[sid] = AccessKind.WRITE  # the communication may fill it
        if sids:
            self._pin(tuple(sids))

    def storage_ids(self, tensors: Any) -> tuple[StorageId, ...]:
        sids: dict[StorageId, None] = {}
        for tensor in tensors:
            if tensor.device == self.device and owns_storage(tensor):
                sid = self.tracker.sid_of(tensor.untyped_storage())
                if sid is not None:
                    sids[sid] = None
        return tuple(sids)

    def storage_of(self, sid: StorageId) -> torch.UntypedStorage | None:
        return self.tracker.storage(sid)

    # ------------------------------------------------------------------ eviction

    def _on_free(self, sid: StorageId) -> None:
        # Inside an op (its kernel, an opaque region, an accumulation) the op is the last
        # one it lived in; between ops, the one before.
        self.ends.setdefault(sid, self.index if self._current is not None else self.index - 1)
        if sid in self._resident_sids:
            del self._resident_sids[sid]
            self._resident -= self.tracker.entry(sid).nbytes

    def _note_growth(self, sid: StorageId, nbytes: int) -> None:
        entry = self.tracker.entry(sid)
        if nbytes > entry.nbytes:
            if sid in self._resident_sids:
                self._resident += nbytes - entry.nbytes
            self.tracker.grow(sid, nbytes)

    def _evict(self, protect: set[StorageId], incoming: int) -> None:
        excess = self._resident + incoming - self.budget_bytes
        if excess <= 0:
            return
        tracker = self.tracker
        victims = sorted(
            (s for s in self._resident_sids if s not in protect),
            key=lambda s: (tracker.entry(s).producer, -tracker.entry(s).nbytes, s),
        )
        for sid in victims:
            if excess <= 0:
                break
            storage = tracker.storage(sid)
            if storage is None or storage.nbytes() == 0:
                continue
            if not self.manager.pool.has_room(storage.nbytes()):
                self.host_limited += 1  # the host budget is full: the device keeps it
                continue
            excess -= self._offload(sid, storage)

    def _offload(self, sid: StorageId, storage: torch.UntypedStorage) -> int:
        nbytes = storage.nbytes()
        with _disable_current_modes():
            self.manager.bind(sid, byte_view(storage, nbytes))
            self.manager.copy_d2h(sid)
            self.manager.release_device(sid)
        self.bound[storage._cdata] = sid
        del self._resident_sids[sid]
        self._resident -= nbytes
        self.stats.evictions += 1
        self.stats.bytes_d2h += nbytes
        self.stats.transfers += 1
        return nbytes

    def _reap_offloaded(self) -> None:
        """Offloaded storages whose last tensor died (between ops: the manager's own
        reference hides it from the tracker) hold nothing any more: record where they
        died and return their host buffers now."""
        manager = self.manager
        for key, sid in list(self.bound.items()):
            buffer = manager.buffer(sid)
            if buffer.state is BufferState.HOST and not buffer.referenced():
                self.ends.setdefault(sid, self.index - 1)
                with _disable_current_modes():
                    manager.release_host(sid)
                    manager.unbind(sid)
                del self.bound[key]

    def after_page_in(self, sid: StorageId) -> None:
        # Unbind again: the manager would otherwise keep the storage (and its device
        # bytes) alive after its last tensor died.
        storage = self.manager.buffer(sid).storage
        with _disable_current_modes():
            self.manager.unbind(sid)
        del self.bound[storage._cdata]
        self._resident_sids[sid] = None

    # ------------------------------------------------------------------ re-warm

    def continue_from(self, plan: WarmupResult, num_ops: int, bound: dict[int, StorageId]) -> None:
        """Take over a replayed step after its first ``num_ops`` ops (which matched
        ``plan.trace``): keep those ops and their pins, and adopt every storage the replay
        bound, in the state the schedule left it (``bound``: the replay's ``_cdata`` ->
        id map).

        Resident storages become tracked activations; offloaded ones stay bound (an op
        that needs one pages it back); storages the schedule released for good are dead
        (the replay drops a last copy only once nothing references it: :mod:`.replay_checks`)
        and keep the hold the plan recorded for them."""
        manager, trace = self.manager, plan.trace
        self.ops = list(trace.ops[:num_ops])
        self.funcs = list(plan.funcs[:num_ops])
        self.index = num_ops
        self.foreign.update(dict.fromkeys(
            s for op in self.ops for s in op.storages if s in plan.foreign))
        for sid, nbytes in plan.virtual.items():  # held past the prefix: to the end now
            uses = [i for i, _ in trace.accesses_of(sid)]
            if uses[0] < num_ops:
                self.virtual[sid] = nbytes
                if uses[-1] >= num_ops:
                    self.held[sid] = nbytes
                    self._resident += nbytes
        for index, sids in plan.pins.items():
            if index < num_ops:
                self.pins[index] = sids
                self.pinned.update(dict.fromkeys(sids))
        bound_sids = {sid: key for key, sid in bound.items()}
        seen = sorted({a.storage for op in self.ops for a in op.accesses})
        for sid in seen:
            size = trace.storage_sizes[sid]
            producer = trace.accesses_of(sid)[0][0]
            if sid not in manager or manager.state(sid) is BufferState.RELEASED:
                self.tracker.add_dead(sid, size, producer)
                if sid in trace.held_until:  # dead where the plan has it, or earlier
                    self.ends[sid] = min(trace.held_until[sid], num_ops - 1)
                if sid in manager:  # nothing can read it: no tensor references it
                    with _disable_current_modes():
                        manager.unbind(sid)
                continue
            buffer = manager.buffer(sid)
            storage, state = buffer.storage, buffer.state
            if state is BufferState.HOST:
                self.tracker.adopt_as(storage, sid, size, producer)
                self.bound[bound_sids[sid]] = sid
            else:
                with _disable_current_modes():
                    buffer.synchronize()
                    if buffer.has_host_copy:
                        manager.release_host(sid)
                    manager.unbind(sid)
                self.tracker.adopt_as(storage, sid, size, producer)
                self._resident_sids[sid] = None
                self._resident += size
        with _disable_current_modes():
            for sid in list(manager):  # bound by the mismatched op itself: it records anew
                if sid not in self.tracker.sizes():
                    manager.unbind(sid)

    # ------------------------------------------------------------------ end of step

    def _build_trace(self) -> ActivationTrace:
        """The step's trace (:func:`~.plan_result.warmup_trace`). ``retained``: what is
        alive now, and what the plan must never release: pinned storages (their
        communication may still use them; the library frees them through its own reference
        once done), incoming gradients last read by their accumulation (whether this step
        created the ``.grad``, which keeps one, or accumulated into one, where it dies: the
        same trace either way; the replay hands them back to autograd there) and FSDP's
        buffers (at 0 bytes: parameters' memory, never bound by the replay); those are
        outputs of their creating op only. Ops keep the durations the clock measured (ops
        kept from a replayed step by ``continue_from`` keep theirs)."""
        handed = (s for sids in hand_back(self.ops, self.pinned).values() for s in sids)
        retained = frozenset(e.sid for e in self.tracker if e.alive).union(
            self.pinned, handed, self.foreign)
        durations = self.clock.durations()
        ops = tuple(dataclasses.replace(op, duration_s=durations[self._timed[index]])
                    if index in self._timed else op for index, op in enumerate(self.ops))
        bandwidth = profile_transfer_bandwidth(self.device) if self.profile_bandwidth else None
        return warmup_trace(ops, self.tracker.sizes(), retained=retained, foreign=self.foreign,
                            ends=self.ends, budget_bytes=self.budget_bytes, bandwidth=bandwidth,
                            disk=self.disk)

    def finish(self) -> WarmupResult:
        """Page back live offloaded storages, build the trace and plan it."""
        self.begin_finish("traced")
        self.closed = True
        manager = self.manager
        tracker, comm = self.tracker, self.collectives.buffers
        settle_communication(lambda: any(tracker.referenced_elsewhere(sid) for sid in comm))
        with _disable_current_modes():
            manager.wait_for_transfers()
            for sid in list(manager):
                buffer = manager.buffer(sid)
                if buffer.state is BufferState.RELEASED:  # dropped by the replay: unreachable
                    manager.unbind(sid)
                elif not buffer.referenced():  # dead while offloaded: drop both copies
                    self.ends.setdefault(sid, self.index - 1)
                    manager.release_host(sid)
                    manager.unbind(sid)
            manager.reset(restore_offloaded=True)
        self.bound.clear()
        trace = self._build_trace()
        # What outlives the step is on the device now (paged back just above): that
        # moment is part of the step's peak, as it is of the trace's model.
        self.stats.end_resident_bytes = trace.retained_bytes
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, trace.retained_bytes)
        planned = plan_warmup(trace, self.planner, host_budget_bytes=self.host_budget_bytes,
                              measured_peak=self.stats.peak_resident_bytes,
                              host_limited=self.host_limited)
        self.tracker.clear()
        return WarmupResult(
            trace, planned.schedule, planned.check, self.funcs,
            frozenset(self.collectives.buffers), dict(self.pins), frozenset(self.foreign),
            dict(self.virtual),
        )


