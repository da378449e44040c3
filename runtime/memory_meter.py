"""A dispatch-level live-storage meter: bytes of device-resident storages, op by op.

``DeviceMemoryMeter`` proves memory claims on machines without an accelerator, where
``torch.cuda.memory_allocated()`` does not exist and the CPU allocator keeps no counters.
It is a :class:`~torch.utils._python_dispatch.TorchDispatchMode`; every aten op that runs
while it is active (forward *and* backward: the autograd engine carries the dispatch-mode
stack into the threads it runs backward on) is followed by one :class:`MemorySample`.

What counts as live device bytes (the invariant every sample obeys)::

    live_bytes = sum(storage.nbytes() for storage in tracked
                     if storage is alive and not host-labelled)

``tracked`` is

* every storage registered up front with :meth:`DeviceMemoryMeter.register` (parameters,
  inputs: they exist before the step, so no op creates them), and
* every storage on the meter's device that an op returns and that is *not* the storage of
  one of the op's inputs (a fresh allocation; views and in-place results share their
  input's storage, so they are never counted twice).

Storages that existed before the meter and were not registered are ignored, including
views of them. Storages are the unit, never tensors: two views of one storage count once.
Wrapper tensor subclasses are opened to their inner tensors; sparse layouts, which have
no single storage, are not metered.

How the pieces stay exact:

* **Frees.** A storage's Python object is preserved for as long as its C++ storage lives,
  so a weak reference with a callback on it fires exactly when the bytes are returned to
  the allocator (the last view, saved tensor or graph reference dropped).
* **Resizes.** ``resize_`` on a tensor or directly on an ``UntypedStorage`` (how the
  runtime frees device memory) changes ``nbytes()`` without an op result; the meter
  re-reads ``nbytes()`` of every tracked storage after each op.
* **Host buffers.** On CPU the "device" and host memory are the same allocator. Host
  buffers (pool buffers, offloaded copies) carry a label set with :func:`label_host` and
  are excluded from device bytes from the moment they are labelled.

**One storage ledger.** :class:`StorageLedger` is how everything in the library that
follows storages over a step follows them: this meter, the eager door's
``ActivationTracker`` and the compile door's ``EagerMeter``. Each keeps its own record per
storage (bytes counted, a storage id, a log key); the ledger owns the weak references and
the one rule that keeps them exact: a record ends when its storage dies, never because a
later storage reuses the address.

On an accelerator the meter additionally reads the allocator's own figures for the whole
``with`` block: ``allocator_base_bytes`` (``memory_allocated`` at entry, i.e. everything
alive before the step, cuBLAS workspaces and leftovers of earlier work included),
``allocator_peak_bytes`` (``max_memory_allocated``), ``allocator_step_peak_bytes`` (the
peak minus the base: what the step itself added) and ``allocator_reserved_peak_bytes``
(``max_memory_reserved``: allocated bytes can drop while blocks are still held, e.g.
freed blocks waiting for a side stream, so the reserved peak is reported beside it).
"""

from __future__ import annotations

import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from hyper_offload.errors import ConfigurationTypeError, OffloadRuntimeError
from hyper_offload.passes.ir.ops import HOST_LABEL

from .device import DeviceLike, resolve_device

# The attribute that marks an UntypedStorage as host memory. It lives on the storage
# object itself (whose Python object is preserved while the storage lives), so every
# meter, on every thread, sees the same label without any shared registry; the IR owns
# the name because copy_d2h's fake kernel labels fake host copies too.
_HOST_LABEL = HOST_LABEL

__all__ = [
    "DeviceMemoryMeter",
    "MemorySample",
    "StorageLedger",
    "is_host_labelled",
    "label_host",
]


class MemorySample(NamedTuple):
    """Live device bytes right after one op.

    ``index`` counts ops seen by the meter from 0. ``live_bytes`` is measured after the op
    returned, before the caller dropped any of its inputs: the highest point of the op
    itself, since an op allocates its outputs while its inputs are still alive.
    ``peak_bytes`` is the highest live value since the previous sample (at least
    ``live_bytes``; larger when a storage grew and shrank again between two ops).
    """

    index: int
    op: str
    live_bytes: int
    peak_bytes: int

    def __repr__(self) -> str:
        return f"#{self.index} {self.op}: live={self.live_bytes} peak={self.peak_bytes}"


