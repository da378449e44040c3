"""A scripted CUDA for CPU tests: one compute stream, one copy stream, events, and an
allocator model that catches use-after-free, so that the copy-stream logic of
:class:`~hyper_offload.runtime.transfer.TransferEngine` runs (and fails) as on a GPU.

The model (what a test may rely on):

* **Compute runs at issue.** Kernels are ordinary CPU ops executed when Python calls
  them, i.e. the compute stream is always caught up with the host.
* **Copies run later.** A copy enqueued on the copy stream does not move a byte until
  the test advances the stream (:meth:`ScriptedCuda.run` / :meth:`run_all`), the host
  synchronizes on it (an event's or the stream's ``synchronize``: recorded in
  :attr:`ScriptedCuda.host_blocks`), or the compute stream waits for its event
  (``compute.wait_event``: since compute runs at issue, every later kernel must see the
  copy, so it runs now; recorded in :attr:`ScriptedCuda.stream_waits`, *not* a host block).
  The copy stream is FIFO: running a copy runs every earlier one first.
* **The stream holds no memory.** A queued copy refers to its source and destination
  storages *weakly*, as a CUDA stream does: if the device side's storage died or was
  shrunk (``resize_(0)``, the runtime's free) before the copy ran, the copy touches freed
  memory — recorded in :attr:`ScriptedCuda.violations`, and a D2H then delivers junk
  (0xEE) instead of data. The exception is ``record_stream``: the allocator keeps a
  recorded block, so a recorded D2H delivers the bytes its source had when it was
  issued (the copy stream waited for compute up to there), and a recorded H2D
  destination is written harmlessly. A dead host side is
  always a violation (nothing protects host memory).
* **Pinned or not.** Host tensors count as pinned unless registered with
  :meth:`ScriptedCuda.mark_pageable`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hyper_offload.runtime.transfer import TransferDirection, TransferEngine

JUNK = 0xEE


class ScriptedEvent:
    def __init__(self, sim: ScriptedCuda, name: str) -> None:
        self.sim, self.name = sim, name
        self.position: int | None = None  # copies that must have run for it to complete

    def record(self, stream: ScriptedStream) -> None:
        self.position = len(self.sim.queue) if stream is self.sim.copy else self.sim.executed

    def query(self) -> bool:
        return self.position is None or self.sim.executed >= self.position

    def synchronize(self) -> None:
        self.sim.host_blocks.append(f"synchronize {self.name}")
        self.sim.run_until(self.position or 0)

    def __repr__(self) -> str:
        return self.name


class ScriptedStream:
    def __init__(self, sim: ScriptedCuda, name: str) -> None:
        self.sim, self.name = sim, name

    def wait_stream(self, other: ScriptedStream) -> None:
        self.sim.log.append(f"{self} waits for {other}")

    def wait_event(self, event: ScriptedEvent) -> None:
        self.sim.log.append(f"{self} waits for {event}")
        if self is self.sim.compute:
            self.sim.stream_waits.append(event.name)
            self.sim.run_until(event.position or 0)  # later kernels see the copy

    def synchronize(self) -> None:
        self.sim.host_blocks.append(f"synchronize {self}")
        if self is self.sim.copy:
            self.sim.run_all()

    def __repr__(self) -> str:
        return self.name


@dataclass
class _View:
    """A tensor's geometry over a weakly held storage."""

    storage: weakref.ref[torch.UntypedStorage]
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    nbytes: int
    block: int  # data_ptr at enqueue: the allocator block the copy refers to

    @staticmethod
    def of(tensor: torch.Tensor) -> _View:
        storage = tensor.untyped_storage()
        return _View(
            weakref.ref(storage), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
            tensor.storage_offset(), tensor.numel() * tensor.element_size(), storage.data_ptr(),
        )

    def tensor(self) -> torch.Tensor | None:
        """The tensor again, or None if its block is gone (storage dead, shrunk, or
        re-allocated elsewhere). A re-allocation that lands on the same address cannot be
        told from no free at all: the model may miss that race, never invent one."""
        storage = self.storage()
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        if (
            storage is None
            or storage.nbytes() < self.offset * itemsize + self.nbytes
            or storage.data_ptr() != self.block
        ):
            return None
        return torch.empty(0, dtype=self.dtype).set_(storage, self.offset, self.size, self.stride)


