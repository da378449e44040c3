"""Device-agnostic transfer layer: one copy engine per device, async copies, events.

Everything goes through ``torch.accelerator`` and ``torch.get_device_module(device)``, so
the same code drives CUDA (and any other accelerator with streams and events) and plain
CPU:

* On an accelerator a :class:`TransferEngine` owns one dedicated *copy stream*. A copy is
  enqueued on it after the current *compute stream* (the copy stream waits on it, so the
  copy sees every kernel that produced its source), with ``non_blocking=True``, and an
  event is recorded after it. The returned :class:`Transfer` carries that event.
* On CPU there are no streams, events or pinned memory (the CPU build raises on all
  three), so copies are synchronous and a :class:`Transfer` is born completed with
  ``event is None``.
* A *cross-device* copy (the device-side tensor lives on another device than the engine,
  e.g. ``cuda:1`` on a ``cuda:0`` engine) falls back to a synchronous copy, as the
  HyperOffload design prescribes: correct first, overlap only where the stream is ours.

Invariants a caller may rely on:

* ``Transfer.query()`` is True only once the bytes are fully in the destination.
* ``Transfer.wait()`` orders the *current* compute stream after the copy; it does not
  block the host. ``Transfer.synchronize()`` blocks the host.
* Until a transfer is known to be complete its bytes cannot be handed back to an
  allocator mid-copy. On CUDA the device-side tensor is ``record_stream``-ed on the copy
  stream, so the caching allocator itself holds the block until the copy stream is past
  the copy, whether the tensor is dropped or its storage freed directly
  (``untyped_storage().resize_(0)``); the handle then keeps only the *host* tensor alive,
  so dropping an offloaded activation really frees its device memory while the D2H runs.
  Where ``record_stream`` is unavailable (and for synchronous test doubles) the handle
  keeps both tensors alive until it observes completion.
* A copy whose enqueue raised leaves nothing in flight: the copy stream is drained
  before the exception propagates.

Copies are byte-for-byte: source and destination must have the same shape and dtype
(no casting ever happens here; bit-exactness is the library's promise).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "DeviceLike",
    "Transfer",
    "TransferDirection",
    "TransferEngine",
    "completed_transfer",
    "device_module",
    "is_accelerator",
    "pin_memory_available",
    "resolve_device",
]

DeviceLike = torch.device | str | int | None


class TransferDirection(str, Enum):
    D2H = "D2H"
    H2D = "H2D"

    def __repr__(self) -> str:
        return self.value


def resolve_device(device: DeviceLike = None) -> torch.device:
    """``device`` as a ``torch.device`` with an explicit index for accelerators.

    ``None`` means the current accelerator if one is available, else CPU. A bare
    ``int`` is an index on the current accelerator type.
    """
    accelerator = _current_accelerator()
    if device is None:
        if accelerator is None:
            return torch.device("cpu")
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    if isinstance(device, int):
        if accelerator is None:
            raise ValueError(
                f"resolve_device({device}): an integer device index needs an accelerator, "
                "but torch.accelerator.is_available() is False; pass 'cpu' instead"
            )
        return torch.device(accelerator.type, device)
    resolved = torch.device(device)
    if is_accelerator(resolved) and resolved.index is None and torch.accelerator.is_available():
        return torch.device(resolved.type, torch.accelerator.current_device_index())
    return resolved


def _current_accelerator() -> torch.device | None:
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None


def is_accelerator(device: DeviceLike) -> bool:
    """True for device types that have their own memory (``cuda``, ``xpu``, ...), False
    for ``cpu`` and ``meta``. Says nothing about whether the device is usable here."""
    if device is None:
        return False
    if isinstance(device, int):
        return True
    return torch.device(device).type not in ("cpu", "meta")


def pin_memory_available() -> bool:
    """Whether page-locked host memory can be allocated in this process.

    Pinning needs an accelerator runtime; the CPU build raises on ``pin_memory()``.
    """
    return torch.accelerator.is_available()


def device_module(device: torch.device) -> ModuleType:
    """``torch.cuda`` for a CUDA device, ``torch.xpu`` for XPU, ... ."""
    return torch.get_device_module(device)


class Transfer:
    """Handle of one copy between device and host memory.

    ``event`` is the accelerator event recorded on the copy stream right after the copy,
    or ``None`` when the copy ran synchronously (CPU, cross-device fallback). The handle
    holds the ``keepalive`` tensors alive until it observes completion (``query()``
    returning True or ``synchronize()``), then drops them. The engine passes both tensors,
    or only the host-side one when the device side was ``record_stream``-ed (then
    ``device_side_recorded`` is True and the allocator protects the device bytes).
    """

    __slots__ = (
        "direction", "device", "nbytes", "event", "device_side_recorded", "_keepalive", "_done"
    )

    def __init__(
        self,
        direction: TransferDirection,
        device: torch.device,
        nbytes: int,
        event: Any | None,
        keepalive: tuple[torch.Tensor, ...],
        *,
        device_side_recorded: bool = False,
    ) -> None:
        self.direction = direction
        self.device = device
        self.nbytes = nbytes
        self.event = event
        # True when the device-side tensor was record_stream-ed on the copy stream, i.e.
        # its storage may be freed before the copy ends without the allocator reusing it.
        self.device_side_recorded = device_side_recorded
        self._done = event is None
        self._keepalive: tuple[torch.Tensor, ...] | None = None if self._done else keepalive

    def query(self) -> bool:
        """True once the copy has completed; never blocks."""
        if not self._done and self.event.query():
            self._mark_done()
        return self._done

    def done(self) -> bool:
        """Alias of :meth:`query`."""
        return self.query()

    def wait(self) -> None:
        """Make the current compute stream of ``device`` wait for this copy.

        Does not block the host on an accelerator. A no-op for synchronous copies (already
        complete). On a device without streams (CPU) the host *is* the compute stream, so
        a pending event is waited for by blocking.
        """
        if self._done or self.event is None:
            return
        if not is_accelerator(self.device):
            self.synchronize()
            return
        device_module(self.device).current_stream(self.device).wait_event(self.event)

    def synchronize(self) -> None:
        """Block the host until the copy has completed."""
        if self._done:
            return
        self.event.synchronize()
        self._mark_done()

    def _mark_done(self) -> None:
        self._done = True
        self._keepalive = None

    def __repr__(self) -> str:
        state = "done" if self._done else "in flight"
        return f"Transfer({self.direction.value}, {self.nbytes} B, {self.device}, {state})"


def completed_transfer(direction: TransferDirection, device: torch.device, nbytes: int) -> Transfer:
    """A handle for a copy that already finished synchronously."""
    return Transfer(direction, device, nbytes, None, ())


# What a device module must offer for asynchronous copies on a dedicated stream.
_STREAM_API = ("Stream", "Event", "stream", "current_stream")


class TransferEngine:
    """Copies between one device and host memory, asynchronously where the device allows.

    Create one per device and pass it to whoever moves bytes (there is no module-level
    engine on purpose: streams are state, and state belongs to an owner). On CPU, and on
    accelerators whose device module has no streams, the engine is a thin synchronous
    shim with ``copy_stream is None``.
    """

    def __init__(self, device: DeviceLike = None) -> None:
        self.device = resolve_device(device)
        self.copy_stream: Any | None = None
        self._module: ModuleType | None = None
        if is_accelerator(self.device):
            if not torch.accelerator.is_available():
                raise RuntimeError(
                    f"TransferEngine({self.device}): no accelerator is available in this "
                    "process (torch.accelerator.is_available() is False); create the "
                    "engine with device='cpu' for synchronous host copies"
                )
            module = device_module(self.device)
            # Backends without streams/events (e.g. MPS) get synchronous copies: correct,
            # just not overlapped.
            if all(hasattr(module, name) for name in _STREAM_API):
                self._module = module
                # A dedicated stream so copies overlap with compute on the default stream.
                self.copy_stream = module.Stream(device=self.device)

    @property
    def is_async(self) -> bool:
        """True when copies on this engine's own device run on a copy stream."""
        return self.copy_stream is not None

    def d2h(
        self, src: torch.Tensor, dst_host: torch.Tensor, *, after: Iterable[Transfer] = ()
    ) -> Transfer:
        """Copy device tensor ``src`` into host tensor ``dst_host``.

        The copy is ordered after all work already enqueued on the current compute stream
        and after every transfer in ``after``.
        """
        _check_pair("d2h", src, dst_host)
        if dst_host.device.type != "cpu":
            raise ValueError(
                f"TransferEngine.d2h: destination must be a host (cpu) tensor, got one on "
                f"{dst_host.device}; use a buffer from PinnedMemoryPool.acquire()"
            )
        return self._copy(TransferDirection.D2H, src, dst_host, device_side=src, after=after)

    def h2d(
        self, src_host: torch.Tensor, dst: torch.Tensor, *, after: Iterable[Transfer] = ()
    ) -> Transfer:
        """Copy host tensor ``src_host`` into device tensor ``dst``.

        Ordered after the current compute stream (which allocated ``dst``) and after every
        transfer in ``after`` (typically the D2H that filled ``src_host``).
        """
        _check_pair("h2d", src_host, dst)
        if src_host.device.type != "cpu":
            raise ValueError(
                f"TransferEngine.h2d: source must be a host (cpu) tensor, got one on "
                f"{src_host.device}; pass the host buffer the D2H filled"
            )
        return self._copy(TransferDirection.H2D, src_host, dst, device_side=dst, after=after)

    def synchronize(self) -> None:
        """Block the host until every copy enqueued on this engine has completed."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def _copy(
        self,
        direction: TransferDirection,
        src: torch.Tensor,
        dst: torch.Tensor,
        *,
        device_side: torch.Tensor,
        after: Iterable[Transfer],
    ) -> Transfer:
        nbytes = src.numel() * src.element_size()
        after = tuple(after)
        if self.copy_stream is None or device_side.device != self.device:
            # CPU engine, or a tensor on another device than our copy stream: a blocking
            # copy is the only one whose ordering we can guarantee without that device's
            # streams. Earlier transfers must be finished before we read/write the buffer.
            for earlier in after:
                earlier.synchronize()
            dst.copy_(src)
            return completed_transfer(direction, device_side.device, nbytes)
        return self._async_copy(direction, src, dst, device_side, after, nbytes)

    def _async_copy(
        self,
        direction: TransferDirection,
        src: torch.Tensor,
        dst: torch.Tensor,
        device_side: torch.Tensor,
        after: tuple[Transfer, ...],
        nbytes: int,
    ) -> Transfer:
        module = self._module
        stream = self.copy_stream
        assert module is not None and stream is not None
        # The copy must see everything the compute stream has enqueued so far: the kernels
        # that produced a D2H source, or the allocation of an H2D destination.
        stream.wait_stream(module.current_stream(self.device))
        for earlier in after:
            if earlier.event is not None and not earlier.query():
                stream.wait_event(earlier.event)
        try:
            with module.stream(stream):
                dst.copy_(src, non_blocking=True)
                event = module.Event()
                event.record(stream)
        except BaseException:
            # Part of the copy may already be on the stream; the caller is about to give
            # the buffers back, so nothing may still read or write them.
            stream.synchronize()
            raise
        recorded = _record_on_stream(device_side, stream)
        # Once the allocator knows the copy stream uses the device bytes, it keeps them
        # from reuse until the copy is past; holding the device tensor as well would only
        # keep e.g. an offloaded activation's memory allocated until someone queries this
        # handle (possibly the end of backward). The host side has no such protection.
        host_side = dst if direction is TransferDirection.D2H else src
        keepalive = (host_side,) if recorded else (src, dst)
        return Transfer(
            direction, self.device, nbytes, event, keepalive, device_side_recorded=recorded
        )

    def __repr__(self) -> str:
        mode = "async copy stream" if self.is_async else "synchronous"
        return f"TransferEngine({self.device}, {mode})"


def _check_pair(where: str, src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(
            f"TransferEngine.{where}: source {tuple(src.shape)}/{src.dtype} and destination "
            f"{tuple(dst.shape)}/{dst.dtype} differ; transfers copy bytes verbatim and never "
            "cast or broadcast. View both as flat uint8 of the same length"
        )


def _record_on_stream(tensor: torch.Tensor, stream: Any) -> bool:
    """Tell the caching allocator ``tensor``'s block is in use on ``stream``.

    Returns False where the backend has no such notion; callers then must keep the bytes
    alive themselves until the transfer completes.
    """
    try:
        tensor.record_stream(stream)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True
