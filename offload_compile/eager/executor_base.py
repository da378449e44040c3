"""``BaseExecutor``: the per-op lifecycle shared by the warmup and replay executors.

Design section 4.3. ``dispatch`` is the template every aten op goes through::

    outside an opaque region:  on_op_begin(func, args, kwargs) -> func(...) -> on_op_end(out)
    inside an opaque region:   guard inputs (residency check only)    -> func(...)

and :func:`.opaque.run_opaque_region` runs a whole Python callable as one *virtual* op. Subclasses implement ``on_op_begin`` / ``on_op_end`` and
``finish`` / ``abort``.

Memory safety (TORCH_NOTES: a kernel reading a storage resized to 0 bytes crashes the
process): every op, traced or not, first passes its tensor arguments through
:meth:`BaseExecutor.guard`. A 0-byte storage that the executor offloaded is paged back
(demand paging, the fallback path, counted in ``StepStats.demand_loads``); one whose
bytes were released for good raises :class:`OffloadSessionError` naming the op and
the storage. Nothing else ever reads an offloaded storage while the session is active.

The session whose ``with`` block is active in this context, and its step's executor.

A leaf of the eager door: it imports only the executor's type, so the hooks that must
find the running step (``skip_offload``'s opaque calls, the compiled-module hooks) read
it here instead of importing the session. One ``ContextVar``: threads and asyncio tasks
each see their own (none unless they entered a session themselves).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes

from hyper_offload.errors import (
    HyperOffloadError, OffloadBudgetWarning, OffloadSessionError, TransferIntegrityError,
)
from hyper_offload.passes.ir.schedule import ActionKind, ResidencyAction
from hyper_offload.passes.ir.trace import StorageId
from hyper_offload.runtime import PinnedMemoryPool, PoolStats, ResidencyManager
from hyper_offload.runtime.disk_store import DiskStats
from hyper_offload.runtime.physical_buffer import BufferState

from .dispatch_mode import device_test, flat_tensors, owns_storage

__all__ = [
    "ACCUMULATE_GRAD",
    "ActiveSession",
    "BaseExecutor",
    "OffloadBudgetWarning",
    "OffloadSessionError",
    "StepStats",
    "activate",
    "active_executor",
    "current_session",
    "deactivate",
    "settle_communication",
]


ACCUMULATE_GRAD = "accumulate_grad"
"""The virtual op of one ``AccumulateGrad`` node's ops (:meth:`BaseExecutor.dispatch`)."""

_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad
_current_node = torch._C._current_autograd_node

COMM_SETTLE_S = 1.0
"""How long the end of a step waits, at most, for the communication library to drop its
references to a finished collective's buffers (see :func:`settle_communication`). The
wait ends as soon as none is held, so a long bound costs nothing where none is; 50 ms was
too short on a loaded 2-core machine (12-07: a gloo buffer still held at the end of a
tensor-parallel replay was free 200 ms later)."""


def settle_communication(held: Callable[[], bool], timeout_s: float = COMM_SETTLE_S) -> None:
    """Wait until ``held()`` is false, at most ``timeout_s``.

    A collective's ``Work`` (gloo: its worker thread) keeps the tensors it used a moment
    past the ``wait_tensor`` that returned: whether a collective buffer still counts as
    referenced at the end of a step is a race. The executors settle it before they read
    reference counts, so the trace and the replay check see the step, not the thread."""
    deadline = time.perf_counter() + timeout_s
    while held() and time.perf_counter() < deadline:
        time.sleep(0.0005)


@dataclass
class StepStats:
    """What one ``with session:`` step did. Bytes are storage bytes (``nbytes``)."""

    phase: str
    ops: int = 0
    peak_resident_bytes: int = 0
    """Highest device-resident bytes of tracked activation storages, measured right
    after each op ran (before its post actions), and at the end of the step, when
    whatever outlives it is on the device: the quantities ``check_schedule``'s
    ``resident_bytes`` predicts (its model keeps ``retained`` storages resident after the
    last op)."""
    end_resident_bytes: int = 0
    """Device bytes of the tracked storages that outlive the step (gradients, outputs,
    anything still referenced), all on the device when the step ends."""
    resident_curve: list[int] = field(default_factory=list, repr=False)
    """Device-resident activation bytes after each traced op (same point as above)."""
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    transfers: int = 0
    bytes_to_disk: int = 0
    """Bytes the disk tier wrote (``SPILL_TO_DISK``) this step."""
    bytes_from_disk: int = 0
    """Bytes the disk tier read back (``LOAD_FROM_DISK``) this step."""
    demand_loads: int = 0
    """Storages paged back synchronously because an op needed them before any planned
    prefetch (warmup: after an online eviction; replay: should stay 0)."""
    evictions: int = 0
    """Online evictions (warmup only)."""
    step_seconds: float = 0.0
    warmups: int = 0
    """Warmup steps the session has run so far (this one included)."""
    settled: bool = False
    """Whether the session had settled by the end of this step: a replayed step ran the
    ops its warmup recorded (two consecutive steps agreed)."""
    rewarm_reason: str | None = None
    """Why this step re-warmed (the mismatch), if it did."""
    region_bytes: int = 0
    """The most device bytes opaque regions (compiled modules, ``skip_offload``) held at
    once for their backward: saved by their own ops, counted in the resident bytes and
    planned around, never moved (:mod:`.plan_result`)."""
    pool: PoolStats | None = None
    """Host pool snapshot at the end of the step."""
    disk: DiskStats | None = None
    """The disk tier's snapshot at the end of the step (None: no disk tier)."""
    discarded: str | None = None
    """Why this step was not used as a plan (an op raised inside it and the user went
    on), if it was not."""
    rescued: int = 0
    """Storages a reference still held where the plan expected them freed (a step that
    diverged from its warmup): kept (copied to the host) instead of dropped (replay)."""