@dataclass
class _QueuedCopy:
    direction: TransferDirection
    src: _View
    dst: _View
    recorded_bytes: torch.Tensor | None = None  # D2H source bytes kept by record_stream
    recorded: bool = False


class ScriptedCuda:
    """The device-module surface :class:`TransferEngine` uses, plus the model above."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.compute = ScriptedStream(self, "compute")
        self.copy = ScriptedStream(self, "copy")
        self.queue: list[_QueuedCopy] = []
        self.executed = 0
        self.host_blocks: list[str] = []
        self.stream_waits: list[str] = []
        self.violations: list[str] = []
        self._pageable: set[int] = set()
        self._events = 0

    # device-module surface -------------------------------------------------------------

    def current_stream(self, device: object = None) -> ScriptedStream:
        return self.compute

    def Event(self) -> ScriptedEvent:  # noqa: N802 - mirrors torch.cuda.Event
        self._events += 1
        return ScriptedEvent(self, f"event{self._events}")

    def stream(self, stream: ScriptedStream) -> contextlib.AbstractContextManager[None]:
        @contextlib.contextmanager
        def on() -> Iterator[None]:
            yield

        return on()

    # model -----------------------------------------------------------------------------

    def enqueue(self, direction: TransferDirection, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.queue.append(_QueuedCopy(direction, _View.of(src), _View.of(dst)))

    def record(self, tensor: torch.Tensor) -> None:
        """``record_stream`` of the last enqueued copy's device side."""
        copy = self.queue[-1]
        copy.recorded = True
        if copy.direction is TransferDirection.D2H:
            copy.recorded_bytes = tensor.detach().clone()

    def mark_pageable(self, host: torch.Tensor) -> None:
        self._pageable.add(host.untyped_storage().data_ptr())

    def is_pinned(self, host: torch.Tensor) -> bool:
        return host.untyped_storage().data_ptr() not in self._pageable

    def run(self, count: int = 1) -> None:
        """Let the copy stream finish its next ``count`` copies."""
        self.run_until(min(len(self.queue), self.executed + count))

    def run_all(self) -> None:
        self.run_until(len(self.queue))

    def run_until(self, position: int) -> None:
        while self.executed < position:
            self._execute(self.queue[self.executed], self.executed)
            self.executed += 1

    def pending(self) -> int:
        return len(self.queue) - self.executed

    def _execute(self, copy: _QueuedCopy, index: int) -> None:
        d2h = copy.direction is TransferDirection.D2H
        host_view, device_view = (copy.dst, copy.src) if d2h else (copy.src, copy.dst)
        host, device = host_view.tensor(), device_view.tensor()
        where = f"copy #{index} ({copy.direction.value})"
        if host is None:
            self.violations.append(f"{where}: its host buffer was freed before the copy ran")
            return
        if device is None and not copy.recorded:
            side = "source" if d2h else "destination"
            self.violations.append(
                f"{where}: its device {side} was freed before the copy ran, and not "
                "record_stream-ed: the allocator could have handed the bytes to another tensor"
            )
            if d2h:
                host.view(torch.uint8).fill_(JUNK)
            return
        if d2h:
            host.copy_(copy.recorded_bytes if copy.recorded else device)
        elif device is not None:
            device.copy_(host)


class ScriptedCudaEngine(TransferEngine):
    """A :class:`TransferEngine` whose copy stream is a :class:`ScriptedCuda`: every line
    of the real async path runs (ordering, ``record_stream`` policy, keepalives, host-sync
    counting); only the three device hooks are scripted."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.sim = ScriptedCuda()
        self._module = self.sim  # type: ignore[assignment]
        self.copy_stream = self.sim.copy

    def _enqueue_copy(
        self, direction: TransferDirection, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        self.sim.enqueue(direction, src, dst)

    def _record_stream(self, tensor: torch.Tensor, stream: Any) -> bool:
        self.sim.record(tensor)
        return True

    def _is_pinned(self, host: torch.Tensor) -> bool:
        return self.sim.is_pinned(host)