def _as_storage(obj: torch.Tensor | torch.UntypedStorage) -> torch.UntypedStorage:
    if isinstance(obj, torch.UntypedStorage):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage()
    raise ConfigurationTypeError(
        f"expected a torch.Tensor or torch.UntypedStorage, got {type(obj).__name__}; "
        "pass the tensor whose storage should be labelled or registered"
    )


def label_host(*objs: torch.Tensor | torch.UntypedStorage) -> None:
    """Mark the storages of ``objs`` as host memory: no meter counts them as device bytes.

    The label belongs to the storage (all its views share it) and lasts as long as the
    storage. The runtime labels every buffer it takes from the host pool; tests and users
    label any other host tensor they create during a metered step.
    """
    for obj in objs:
        setattr(_as_storage(obj), _HOST_LABEL, True)


def is_host_labelled(obj: torch.Tensor | torch.UntypedStorage) -> bool:
    """True when :func:`label_host` marked the storage of ``obj`` as host memory."""
    return bool(getattr(_as_storage(obj), _HOST_LABEL, False))


def _leaf_tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Plain tensors in ``values``; wrapper subclasses are opened to their inner tensors."""
    for value in values:
        if not isinstance(value, torch.Tensor):
            continue
        if value.layout is not torch.strided:
            continue  # sparse/mkldnn tensors expose no single storage; not metered
        if is_traceable_wrapper_subclass(value):
            attrs, _ = value.__tensor_flatten__()
            yield from _leaf_tensors(getattr(value, name) for name in attrs)
        else:
            yield value


def _storages_of(values: Sequence[Any]) -> Iterator[torch.UntypedStorage]:
    for value in values:
        if isinstance(value, torch.UntypedStorage):
            yield value
    for tensor in _leaf_tensors(values):
        yield tensor.untyped_storage()


R = TypeVar("R")


class StorageLedger(Generic[R]):
    """Live storages, one record each (module docstring, "One storage ledger").

    Keyed by the storage's address (``_cdata``: the same for every Python handle of a
    storage while it lives, reused only once it died). A record ends exactly when its
    storage dies: a weak reference's callback, which may run inside any code and on any
    thread (a collection, autograd's threads), removes it and hands it to ``on_death``;
    a storage born later at the same address is another entry, which no earlier
    callback touches. Nothing here keeps anything alive: the ledger holds storages
    weakly, its callbacks hold the ledger weakly, and it holds ``on_death`` weakly when
    that is a bound method (its owner's)."""

    def __init__(self, on_death: Callable[[R], None] | None = None) -> None:
        self._entries: dict[int, tuple[weakref.ref[torch.UntypedStorage], R]] = {}
        self._on_death: Callable[[], Callable[[R], None] | None] = (
            (lambda: None) if on_death is None
            else weakref.WeakMethod(on_death) if isinstance(on_death, types.MethodType)
            else (lambda: on_death))

    def __repr__(self) -> str:
        return f"StorageLedger({len(self._entries)} live)"

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, storage: torch.UntypedStorage) -> bool:
        return storage._cdata in self._entries

    def add(self, storage: torch.UntypedStorage, record: R) -> weakref.ref[torch.UntypedStorage]:
        """Follow ``storage`` with ``record``; returns the weak reference, whose callback
        ends the record. A storage added again takes the new record; the old one is
        forgotten (it never reaches ``on_death``)."""
        key, ledger = storage._cdata, weakref.ref(self)

        def died(ref: weakref.ref[torch.UntypedStorage]) -> None:
            owner = ledger()
            if owner is not None:
                owner._end(key, ref)

        ref = weakref.ref(storage, died)
        self._entries[key] = (ref, record)
        return ref

    def get(self, storage: torch.UntypedStorage) -> R | None:
        """``storage``'s record while it lives, else None."""
        entry = self._entries.get(storage._cdata)
        return None if entry is None else entry[1]

    def records(self) -> list[R]:
        """The records of the storages alive now."""
        return [record for _, record in list(self._entries.values())]

    def storages(self) -> list[tuple[torch.UntypedStorage, R]]:
        """The storages alive now, each with its record."""
        alive = []
        for ref, record in list(self._entries.values()):  # a copy: deaths may shrink it
            storage = ref()
            if storage is not None:
                alive.append((storage, record))
        return alive

    def clear(self) -> None:
        """Forget every storage; their callbacks, still pending, end nothing."""
        self._entries = {}

    def _end(self, key: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        entry = self._entries.get(key)
        if entry is None or entry[0] is not ref:
            return  # forgotten (clear) or a newer storage at the same address
        del self._entries[key]
        on_death = self._on_death()
        if on_death is not None:
            on_death(entry[1])


@dataclass
class _Tracked:
    """The bytes last counted for one tracked storage."""

    counted_bytes: int


class DeviceMemoryMeter(TorchDispatchMode):
    """Op-by-op live bytes of the storages on ``device`` (see the module docstring).

    Usage::

        meter = DeviceMemoryMeter("cpu")
        meter.register(*model.parameters(), x)
        with meter:
            loss = model(x)
            loss.backward()
        meter.peak_bytes, meter.curve(), meter.samples

    A meter is single-use: entering it a second time raises, so that samples of two
    steps are never mixed. Reading results is thread-safe; frees reported from autograd
    threads are serialised by a lock.
    """

    def __init__(self, device: DeviceLike = None) -> None:
        """``device``: the device whose bytes count (``None``: the current accelerator,
        else CPU). On CPU, host-labelled storages are excluded."""
        super().__init__()
        self.device = _normalise_device(resolve_device(device))
        # Re-entrant: dropping the last reference to a storage while holding the lock runs
        # its weakref callback on this thread, and the callback takes the lock too.
        self._lock = threading.RLock()
        self._tracked: StorageLedger[_Tracked] = StorageLedger(self._forget)
        self._live = 0
        self._window_peak = 0
        self._peak = 0
        self._samples: list[MemorySample] = []
        self._used = False
        self.allocator_peak_bytes: int | None = None
        """Peak of the accelerator allocator during the ``with`` block (None on CPU)."""
        self.allocator_base_bytes: int | None = None
        """Allocated bytes at entry, after a synchronize (None on CPU)."""
        self.allocator_reserved_peak_bytes: int | None = None
        """Peak reserved bytes during the ``with`` block (None on CPU)."""

    # -- registration -------------------------------------------------------------------

    def register(self, *tensors: torch.Tensor | torch.UntypedStorage) -> DeviceMemoryMeter:
        """Count the storages of ``tensors`` (parameters, inputs) from now on.

        Storages on other devices, and host-labelled ones, are accepted and ignored, so
        ``register(*model.parameters())`` is always safe. Returns ``self`` for chaining.
        """
        for obj in tensors:
            if isinstance(obj, torch.Tensor) and is_traceable_wrapper_subclass(obj):
                storages = list(_storages_of([obj]))
            else:
                storages = [_as_storage(obj)]  # raises on anything else, naming the fix
            for storage in storages:
                self._track(storage)
        return self

    def label_host(self, *objs: torch.Tensor | torch.UntypedStorage) -> None:
        """Same as the module-level :func:`label_host`, and re-count immediately."""
        label_host(*objs)
        self._rescan()

    # -- results --------------------------------------------------------------------------

    @property
    def samples(self) -> tuple[MemorySample, ...]:
        """One sample per op seen, in execution order."""
        with self._lock:
            return tuple(self._samples)

    @property
    def live_bytes(self) -> int:
        """Live device bytes now; re-reads sizes, so direct ``storage.resize_`` shows."""
        self._rescan()
        with self._lock:
            return self._live

    @property
    def peak_bytes(self) -> int:
        """Highest live device bytes since registration began (registered bytes included)."""
        with self._lock:
            return self._peak

    @property
    def sample_count(self) -> int:
        """Number of samples taken so far (an index for :meth:`peak_since`)."""
        with self._lock:
            return len(self._samples)

    def peak_since(self, index: int) -> int | None:
        """Highest ``live_bytes`` of the samples from ``index`` on (``None`` if none yet);
        cheap: it does not copy the sample list."""
        with self._lock:
            if index >= len(self._samples):
                return None
            return max(self._samples[i].live_bytes for i in range(index, len(self._samples)))

    def curve(self) -> list[int]:
        """``live_bytes`` of every sample: the resident-bytes curve, one entry per op."""
        return [sample.live_bytes for sample in self.samples]

    def ops(self) -> list[str]:
        """Op names of every sample, aligned with :meth:`curve`."""
        return [sample.op for sample in self.samples]

    @property
    def allocator_step_peak_bytes(self) -> int | None:
        """What the step added to the allocator at its peak: ``allocator_peak_bytes`` minus
        ``allocator_base_bytes`` (None on CPU). Compare with ``peak_bytes`` minus the
        registered bytes, never with the raw peak, which includes unrelated live memory."""
        if self.allocator_peak_bytes is None or self.allocator_base_bytes is None:
            return None
        return self.allocator_peak_bytes - self.allocator_base_bytes

    def allocator_summary(self) -> str:
        """The accelerator figures in one line (allocated and reserved side by side)."""
        if self.allocator_peak_bytes is None:
            return f"{self.device}: no allocator figures (meter-only device)"
        return (
            f"{self.device}: max_memory_allocated {self.allocator_peak_bytes} B "
            f"(step +{self.allocator_step_peak_bytes} B over {self.allocator_base_bytes} B at "
            f"entry), max_memory_reserved {self.allocator_reserved_peak_bytes} B"
        )

    # -- dispatch mode --------------------------------------------------------------------

    def __enter__(self) -> DeviceMemoryMeter:
        if self._used:
            raise OffloadRuntimeError(
                "DeviceMemoryMeter: a meter measures exactly one step and was already "
                "entered; create a new DeviceMemoryMeter for the next measurement"
            )
        self._used = True
        self._rescan()
        module = self._accelerator_module()
        if module is not None:
            module.synchronize(self.device)
            module.reset_peak_memory_stats(self.device)
            self.allocator_base_bytes = int(module.memory_allocated(self.device))
        return super().__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            module = self._accelerator_module()
            if module is not None:
                module.synchronize(self.device)
                self.allocator_peak_bytes = int(module.max_memory_allocated(self.device))
                self.allocator_reserved_peak_bytes = int(module.max_memory_reserved(self.device))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "profiler":
            # record_function's enter and exit annotate the step and allocate nothing;
            # the eager door leaves them out of its trace, so no sample either (the
            # curve stays aligned with the plan's, op for op).
            return out
        flat_in, _ = tree_flatten((args, kwargs))
        flat_out, _ = tree_flatten(out)
        # Re-count what existed first (frees and resizes since the last op, growth of
        # inputs by this op), then add the fresh outputs: a storage shrunk before the op
        # and an output allocated by it never appear to be alive at the same time.
        self._rescan()
        input_keys = {s._cdata for s in _storages_of(flat_in)}
        for storage in _storages_of(flat_out):
            if storage._cdata not in input_keys:
                self._track(storage)
        with self._lock:
            self._samples.append(
                MemorySample(len(self._samples), str(func), self._live, self._window_peak)
            )
            self._window_peak = self._live
        return out

    # -- bookkeeping ----------------------------------------------------------------------

    def _accelerator_module(self) -> Any | None:
        if self.device.type == "cpu":
            return None
        module = torch.get_device_module(self.device)
        needed = ("max_memory_allocated", "max_memory_reserved", "memory_allocated")
        if not all(hasattr(module, name) for name in needed) or not module.is_available():
            return None
        return module

    def _counts(self, storage: torch.UntypedStorage) -> bool:
        return _normalise_device(storage.device) == self.device and not getattr(
            storage, _HOST_LABEL, False
        )

    def _track(self, storage: torch.UntypedStorage) -> None:
        """Start counting ``storage`` unless it is already tracked or on another device."""
        if _normalise_device(storage.device) != self.device:
            return
        with self._lock:
            if storage in self._tracked:
                return
            nbytes = storage.nbytes() if self._counts(storage) else 0
            self._tracked.add(storage, _Tracked(nbytes))
            self._add(nbytes)

    def _forget(self, entry: _Tracked) -> None:
        """A tracked storage died (the ledger's callback, on any thread)."""
        with self._lock:
            self._add(-entry.counted_bytes)

    def _rescan(self) -> None:
        """Re-read ``nbytes()`` and the host label of every tracked storage."""
        with self._lock:
            for storage, entry in self._tracked.storages():
                nbytes = storage.nbytes() if self._counts(storage) else 0
                if nbytes != entry.counted_bytes:
                    self._add(nbytes - entry.counted_bytes)
                    entry.counted_bytes = nbytes

    def _add(self, delta: int) -> None:
        # Caller holds the lock.
        self._live += delta
        self._window_peak = max(self._window_peak, self._live)
        self._peak = max(self._peak, self._live)


def _normalise_device(device: torch.device) -> torch.device:
    """``cuda`` and ``cuda:<current>`` are the same device; CPU has no index."""
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is not None:
        return device
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and accelerator.type == device.type:
        return torch.device(device.type, torch.accelerator.current_device_index())
    return device
