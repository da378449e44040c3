"""Measured device memory of one training step, for ``train_gpt.py``.

Two instruments, both measurements (never the plan restated):

* :func:`profiled_step` runs a step under ``torch.profiler`` with ``profile_memory=True``
  and rebuilds the bytes the step allocated over time from the allocator's own events.
  It sees compiled code (Inductor's and aot_eager's buffers are allocator events like any
  other), which a ``TorchDispatchMode`` meter cannot. Host buffers are told apart: an
  allocation made inside ``hyper_offload::copy_d2h`` on the host is the host pool's
  buffer (the op acquires it there), and a later free of that address is too; on CPU,
  where host and "device" share one allocator, every other allocation is device memory,
  on an accelerator the event's device decides and other host allocations are ignored. Bytes moved
  are read from the transfer ops that ran (``copy_d2h`` source, ``copy_h2d`` host copy).
* :func:`metered_step` runs an eager step under ``DeviceMemoryMeter`` (op by op, host
  buffers excluded by their label), entered *outside* an ``OffloadSession`` so that it
  sees the model's ops and none of the runtime's copies.

The curve is "bytes the step added": allocations minus frees since the step began, of
blocks the step allocated (frees of older blocks, e.g. last step's loss, are ignored).
On CUDA both also return ``max_memory_allocated`` / ``max_memory_reserved`` deltas.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from hyper_offload.runtime import DeviceMemoryMeter

_HOST_OP = "hyper_offload::copy_d2h"
# libkineto announces every profile's start and stop on file descriptor 2, from C++
# (no setting turns it off): "USDT:<time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52]
# profiler_start". The demo's output should be only ours.
_KINETO_NOTICE = re.compile(rb"^USDT:.*SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)\s*$")
_MOVES = {"hyper_offload::copy_d2h": "d2h", "hyper_offload::copy_h2d": "h2d"}


@dataclass
class StepMemory:
    """One step's measured figures. ``curve`` is (x, bytes): x in ms (profiler) or op
    index (meter). ``peak_bytes`` is the highest point of the curve."""

    seconds: float
    peak_bytes: int
    curve: list[tuple[float, int]] = field(repr=False)
    host_peak_bytes: int = 0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    allocator_peak_bytes: int | None = None
    """CUDA only: ``max_memory_allocated`` minus allocated bytes at the step's start."""
    allocator_reserved_peak_bytes: int | None = None


def _walk(nodes: Any) -> Iterator[Any]:
    for node in nodes:
        yield node
        yield from _walk(node.children)


def _inside(node: Any, name: str) -> bool:
    parent = node.parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.parent
    return False


def _tensor_bytes(meta: Any) -> int:
    sizes = getattr(meta, "sizes", None)
    dtype = getattr(meta, "dtype", None)
    if sizes is None or dtype is None:
        return 0
    numel = 1
    for size in sizes:
        numel *= int(size)
    return numel * dtype.itemsize


