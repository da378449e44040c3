"""Device-agnostic transfer layer: one transfer engine per device, async copies, events.

Everything goes through ``torch.accelerator`` and ``torch.get_device_module(device)``, so
the same code drives CUDA (and any other accelerator with streams and events) and plain
CPU:

* On an accelerator a :class:`TransferEngine` owns one dedicated *copy stream* (or, with
  ``copy_streams=2``, one per direction: NVIDIA GPUs run a D2H and an H2D concurrently on
  separate copy engines when they sit on separate streams). A copy is enqueued on it
  after the current *compute stream* (the copy stream waits on it, so the copy sees every
  kernel that produced its source), with ``non_blocking=True``, and an event is recorded
  after it. The returned :class:`Transfer` carries that event. With two streams nothing
  orders one direction after the other except ``after=``: every caller here names the
  transfers a copy must follow (an H2D its D2H, a D2H into a reused host buffer the H2Ds
  still reading it), which one stream would also have ordered by FIFO. One stream is the
  default: on this project's plans the timeline model predicts no gain from two
  (docs/architecture.md, "Copy engines").
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
  allocator mid-copy. By default the handle keeps the device-side tensor alive until a
  stream wait (``Transfer.wait()``) on the stream that issued the copy; after that, every
  later use of the bytes on that stream, including their reuse by the caching allocator,
  is ordered after the copy. Only a caller that may free the device bytes *before any
  stream wait* (the residency manager's RELEASE_DEVICE right after a COPY_D2H) asks for
  ``free_before_wait=True``: the engine then ``record_stream``-s the device side on the
  copy stream and the allocator protects the block. ``record_stream`` is kept to that
  case because it delays reuse of a freed block until everything queued on the copy
  stream at free time completes, while ``memory_allocated`` already dropped. The host
  side is held until the handle observes completion.
* The normal path never blocks the host; every host block (``synchronize()``, copies
  with pageable host memory, synchronous fallbacks) is counted in the engine's
  ``host_syncs`` (:class:`~hyper_offload.runtime.stats.HostSyncCounter`).
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

from hyper_offload.errors import ConfigurationError, TransferMisuseError

from .device import DeviceLike, device_module, is_accelerator, resolve_device
from .stats import HostSyncCounter, SyncReason


__all__ = [
    "Transfer",
    "TransferDirection",
    "TransferEngine",
    "completed_transfer",
]


class TransferDirection(str, Enum):
    D2H = "D2H"
    H2D = "H2D"

    def __repr__(self) -> str:
        return self.value


class Transfer:
    """Handle of one copy between device and host memory.

    ``event`` is the accelerator event recorded on the copy stream right after the copy,
    or ``None`` when the copy ran synchronously (CPU, cross-device fallback).

    What the handle keeps alive (the engine decides, see :meth:`TransferEngine.d2h`):

    * ``keepalive``: held until the handle observes completion (``query()`` True or
      ``synchronize()``): the host side, which no allocator protects.
    * ``until_wait``: held until a stream wait on the *issue stream* (``wait()``) or
      completion: the device side when it was not ``record_stream``-ed. After the issue
      stream waited, every later use of those device bytes on that stream (including
      the allocator handing them out again) is ordered after the copy, so dropping them
      is safe and frees them for real, with no deferred reuse.

    ``device_side_recorded`` is True when the device side was ``record_stream``-ed on
    the copy stream (the allocator itself then protects it if freed before any wait).
    ``issue_stream`` is the compute stream that was current when the copy was issued
    (the stream that produced a D2H source or allocated an H2D destination).
    ``host_syncs`` counts every host block this handle causes.
    """

    __slots__ = (
        "direction", "device", "nbytes", "event", "device_side_recorded", "issue_stream",
        "_module", "_host_syncs", "_keepalive", "_until_wait", "_waited_streams", "_done",
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
        until_wait: tuple[torch.Tensor, ...] = (),
        module: Any | None = None,
        issue_stream: Any | None = None,
        host_syncs: HostSyncCounter | None = None,
    ) -> None:
        self.direction = direction
        self.device = device
        self.nbytes = nbytes
        self.event = event
        self.device_side_recorded = device_side_recorded
        self.issue_stream = issue_stream
        self._module = module  # device module with streams; None: the host is the stream
        self._host_syncs = host_syncs
        self._done = event is None
        self._keepalive: tuple[torch.Tensor, ...] | None = None if self._done else keepalive
        self._until_wait: tuple[torch.Tensor, ...] | None = None if self._done else until_wait
        self._waited_streams: list[Any] = []

    def references(self, storage_key: int) -> int:
        """How many tensors over the storage whose ``_cdata`` is ``storage_key`` this
        handle still keeps alive (0 once completion was observed)."""
        held = (*(self._keepalive or ()), *(self._until_wait or ()))
        return sum(1 for t in held if t.untyped_storage()._cdata == storage_key)

    def query(self) -> bool:
        """True once the copy has completed; never blocks."""
        if not self._done and self.event.query():
            self._mark_done()
        return self._done

    def done(self) -> bool:
        """Alias of :meth:`query`."""
        return self.query()

    @property
    def stream_waited(self) -> bool:
        """Whether some stream was ordered after this copy by :meth:`wait`."""
        return bool(self._waited_streams)

    def wait(self, stream: Any | None = None) -> None:
        """Order ``stream`` (default: the current stream of ``device``) after this copy.

        Does not block the host on an accelerator. A no-op for completed copies. On a
        device without streams (CPU) the host *is* the compute stream, so a pending event
        is waited for by blocking (counted as a host sync).
        """
        if self._done:
            return
        if self._module is None:
            self.synchronize(reason=SyncReason.WAIT_WITHOUT_STREAMS)
            return
        if stream is None:
            stream = self._module.current_stream(self.device)
        stream.wait_event(self.event)
        self._waited_streams.append(stream)
        if self.issue_stream is None or stream == self.issue_stream:
            self._until_wait = None  # later uses of the device bytes follow the copy

    def order_before_free(self) -> None:
        """Make freeing the device side safe now, without blocking the host.

        The caching allocator hands a freed block out again on the stream that allocated
        it, so that stream (``issue_stream``) must be ordered after the copy unless the
        copy is complete, the device side was ``record_stream``-ed, or it already waited.
        """
        if self._done or self.device_side_recorded:
            return
        if any(s == self.issue_stream for s in self._waited_streams):
            return
        self.wait(self.issue_stream)

    def synchronize(self, *, reason: str = SyncReason.SYNCHRONIZE) -> None:
        """Block the host until the copy has completed (counted as a host sync when the
        copy was still pending)."""
        if self._done:
            return
        if self._host_syncs is not None:
            self._host_syncs.record(reason)
        self.event.synchronize()
        self._mark_done()

    def _mark_done(self) -> None:
        self._done = True
        self._keepalive = None
        self._until_wait = None

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

    ``host_syncs`` counts every time a copy of this engine blocked the host (see
    :mod:`~hyper_offload.runtime.stats`); the normal schedule path keeps it at 0.

    ``copy_streams``: 1 (default; D2H and H2D share ``copy_stream``) or 2 (H2D on its own
    ``h2d_stream``). Invariant: ``h2d_stream is copy_stream`` exactly when there is one.
    """

    def __init__(self, device: DeviceLike = None, *, copy_streams: int = 1) -> None:
        if copy_streams not in (1, 2):
            raise ConfigurationError(
                f"TransferEngine(copy_streams={copy_streams!r}): expected 1 (one copy stream "
                "for both directions) or 2 (one per direction, for concurrent D2H and H2D)"
            )
        self.device = resolve_device(device)
        self.copy_streams = copy_streams
        self.copy_stream: Any | None = None
        self._h2d_stream: Any | None = None
        self.host_syncs = HostSyncCounter()
        self._module: ModuleType | None = None
        if is_accelerator(self.device):
            if not torch.accelerator.is_available():
                raise TransferMisuseError(
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
                if copy_streams == 2:
                    self._h2d_stream = module.Stream(device=self.device)

    @property
    def h2d_stream(self) -> Any | None:
        """The stream H2D copies run on: its own with ``copy_streams=2``, else ``copy_stream``."""
        return self._h2d_stream if self._h2d_stream is not None else self.copy_stream

    def _streams(self) -> tuple[Any, ...]:
        """Every copy stream this engine owns (none on a synchronous engine)."""
        streams = (self.copy_stream, self._h2d_stream)
        return tuple(stream for stream in streams if stream is not None)

    @property
    def is_async(self) -> bool:
        """True when copies on this engine's own device run on a copy stream."""
        return self.copy_stream is not None

    def d2h(
        self,
        src: torch.Tensor,
        dst_host: torch.Tensor,
        *,
        after: Iterable[Transfer] = (),
        free_before_wait: bool = False,
    ) -> Transfer:
        """Copy device tensor ``src`` into host tensor ``dst_host``.

        The copy is ordered after all work already enqueued on the current compute stream
        and after every transfer in ``after``.

        ``free_before_wait``: the caller may free ``src``'s bytes before any stream waits
        on this copy (the residency manager's RELEASE_DEVICE right after a COPY_D2H). The
        engine then ``record_stream``-s ``src`` on the copy stream, so the allocator keeps
        the block from reuse until the copy stream is past it. Otherwise (the default) the
        handle keeps ``src`` alive until :meth:`Transfer.wait`: ``record_stream`` would
        delay the block's reuse to the end of whatever the copy stream holds at free time
        while ``memory_allocated`` already dropped, so the memory figures would lie.
        """
        _check_pair("d2h", src, dst_host)
        if dst_host.device.type != "cpu":
            raise ConfigurationError(
                f"TransferEngine.d2h: destination must be a host (cpu) tensor, got one on "
                f"{dst_host.device}; use a buffer from PinnedMemoryPool.acquire()"
            )
        return self._copy(
            TransferDirection.D2H, src, dst_host, device_side=src, after=after,
            free_before_wait=free_before_wait,
        )

    def h2d(
        self,
        src_host: torch.Tensor,
        dst: torch.Tensor,
        *,
        after: Iterable[Transfer] = (),
        free_before_wait: bool = False,
    ) -> Transfer:
        """Copy host tensor ``src_host`` into device tensor ``dst``.

        Ordered after the current compute stream (which allocated ``dst``) and after every
        transfer in ``after`` (typically the D2H that filled ``src_host``).
        ``free_before_wait`` as in :meth:`d2h`, for ``dst``.
        """
        _check_pair("h2d", src_host, dst)
        if src_host.device.type != "cpu":
            raise ConfigurationError(
                f"TransferEngine.h2d: source must be a host (cpu) tensor, got one on "
                f"{src_host.device}; pass the host buffer the D2H filled"
            )
        return self._copy(
            TransferDirection.H2D, src_host, dst, device_side=dst, after=after,
            free_before_wait=free_before_wait,
        )

    def synchronize(self) -> None:
        """Block the host until every copy enqueued on this engine has completed."""
        for stream in self._streams():
            self.host_syncs.record(SyncReason.ENGINE_DRAIN)
            stream.synchronize()

    def _copy(
        self,
        direction: TransferDirection,
        src: torch.Tensor,
        dst: torch.Tensor,
        *,
        device_side: torch.Tensor,
        after: Iterable[Transfer],
        free_before_wait: bool,
    ) -> Transfer:
        nbytes = src.numel() * src.element_size()
        after = tuple(after)
        if self.copy_stream is None or device_side.device != self.device:
            # CPU engine, or a tensor on another device than our copy stream: a blocking
            # copy is the only one whose ordering we can guarantee without that device's
            # streams. Earlier transfers must be finished before we read/write the buffer.
            for earlier in after:
                earlier.synchronize()
            if self.copy_stream is not None:
                self.host_syncs.record(SyncReason.CROSS_DEVICE_COPY)
            dst.copy_(src)
            return completed_transfer(direction, device_side.device, nbytes)
        return self._async_copy(direction, src, dst, device_side, after, nbytes, free_before_wait)

    def _async_copy(
        self,
        direction: TransferDirection,
        src: torch.Tensor,
        dst: torch.Tensor,
        device_side: torch.Tensor,
        after: tuple[Transfer, ...],
        nbytes: int,
        free_before_wait: bool,
    ) -> Transfer:
        module = self._module
        stream = self.h2d_stream if direction is TransferDirection.H2D else self.copy_stream
        assert module is not None and stream is not None
        host_side = dst if direction is TransferDirection.D2H else src
        if not self._is_pinned(host_side):
            # CUDA completes a copy to/from pageable memory before returning, and our copy
            # stream first waits on compute: the host blocks behind all queued work.
            self.host_syncs.record(SyncReason.PAGEABLE_COPY)
        # The copy must see everything the compute stream has enqueued so far: the kernels
        # that produced a D2H source, or the allocation of an H2D destination.
        issue_stream = module.current_stream(self.device)
        stream.wait_stream(issue_stream)
        for earlier in after:
            if earlier.event is not None and not earlier.query():
                stream.wait_event(earlier.event)
        try:
            with module.stream(stream):
                self._enqueue_copy(direction, src, dst)
                event = module.Event()
                event.record(stream)
        except BaseException:
            # Part of the copy may already be on the stream; the caller is about to give
            # the buffers back, so nothing may still read or write them.
            self.host_syncs.record(SyncReason.ENGINE_DRAIN)
            stream.synchronize()
            raise
        recorded = free_before_wait and self._record_stream(device_side, stream)
        return Transfer(
            direction, self.device, nbytes, event, (host_side,),
            device_side_recorded=recorded,
            # Without record_stream the device bytes must outlive the copy's wait.
            until_wait=() if recorded else (device_side,),
            module=module, issue_stream=issue_stream, host_syncs=self.host_syncs,
        )

    # Hooks: the only three places that touch the accelerator's memory semantics, so a
    # scripted device (tests/runtime/scripted_cuda.py) can stand in for them on CPU.

    def _enqueue_copy(
        self, direction: TransferDirection, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Enqueue ``dst <- src`` on the current (copy) stream."""
        dst.copy_(src, non_blocking=True)

    def _record_stream(self, tensor: torch.Tensor, stream: Any) -> bool:
        return _record_on_stream(tensor, stream)

    def _is_pinned(self, host: torch.Tensor) -> bool:
        return host.is_pinned()

    def __repr__(self) -> str:
        if not self.is_async:
            mode = "synchronous"
        else:
            mode = "async copy stream" if len(self._streams()) == 1 else "async copy stream per direction"
        return f"TransferEngine({self.device}, {mode})"


def _check_pair(where: str, src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ConfigurationError(
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
