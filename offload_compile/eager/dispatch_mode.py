"""What the eager door sees of each op and storage: ``ActivationDispatchMode`` with the
small, allocation-light helpers of the op hot path, and ``ActivationTracker``, which
storages the current step created and whether they live.

The mode is deliberately thin: every aten op that runs while an ``OffloadSession`` is
active goes to the current executor's :meth:`~OpDispatcher.dispatch`, which decides what
to record or which residency actions to run around the op. Inside ``__torch_dispatch__``
the mode is already popped from the mode stack, so the executor's ``func(*args)`` runs the
real kernel (and any mode entered *before* the session, such as a ``DeviceMemoryMeter``).

**The tracker.** The eager warmup executor sees tensors, the IR speaks of storages. The
tracker gives every storage an op *creates* during the step a :data:`StorageId` (dense,
from 0, in creation order) and forgets it when the storage dies, so that a later
allocation that happens to reuse the address never inherits the id.

Identity is the storage object: ``UntypedStorage._cdata`` while the storage lives.
Storages that existed before the step (parameters, inputs, buffers, optimizer state)
are never tracked: they are not activations, and no plan may move them.

Who holds what: the tracker follows storages through a
:class:`~hyper_offload.runtime.memory_meter.StorageLedger` (weak references only), so it
never keeps an activation alive. Liveness at the end of the step is read from the storage's own use
count (:meth:`ActivationTracker.referenced_elsewhere`), because a storage offloaded by
the warmup executor is also held by the ``ResidencyManager`` and its weak reference
would never fire.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from types import MethodType
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map_only

from hyper_offload.errors import ConfigurationError
from hyper_offload.passes.ir.trace import StorageId
from hyper_offload.runtime.memory_meter import StorageLedger

__all__ = [
    "ActivationDispatchMode",
    "ActivationTracker",
    "OpDispatcher",
    "PARAMETER_MEMORY",
    "TrackedStorage",
    "device_test",
    "estimate_new_bytes",
    "flat_tensors",
    "owns_storage",
    "result_tensors",
    "tensor_leaves",
    "written_arguments",
]

_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE
_active_mode = torch._C._get_dispatch_mode


class OpDispatcher(Protocol):
    """What the mode forwards ops to (the executors of :mod:`.executor_base`)."""

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func(*args, **kwargs)`` with whatever the step does around it."""
        ...


class ActivationDispatchMode(TorchDispatchMode):
    """Forwards every op to ``executor.dispatch`` (design section 5.1).

    ``on_error(error, where)``: called when an op raised (its kernel, or the executor
    around it), before the error propagates unchanged: whether or not the user catches
    it, the step is then no trace to plan from."""

    def __init__(
        self, executor: OpDispatcher,
        on_error: Callable[[BaseException, str], None] | None = None,
    ) -> None:
        super().__init__()
        self.executor = executor
        self.on_error = on_error

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _active_mode(_FAKE_MODE) is not None:
            # Shape propagation on fake tensors (DTensor's sharding rules run ops, and
            # factories, under a FakeTensorMode): no device memory to track. Run the op
            # on the fake mode below; returning NotImplemented would fail, as FakeTensor
            # defers to an active fake mode.
            return func(*args, **(kwargs or {}))
        if func.namespace == "profiler":
            # record_function's enter and exit (a handle, no tensor) annotate a step and
            # come and go between steps of the same compute: Optimizer.zero_grad and
            # Optimizer.step record one each, so under gradient accumulation only some
            # micro-batches run them (Lightning calls zero_grad between forward and
            # backward); a profiler schedule records its active steps only. No part of
            # the step's trace.
            return func(*args, **(kwargs or {}))
        for tensor_type in types:
            if tensor_type.__torch_dispatch__ is not _PLAIN_DISPATCH:
                # A tensor subclass (DTensor, TwoTensor) unwraps itself first; its
                # inner ops come back here with plain tensors.
                return NotImplemented
        try:
            return self.executor.dispatch(func, args, kwargs or {})
        except BaseException as error:
            if self.on_error is not None:
                self.on_error(error, f"op {func}")
            raise