def _timeline(prof: profile, device: torch.device, gradient_ptrs: frozenset[int] = frozenset()) -> StepMemory:
    from torch._C._profiler import _EventType

    nodes = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    allocations = sorted(
        (n for n in nodes if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns
    )
    allocations = _without_gradient_blocks(allocations, gradient_ptrs)
    moved = {"d2h": 0, "h2d": 0}
    for node in nodes:
        kind = _MOVES.get(node.name)
        if kind is not None and node.tag == _EventType.TorchOp and node.extra_fields.inputs:
            moved[kind] += _tensor_bytes(node.extra_fields.inputs[0])
    start = min((n.start_time_ns for n in nodes), default=0)
    live: dict[int, int] = {}  # ptr -> bytes, device blocks the step allocated
    host: dict[int, int] = {}
    device_bytes = host_bytes = host_peak = 0
    curve: list[tuple[float, int]] = [(0.0, 0)]
    for node in allocations:
        fields = node.extra_fields
        on_device = fields.device.type == device.type
        size, ptr = int(fields.alloc_size), int(fields.ptr)
        if size > 0:
            # the pool's buffers are acquired inside copy_d2h; on an accelerator other CPU
            # allocations (the host side of unrelated work) are neither device nor ours
            is_host = _inside(node, _HOST_OP) and (device.type == "cpu" or not on_device)
            if not is_host and not on_device:
                continue
            (host if is_host else live)[ptr] = size
            if is_host:
                host_bytes += size
            else:
                device_bytes += size
        elif ptr in host:
            host_bytes -= host.pop(ptr)
        elif ptr in live:
            device_bytes -= live.pop(ptr)
        else:
            continue  # a block from before the step: not the step's bytes
        host_peak = max(host_peak, host_bytes)
        curve.append(((node.start_time_ns - start) / 1e6, device_bytes))
    return StepMemory(
        seconds=0.0, peak_bytes=max(b for _, b in curve), curve=curve,
        host_peak_bytes=host_peak, bytes_d2h=moved["d2h"], bytes_h2d=moved["h2d"],
    )


def _without_gradient_blocks(allocations: list[Any], gradient_ptrs: frozenset[int]) -> list[Any]:
    """``allocations`` without the blocks that end the step as a parameter's ``.grad``
    (allocated at one of ``gradient_ptrs`` and never freed in the step): the compile
    door's budget is an activation budget, gradients are the optimizer's memory."""
    last_alloc: dict[int, int] = {}
    for index, node in enumerate(allocations):
        ptr, size = int(node.extra_fields.ptr), int(node.extra_fields.alloc_size)
        if size > 0:
            last_alloc[ptr] = index
        else:
            last_alloc.pop(ptr, None)
    dropped = {i for ptr, i in last_alloc.items() if ptr in gradient_ptrs}
    return [node for index, node in enumerate(allocations) if index not in dropped]


def _cuda_begin(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return int(torch.cuda.memory_allocated(device))


def _cuda_end(device: torch.device, base: int | None, memory: StepMemory) -> None:
    if base is None:
        return
    torch.cuda.synchronize(device)
    memory.allocator_peak_bytes = int(torch.cuda.max_memory_allocated(device)) - base
    memory.allocator_reserved_peak_bytes = int(torch.cuda.max_memory_reserved(device))


def profiled_step(
    step: Callable[[], Any], device: torch.device, params: Iterable[torch.Tensor] = ()
) -> tuple[Any, StepMemory]:
    """Run ``step()`` under the profiler; its result and the measured :class:`StepMemory`.

    Blocks that end the step as the ``.grad`` of one of ``params`` are left out of the
    curve (activation memory, as the compile door budgets it)."""
    base = _cuda_begin(device)
    started = time.perf_counter()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True)
    with without_kineto_notices():
        prof.start()
    try:
        result = step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        with without_kineto_notices():
            prof.stop()
    seconds = time.perf_counter() - started
    gradient_ptrs = frozenset(
        p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None
    )
    memory = _timeline(prof, device, gradient_ptrs)
    memory.seconds = seconds
    _cuda_end(device, base, memory)
    return result, memory


@contextlib.contextmanager
def without_kineto_notices() -> Iterator[None]:
    """Run the block with file descriptor 2 captured, then write back every captured
    line except libkineto's profiler start/stop notices (nothing else is dropped)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = [line for line in sink.read().splitlines(keepends=True)
                    if not _KINETO_NOTICE.match(line)]
            if kept:
                sys.stderr.buffer.write(b"".join(kept))
                sys.stderr.flush()


def metered_step(step: Callable[[], Any], device: torch.device) -> tuple[Any, StepMemory]:
    """Run ``step()`` under ``DeviceMemoryMeter``: op-by-op bytes of storages it creates."""
    base = _cuda_begin(device)
    meter = DeviceMemoryMeter(device)
    started = time.perf_counter()
    with meter:
        result = step()
    seconds = time.perf_counter() - started
    curve = [(float(s.index), s.live_bytes) for s in meter.samples]
    memory = StepMemory(seconds=seconds, peak_bytes=meter.peak_bytes, curve=curve)
    _cuda_end(device, base, memory)
    return result, memory


def timed_step(step: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """Run ``step()`` with no instrument; its result and wall seconds (synchronized)."""
    started = time.perf_counter()
    result = step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - started