class BaseExecutor:
    """State of one step: op index, opaque-region depth, the residency manager.

    ``bound`` maps ``UntypedStorage._cdata`` -> storage id for every storage currently
    bound in ``manager`` (the executor binds and unbinds; the manager holds the storage
    objects, the executor only the ids).
    """

    phase = "base"

    def __init__(self, manager: ResidencyManager, device: torch.device) -> None:
        self.manager = manager
        self.device = device
        self.on_device = device_test(device)
        """``tensor -> bool``: whether a tensor lives on the session's device."""
        self.index = 0
        self.opaque_depth = 0
        self.bound: dict[int, StorageId] = {}
        self.stats = StepStats(self.phase)
        self._resident = 0
        self.closed = False
        """Set once the step finished or aborted; late autograd callbacks then no-op."""
        self.backward_regions: list[Any] = []
        """Opaque regions whose backward virtual op is in progress (innermost last)."""
        self.grad_node: Any = None
        """The ``AccumulateGrad`` node whose virtual op is open, if any."""
        self.failed = False
        """Set when the executor raised: later ops run untraced (see :meth:`dispatch`)."""
        self.op_error: tuple[int, BaseException] | None = None
        """The last op of the step whose kernel raised: (op index, error)."""
        self.successor: BaseExecutor | None = None
        """The executor that took the rest of the step over, if one did (a replay hands a
        step whose ops changed to a warmup)."""

    def current(self) -> BaseExecutor:
        """The executor running the step now: this one, or whoever took it over (an
        opaque region begun before a take-over ends its backward there)."""
        executor = self
        while executor.successor is not None:
            executor = executor.successor
        return executor

    # ------------------------------------------------------------------ template

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.failed:  # unwinding after the step's own error: run it, read no 0 bytes
            self.guard(func, flat_tensors(args, kwargs))
            return func(*args, **kwargs)
        try:
            if self.opaque_depth:
                self.guard_region_op(func, flat_tensors(args, kwargs))
                return func(*args, **kwargs)
            node = _current_node()
            if node is not None and type(node) is _ACCUMULATE_GRAD:
                return self._accumulation_op(node, func, args, kwargs)
            if self.grad_node is not None:
                self.end_accumulation()
            self.on_op_begin(func, args, kwargs)
            if self.failed:  # the op does not match and an earlier op raised (see there)
                return func(*args, **kwargs)
            try:
                result = func(*args, **kwargs)
            except BaseException as error:
                self.op_error = (self.index, error)
                raise
            return self.on_op_end(result)
        except TransferIntegrityError as error:
            self.failed, self.op_error = True, (self.index, error)
            if error.where:
                raise
            raise TransferIntegrityError(
                f"eager door, op {self.index} ({func}): {error}", check=error.check,
                where=f"eager op {self.index}") from error
        except HyperOffloadError as error:
            # The step's own error propagates; ops run while unwinding (a profiler's
            # record_function exit, a context manager's cleanup) must not raise another
            # one in its place: from here on they run untraced (guarded).
            self.failed, self.op_error = True, (self.index, error)
            raise

    # ------------------------------------------------------------------ grad accumulation

    def _accumulation_op(
        self, node: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """An op the autograd engine runs inside an ``AccumulateGrad`` node (creating or
        accumulating a ``.grad``, and the tensor's hooks). One node's ops are one virtual
        op, :data:`ACCUMULATE_GRAD`: whether ``.grad`` is created (``detach`` or a clone)
        or accumulated (``add_``) is no activation difference, so no mismatch either."""
        if node is not self.grad_node:
            if self.grad_node is not None:
                self.end_accumulation()
            self.grad_node = node
            self.on_op_begin(ACCUMULATE_GRAD, (), {})
        self.accumulation_inputs(func, args, kwargs)
        return func(*args, **kwargs)

    def accumulation_inputs(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An op inside the open :data:`ACCUMULATE_GRAD` virtual op: guarded; what it
        creates is gradient memory, never tracked."""
        self.guard_region_op(func, flat_tensors(args, kwargs))

    def end_accumulation(self) -> None:
        """Close the open :data:`ACCUMULATE_GRAD` virtual op (the next op of another
        node, an opaque region or the end of the step does)."""
        self.grad_node = None
        if not self.failed:
            self.on_op_end(())

    def on_op_begin(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        raise NotImplementedError

    def taint(self, reason: str) -> None:
        """An op of the step raised (``reason``); the step goes on if the user caught it.
        A warmup records on (its trace is discarded at the end)."""

    def guard_region_op(self, func: Any, tensors: list[torch.Tensor]) -> None:
        """An op inside an opaque region (not traced): only the residency guard."""
        self.guard(func, tensors)

    def region_forward_end(self, region: Any, outputs: list[torch.Tensor], start: Any) -> None:
        """An opaque region's forward returned ``outputs`` (its virtual op still open):
        the warmup counts what the region keeps for its backward (:mod:`.plan_result`)."""

    def region_backward_end(self, region: Any) -> None:
        """An opaque region's backward virtual op ended."""

    def on_op_end(self, result: Any) -> Any:
        raise NotImplementedError

    def finish(self) -> Any:
        """Normal end of the step (``__exit__`` without an exception)."""
        raise NotImplementedError

    def storage_ids(self, tensors: Iterable[torch.Tensor]) -> tuple[StorageId, ...]:
        """Ids of the tracked storages among ``tensors`` (each once, in order)."""
        raise NotImplementedError

    def storage_of(self, sid: StorageId) -> torch.UntypedStorage | None:
        """The storage object of a tracked id while the step still has it."""
        raise NotImplementedError

    def begin_finish(self, what: str) -> None:
        """First thing of ``finish``: close an open accumulation op; refuse a step that
        went on after the executor stopped tracing it (``what`` it could not do)."""
        if self.failed:
            cause = "the session raised an error"
            if self.op_error is not None:
                index, error = self.op_error
                cause = f"op {index} raised {type(error).__name__}: {error}"
            raise OffloadSessionError(
                f"{self.phase}: {cause} inside this step and the step went on; the ops after "
                f"it were not {what}, so this step cannot be used. Let errors propagate out of "
                "`with session:` (catch them outside the block)"
            )
        if self.grad_node is not None:
            self.end_accumulation()

    def abort(self) -> None:
        """Exception path: no transfer in flight, every host buffer back in the pool, no
        tensor left over missing bytes that can still be paged back."""
        self.closed = True
        self.grad_node = None
        try:
            self.manager.sync_all_transfers()
        finally:
            self.bound.clear()
            self.manager.reset(restore_offloaded=True)

    # ------------------------------------------------------------------ residency

    def guard(self, where: Any, tensors: Iterable[torch.Tensor]) -> set[int]:
        """Page back offloaded storages among ``tensors``; returns their storage keys.

        Only a 0-byte storage can be offloaded, so the common case costs one
        ``nbytes()`` per tensor.
        """
        keys = set()
        strided = torch.strided
        for tensor in tensors:
            # Any device: only storages this executor bound can be paged in, and a key of
            # another device's storage never matches an output here.
            if tensor.layout is not strided:
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            keys.add(key)
            if storage.nbytes() == 0:
                sid = self.bound.get(key)
                if sid is not None:
                    self.page_in(sid, where)
        if self.manager.verify:
            self._check_reloads(keys)
        return keys

    def _check_reloads(self, keys: Iterable[int]) -> None:
        """``verify``: a reload this op reads whose wait has not checked it yet (a wait
        the schedule skipped) is checked now, before the op reads it."""
        manager = self.manager
        for key in keys:
            sid = self.bound.get(key)
            if sid is None or sid not in manager:
                continue
            buffer = manager.buffer(sid)
            if buffer.reload_unchecked:
                buffer.check_reload()

    @staticmethod
    def live_inputs(tensors: Iterable[torch.Tensor], device: torch.device) -> dict[int, Any]:
        """``_cdata`` -> weak reference of the input storages of a *virtual* op.

        A region runs many ops; an input may die inside it and a new storage may reuse
        its address, so "is this output an alias of an input" must compare identity,
        not the address alone (see :meth:`is_input_alias`)."""
        refs: dict[int, Any] = {}
        for tensor in tensors:
            if tensor.device == device and owns_storage(tensor):
                storage = tensor.untyped_storage()
                refs[storage._cdata] = weakref.ref(storage)
        return refs

    @staticmethod
    def is_input_alias(storage: torch.UntypedStorage, keys: Any) -> bool:
        """Whether ``storage`` is one of the op's input storages (``keys`` from
        :meth:`guard` for aten ops, whose inputs stay alive, or :meth:`live_inputs`)."""
        key = storage._cdata
        if isinstance(keys, dict):
            ref = keys.get(key)
            return ref is not None and ref() is storage
        return key in keys

    def page_in(self, sid: StorageId, where: Any) -> None:
        """Make ``sid`` resident now (synchronously) or refuse if its bytes are gone."""
        state = self.manager.state(sid)
        if state is BufferState.HOST:
            with _disable_current_modes():
                self.manager.device_storage(sid)
            nbytes = self.manager.buffer(sid).nbytes
            self._resident += nbytes
            self.stats.demand_loads += 1
            self.stats.bytes_h2d += nbytes
            self.stats.transfers += 1
            self.after_page_in(sid)
        elif state is BufferState.RELEASED:
            raise OffloadSessionError(
                f"op {self.index} ({where}): reads storage {sid}, whose device and host copies "
                "were both released after what the warmup step recorded as its last use; the "
                "step no longer matches the recorded trace. Call session.reset() to re-warm "
                "(or set OffloadConfig(rewarm_on_mismatch=True))"
            )

    def after_page_in(self, sid: StorageId) -> None:
        """Hook: a storage was demand-paged back (warmup unbinds it again)."""

    def apply_actions(self, actions: tuple[ResidencyAction, ...]) -> None:
        """Run schedule actions through the manager, keeping the byte counters."""
        manager = self.manager
        stats = self.stats
        # Runtime copies are not ops of the model: hide them from modes entered before
        # the session (a meter); with none on the stack there is nothing to switch off.
        modes_off = _disable_current_modes() if torch._C._len_torch_dispatch_stack() else nullcontext()
        with modes_off:
            for action in actions:
                kind = action.kind
                if kind is ActionKind.COPY_H2D and manager.is_resident(action.storage):
                    # Demand-paged earlier (a read the trace could not see, e.g. through a
                    # closure inside an opaque region): the bytes are already there.
                    continue
                if kind is ActionKind.LOAD_FROM_DISK and (
                        manager.is_resident(action.storage) or manager.has_host_copy(action.storage)):
                    continue  # likewise, paged back from disk already
                manager.apply(action)
                if kind is ActionKind.RELEASE_DEVICE:
                    self._resident -= manager.buffer(action.storage).nbytes
                elif kind is ActionKind.COPY_H2D:
                    nbytes = manager.buffer(action.storage).nbytes
                    self._resident += nbytes
                    stats.bytes_h2d += nbytes
                    stats.transfers += 1
                elif kind is ActionKind.COPY_D2H:
                    stats.bytes_d2h += manager.buffer(action.storage).nbytes
                    stats.transfers += 1
                elif kind is ActionKind.SPILL_TO_DISK:
                    stats.bytes_to_disk += manager.buffer(action.storage).nbytes
                elif kind is ActionKind.LOAD_FROM_DISK:
                    stats.bytes_from_disk += manager.buffer(action.storage).nbytes

    def sample(self) -> None:
        """Record resident bytes right after an op ran (before its post actions)."""
        resident = self._resident
        self.stats.resident_curve.append(resident)
        if resident > self.stats.peak_resident_bytes:
            self.stats.peak_resident_bytes = resident

    def close_stats(self, pool: PinnedMemoryPool) -> StepStats:
        self.stats.ops = self.index
        self.stats.pool = pool.stats()
        disk = self.manager.disk
        self.stats.disk = None if disk is None else disk.stats()
        return self.stats


class ActiveSession(Protocol):
    """What the hooks need of an active ``OffloadSession``."""

    @property
    def executor(self) -> BaseExecutor | None:
        """The executor of the step in progress (None between steps)."""
        ...


_ACTIVE: ContextVar[ActiveSession | None] = ContextVar("hyper_offload_session", default=None)


def current_session() -> ActiveSession | None:
    """The ``OffloadSession`` whose ``with`` block is active in this context, if any."""
    return _ACTIVE.get()


def active_executor() -> BaseExecutor | None:
    """The active session's executor while its step runs (None outside a step or once the
    executor is closed: nothing is tracked then)."""
    session = _ACTIVE.get()
    executor = None if session is None else session.executor
    return None if executor is None or executor.closed else executor


def activate(session: ActiveSession) -> Token[ActiveSession | None]:
    """Make ``session`` the active one; pass the token to :func:`deactivate`."""
    return _ACTIVE.set(session)


def deactivate(token: Token[ActiveSession | None]) -> None:
    """Restore whatever was active before the matching :func:`activate`."""
    _ACTIVE.reset(token)