def owns_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a strided tensor over a storage of its own bytes.

    False for sparse layouts, for wrapper subclasses (DTensor, the functional
    collectives' ``AsyncCollectiveTensor``): a wrapper's
    ``untyped_storage()`` is a placeholder with no data, and its inner tensors reach the
    mode as plain tensors through the subclass's own dispatch, where they are tracked;
    and for an efficient zero tensor (``sgn``'s derivative of a real input, many a
    formula's zero gradient): its storage claims bytes but has no data, and copying it
    to the host read address 0 (a segmentation fault, found by the op database sweep).
    """
    return (tensor.layout is torch.strided and type(tensor).__torch_dispatch__ is _PLAIN_DISPATCH
            and not tensor._is_zerotensor())


def tensor_leaves(value: Any) -> Iterator[torch.Tensor]:
    """Tensors in an op's arguments or result, in pytree leaf order.

    Aten arguments nest at most lists/tuples of tensors (``cat``, ``_foreach_*``) and
    results are a tensor, a tuple or a list, so a short recursion beats ``tree_flatten``
    on the hot path and allocates nothing but the generator.
    """
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item
            elif isinstance(item, (tuple, list, dict)):
                yield from tensor_leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensor_leaves(item)


def flat_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Tensor arguments of an aten op (top level and one list level), as a list: the
    replay hot path's cheaper :func:`tensor_leaves` (aten schemas nest no deeper)."""
    out: list[torch.Tensor] = []
    for value in args:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif type(value) is list or type(value) is tuple:
            out.extend(item for item in value if isinstance(item, torch.Tensor))
    if kwargs:
        for value in kwargs.values():
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif type(value) is list or type(value) is tuple:
                out.extend(item for item in value if isinstance(item, torch.Tensor))
    return out


def result_tensors(result: Any) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
    """Tensor leaves of an op result (a tensor, or a flat tuple/list of them)."""
    if isinstance(result, torch.Tensor):
        return (result,)
    if type(result) is tuple or type(result) is list:
        if all(isinstance(item, torch.Tensor) for item in result):
            return result
    return list(tensor_leaves(result))


def device_test(device: torch.device) -> Any:
    """A fast ``tensor -> bool`` "is on ``device``" for the hot path (``tensor.device``
    builds a new ``torch.device`` per call)."""
    if device.type == "cpu":
        return lambda t: t.is_cpu
    if device.type == "cuda" and torch.cuda.device_count() == 1:
        return lambda t: t.is_cuda
    return lambda t: t.device == device


def written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of every argument the op's schema marks as mutated
    (``Tensor(a!)``): the op WRITEs their storages. Non-aten callables write nothing."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    return tuple(
        (position, argument.name)
        for position, argument in enumerate(schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


PARAMETER_MEMORY = frozenset({"fsdp"})
"""Namespaces of ops that make or fill parameters' memory (FSDP2's all-gather and
reduce-scatter buffers): what they create or touch is left untracked, in place."""


def argument_tensors(
    args: tuple[Any, ...], kwargs: dict[str, Any], writes: tuple[tuple[int, str], ...] | None
) -> list[tuple[torch.Tensor, bool]]:
    """An op's tensor arguments, each with whether the op writes it: the arguments its
    schema marks written (``writes``), or every one for a ``Work``-returning op
    (``writes is None``: ``recv_`` fills tensors its schema does not mark)."""
    if writes is None:
        return [(t, True) for t in tensor_leaves((args, kwargs))]
    written_pos = {p for p, _ in writes}
    written_names = {n for _, n in writes}
    tensors: list[tuple[torch.Tensor, bool]] = []
    for position, value in enumerate(args):
        tensors.extend((t, position in written_pos) for t in tensor_leaves(value))
    for key, value in kwargs.items():
        tensors.extend((t, key in written_names) for t in tensor_leaves(value))
    return tensors


def estimate_new_bytes(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> int:
    """Bytes of the storages ``func`` will allocate, from a run on meta tensors; 0 when the
    op has no meta kernel (data-dependent shapes, ops with side effects)."""
    def to_meta(t: torch.Tensor) -> torch.Tensor:
        if t.device != device or not owns_storage(t):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    with _disable_current_modes():
        try:
            meta_args, meta_kwargs = tree_map_only(torch.Tensor, to_meta, (args, kwargs))
            if "device" in meta_kwargs:  # factory ops (randn, empty, ...) allocate on meta
                meta_kwargs = {**meta_kwargs, "device": torch.device("meta")}
            meta_inputs = {t.untyped_storage()._cdata for t in tensor_leaves((meta_args, meta_kwargs)) if t.is_meta}
            if not meta_inputs and "device" not in meta_kwargs:
                return 0  # nothing would run on meta: never run the real kernel (RNG, cost)
            result = func(*meta_args, **meta_kwargs)
        except Exception:
            return 0
        seen: set[int] = set()
        total = 0
        for tensor in tensor_leaves(result):
            if not tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in meta_inputs or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
    return total


# ---------------------------------------------------------------- the tracker

def _dead_ref() -> None:
    """Stands in for the weak reference of a storage recorded as already dead."""
    return None


class TrackedStorage:
    """One tracked storage: its id, size at creation, producing op and a weak reference."""

    __slots__ = ("sid", "nbytes", "producer", "ref", "alive")

    def __init__(self, sid: StorageId, nbytes: int, producer: int, ref: weakref.ref) -> None:
        self.sid = sid
        self.nbytes = nbytes
        self.producer = producer
        self.ref = ref
        self.alive = True

    def __repr__(self) -> str:
        state = "alive" if self.alive else "dead"
        return f"TrackedStorage({self.sid}, {self.nbytes} B, from op {self.producer}, {state})"


class ActivationTracker:
    """Storage ids for storages created during one step (see the module docstring).

    ``on_free(sid)`` is called when a tracked storage is freed (its last reference
    dropped); the warmup executor uses it to keep its resident-bytes count exact.
    """

    def __init__(self, on_free: Callable[[StorageId], None] | None = None) -> None:
        self._live: StorageLedger[TrackedStorage] = StorageLedger(self._freed)
        self._entries: dict[StorageId, TrackedStorage] = {}
        self._next_sid = 0
        # Weakly, when it is a method of the executor that owns this tracker: a strong one
        # would make a cycle that keeps the executor, its manager and every host buffer
        # alive until a garbage collection (measured: at interpreter exit, after the
        # process group was destroyed, where gloo aborts the process).
        self._on_free: Callable[[], Callable[[StorageId], None] | None] | None = (
            None if on_free is None
            else weakref.WeakMethod(on_free) if isinstance(on_free, MethodType)
            else (lambda: on_free)
        )

    # ------------------------------------------------------------------ queries

    def sid_of(self, storage: torch.UntypedStorage) -> StorageId | None:
        """The id of ``storage`` if the step created it and it is alive, else None."""
        entry = self._live.get(storage)
        return None if entry is None else entry.sid

    def entry(self, sid: StorageId) -> TrackedStorage:
        return self._entries[sid]

    def storage(self, sid: StorageId) -> torch.UntypedStorage | None:
        """The storage object of ``sid`` while it lives, else None."""
        entry = self._entries[sid]
        return entry.ref() if entry.alive else None

    def referenced_elsewhere(self, sid: StorageId) -> bool:
        """Whether any tensor (a user variable, autograd's saved tensors, a view) still
        points at ``sid``'s storage. The storage's Python object counts once however many
        Python references it has, so a use count above one means a tensor holds it."""
        storage = self.storage(sid)
        if storage is None:
            return False
        return torch._C._storage_Use_Count(storage._cdata) > 1

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[TrackedStorage]:
        return iter(list(self._entries.values()))

    def sizes(self) -> dict[StorageId, int]:
        return {sid: e.nbytes for sid, e in self._entries.items()}

    # ------------------------------------------------------------------ updates

    def adopt(self, storage: torch.UntypedStorage, producer: int) -> StorageId:
        """Start tracking ``storage`` (created by op ``producer``); returns its new id."""
        tracked = self._live.get(storage)
        if tracked is not None:
            raise ConfigurationError(
                f"ActivationTracker.adopt: storage already tracked as "
                f"{tracked.sid}; look it up with sid_of() first"
            )
        return self.adopt_as(storage, self._next_sid, storage.nbytes(), producer)

    def adopt_as(
        self, storage: torch.UntypedStorage, sid: StorageId, nbytes: int, producer: int
    ) -> StorageId:
        """Track ``storage`` under a given id (continuing a step another executor began);
        later fresh ids start above it."""
        if sid in self._entries:
            raise ConfigurationError(f"ActivationTracker.adopt_as: storage id {sid} is already in use")
        entry = TrackedStorage(sid, nbytes, producer, _dead_ref)  # type: ignore[arg-type]
        entry.ref = self._live.add(storage, entry)
        self._entries[sid] = entry
        self._next_sid = max(self._next_sid, sid + 1)
        return sid

    def add_dead(self, sid: StorageId, nbytes: int, producer: int) -> None:
        """Record a storage of the step that no longer lives (its size stays in the trace)."""
        if sid in self._entries:
            raise ConfigurationError(f"ActivationTracker.add_dead: storage id {sid} is already in use")
        entry = TrackedStorage(sid, nbytes, producer, _dead_ref)  # type: ignore[arg-type]
        entry.alive = False
        self._entries[sid] = entry
        self._next_sid = max(self._next_sid, sid + 1)

    def add_virtual(self, nbytes: int, producer: int) -> StorageId:
        """A new id for bytes no storage of the step holds for the session (an opaque
        region's own saved activations): sized, never alive; returns the id."""
        sid = self._next_sid
        self.add_dead(sid, nbytes, producer)
        return sid

    def grow(self, sid: StorageId, nbytes: int) -> None:
        """Record that ``sid`` grew (an op resized it); sizes are the maximum seen."""
        entry = self._entries[sid]
        entry.nbytes = max(entry.nbytes, nbytes)

    def clear(self) -> None:
        """Forget everything (between steps); pending weakref callbacks become no-ops."""
        for entry in self._entries.values():
            entry.alive = False
        self._live.clear()
        self._entries = {}
        self._next_sid = 0

    def _freed(self, entry: TrackedStorage) -> None:
        """A tracked storage died (the ledger's callback)."""
        if not entry.alive:
            return
        entry.alive = False
        on_free = self._on_free() if self._on_free is not None else None
        if on_free is not None:
            on_free(entry.sid)
