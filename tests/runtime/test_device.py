"""Device layer on CPU: device resolution, synchronous engine, Transfer handle semantics."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hyper_offload.runtime.device import is_accelerator, pin_memory_available, resolve_device
from hyper_offload.runtime.transfer import (
    Transfer,
    TransferDirection,
    TransferEngine,
    completed_transfer,
)

HAS_ACCELERATOR = torch.accelerator.is_available()


def _random_bits(nbytes: int, seed: int = 0) -> torch.Tensor:
    """Arbitrary bytes viewed as float32: includes NaN payloads and denormals, which a
    value-level (non-bitwise) copy would not preserve."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).view(torch.float32)


@pytest.mark.parametrize(
    ("device", "expected"),
    [("cpu", False), ("meta", False), (None, False), ("cuda", True), ("cuda:1", True), ("xpu", True)],
)
def test_is_accelerator(device, expected: bool) -> None:
    assert is_accelerator(device) is expected


def test_pin_memory_available_predicts_whether_pinning_works() -> None:
    try:
        pinned = torch.empty(8, pin_memory=True).is_pinned()
    except RuntimeError:  # the CPU build refuses to pin
        pinned = False
    assert pin_memory_available() is pinned


def test_resolve_device_defaults() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    if HAS_ACCELERATOR:
        assert resolve_device(None).index is not None
    else:
        assert resolve_device(None) == torch.device("cpu")
        with pytest.raises(ValueError, match="needs an accelerator"):
            resolve_device(0)


def test_cpu_engine_is_synchronous_and_copies_bits_exactly() -> None:
    engine = TransferEngine("cpu")
    assert engine.copy_stream is None and not engine.is_async
    src = _random_bits(4096)
    host = torch.empty_like(src)
    out = engine.d2h(src, host)
    assert out.event is None and out.query() and out.done()
    assert out.direction is TransferDirection.D2H and out.nbytes == 4096
    assert torch.equal(host.view(torch.uint8), src.view(torch.uint8))

    back = torch.empty_like(src)
    into = engine.h2d(host, back)
    into.wait()  # no-op on CPU, must not raise
    into.synchronize()
    assert into.direction is TransferDirection.H2D
    assert torch.equal(back.view(torch.uint8), src.view(torch.uint8))
    engine.synchronize()


def test_engine_copies_into_views_in_place() -> None:
    engine = TransferEngine("cpu")
    host = torch.zeros(16, dtype=torch.uint8)
    engine.d2h(torch.full((4,), 7, dtype=torch.uint8), host[4:8])
    assert host.tolist() == [0] * 4 + [7] * 4 + [0] * 8


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (torch.zeros(4), torch.zeros(5)),
        (torch.zeros(4), torch.zeros(4, dtype=torch.float64)),
        (torch.zeros(2, 2), torch.zeros(4)),
    ],
)
def test_engine_refuses_shape_or_dtype_mismatch(src: torch.Tensor, dst: torch.Tensor) -> None:
    engine = TransferEngine("cpu")
    with pytest.raises(ValueError, match="never\\s+cast"):
        engine.d2h(src, dst)
    with pytest.raises(ValueError, match="never\\s+cast"):
        engine.h2d(src, dst)


def test_engine_refuses_non_host_buffers() -> None:
    engine = TransferEngine("cpu")
    with pytest.raises(ValueError, match="destination must be a host"):
        engine.d2h(torch.zeros(4), torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="source must be a host"):
        engine.h2d(torch.empty(4, device="meta"), torch.zeros(4))


def test_accelerator_engine_needs_an_accelerator() -> None:
    if HAS_ACCELERATOR:
        engine = TransferEngine(None)
        assert engine.is_async and engine.copy_stream is not None
    else:
        with pytest.raises(RuntimeError, match="device='cpu'"):
            TransferEngine("cuda")


def test_sync_engine_waits_for_earlier_transfers_first(fake_event) -> None:
    engine = TransferEngine("cpu")
    event = fake_event()
    earlier = Transfer(TransferDirection.D2H, torch.device("cpu"), 4, event, ())
    engine.h2d(torch.ones(4), torch.zeros(4), after=[earlier])
    assert event.synchronizes == 1 and earlier.query()


def test_transfer_keeps_tensors_alive_until_it_observes_completion(fake_event) -> None:
    src, dst = torch.zeros(8), torch.zeros(8)
    src_ref, dst_ref = weakref.ref(src), weakref.ref(dst)
    event = fake_event()
    transfer = Transfer(TransferDirection.D2H, torch.device("cpu"), 32, event, (src, dst))
    del src, dst
    gc.collect()
    assert not transfer.query()
    assert src_ref() is not None and dst_ref() is not None  # copy "in flight": kept alive
    assert "in flight" in repr(transfer)

    event.fire()
    assert transfer.query()
    gc.collect()
    assert src_ref() is None and dst_ref() is None
    assert "done" in repr(transfer)


def test_transfer_synchronize_blocks_on_the_event(fake_event) -> None:
    event = fake_event()
    transfer = Transfer(TransferDirection.H2D, torch.device("cpu"), 4, event, ())
    transfer.synchronize()
    transfer.synchronize()  # second call: already done, event not touched again
    assert event.synchronizes == 1 and transfer.done()


def test_completed_transfer_is_done() -> None:
    transfer = completed_transfer(TransferDirection.H2D, torch.device("cpu"), 12)
    assert transfer.query() and transfer.event is None and transfer.nbytes == 12


# ---------------------------------------------------------------- async path, simulated
#
# The copy-stream path cannot run without an accelerator. A scripted device module with
# the stream/event API lets its logic (ordering, event, keepalive policy, failure drain)
# run on CPU; the real thing is covered by tests/runtime/test_gpu_runtime.py.


class _ScriptedEvent:
    def __init__(self, log: list[str]) -> None:
        self.log, self.done = log, False

    def record(self, stream: object) -> None:
        self.log.append(f"record on {stream}")

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class _ScriptedStream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: "_ScriptedStream") -> None:
        self.log.append(f"{self} waits for {other}")

    def wait_event(self, event: object) -> None:
        self.log.append(f"{self} waits for event {id(event)}")

    def synchronize(self) -> None:
        self.log.append(f"synchronize {self}")

    def __repr__(self) -> str:
        return self.name


class _ScriptedModule:
    """Just the device-module surface TransferEngine uses."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.compute = _ScriptedStream("compute", self.log)
        self.events: list[_ScriptedEvent] = []

    def current_stream(self, device: object) -> _ScriptedStream:
        return self.compute

    def Event(self) -> _ScriptedEvent:  # noqa: N802 - mirrors torch.cuda.Event
        self.events.append(_ScriptedEvent(self.log))
        return self.events[-1]

    def stream(self, stream: _ScriptedStream):  # noqa: ANN201
        import contextlib

        log = self.log

        @contextlib.contextmanager
        def on() -> object:
            log.append(f"enter {stream}")
            yield
            log.append(f"leave {stream}")

        return on()


def _scripted_engine(monkeypatch, records: bool) -> tuple[TransferEngine, _ScriptedModule]:  # noqa: ANN001
    from hyper_offload.runtime import transfer as device_module

    engine = TransferEngine("cpu")
    module = _ScriptedModule()
    engine._module, engine.copy_stream = module, _ScriptedStream("copy", module.log)
    monkeypatch.setattr(device_module, "_record_on_stream", lambda tensor, stream: records)
    return engine, module


@pytest.mark.parametrize(
    ("free_before_wait", "records"),
    [(True, True), (True, False), (False, True)],
    ids=["free_first+record_stream", "free_first+no_record_stream", "wait_first"],
)
def test_async_copy_orders_after_compute_and_keeps_only_what_it_must(
    monkeypatch, free_before_wait: bool, records: bool  # noqa: ANN001
) -> None:
    engine, module = _scripted_engine(monkeypatch, records)
    pending = Transfer(TransferDirection.D2H, torch.device("cpu"), 4, _ScriptedEvent([]), ())
    src, host = torch.arange(8.0), torch.zeros(8)
    src_ref, host_ref = weakref.ref(src), weakref.ref(host)
    transfer = engine.d2h(src, host, after=[pending], free_before_wait=free_before_wait)
    assert module.log == [
        "copy waits for compute",  # sees the kernels that produced src
        f"copy waits for event {id(pending.event)}",  # and the transfers it must follow
        "enter copy",
        "record on copy",
        "leave copy",
    ]
    recorded = free_before_wait and records  # record_stream only for frees before a wait
    assert transfer.event is module.events[-1] and transfer.device_side_recorded is recorded
    assert transfer.issue_stream is module.compute
    assert torch.equal(host, src)
    del src, host
    gc.collect()
    # With record_stream the allocator guards the device bytes: only the host side is held.
    assert (src_ref() is None) is recorded and host_ref() is not None
    transfer.wait()  # a stream wait on the issue stream: the device side may go now
    gc.collect()
    assert src_ref() is None and host_ref() is not None
    assert module.log[-1] == f"compute waits for event {id(transfer.event)}"
    module.events[-1].done = True
    assert transfer.query()
    gc.collect()
    assert src_ref() is None and host_ref() is None


def test_wait_on_another_stream_keeps_the_device_side_and_order_before_free_adds_one(
    monkeypatch,  # noqa: ANN001
) -> None:
    engine, module = _scripted_engine(monkeypatch, False)
    src = torch.arange(8.0)
    src_ref = weakref.ref(src)
    transfer = engine.d2h(src, torch.zeros(8))
    del src
    transfer.wait(_ScriptedStream("side", module.log))  # not the stream that reuses src
    gc.collect()
    assert src_ref() is not None and transfer.stream_waited
    transfer.order_before_free()  # the issue stream must wait too
    assert module.log[-1] == f"compute waits for event {id(transfer.event)}"
    gc.collect()
    assert src_ref() is None
    transfer.order_before_free()  # already ordered: nothing more
    assert module.log[-1] == f"compute waits for event {id(transfer.event)}"
    assert engine.host_syncs.total == 1  # the only block: the pageable (unpinned) host buffer


def test_async_copy_that_fails_to_enqueue_drains_the_copy_stream(monkeypatch) -> None:  # noqa: ANN001
    engine, module = _scripted_engine(monkeypatch, True)

    def broken_event() -> object:
        raise RuntimeError("injected event failure")

    module.Event = broken_event  # the memcpy is already on the stream when this raises
    with pytest.raises(RuntimeError, match="injected event failure"):
        engine.h2d(torch.ones(4), torch.zeros(4))
    assert module.log[-1] == "synchronize copy"
    assert engine.host_syncs.by_reason()["copy stream drained"] == 1


def test_two_copy_streams_put_each_direction_on_its_own_and_order_h2d_after_its_d2h(
    monkeypatch,  # noqa: ANN001
) -> None:
    engine, module = _scripted_engine(monkeypatch, True)
    engine._h2d_stream = _ScriptedStream("h2d", module.log)
    assert engine.h2d_stream is not engine.copy_stream
    host = torch.zeros(8)
    d2h = engine.d2h(torch.arange(8.0), host, free_before_wait=True)
    start = len(module.log)
    h2d = engine.h2d(host, torch.zeros(8), after=[d2h])
    # The H2D runs on its own stream, after compute (which allocated its destination) and
    # after the D2H that fills its source: with two streams only the event orders them.
    assert module.log[start:] == [
        "h2d waits for compute",
        f"h2d waits for event {id(d2h.event)}",
        "enter h2d",
        "record on h2d",  # its event marks the H2D's end on the H2D stream
        "leave h2d",
    ]
    assert h2d.event is module.events[-1] and h2d.event is not d2h.event
    engine.synchronize()  # drains both streams
    assert module.log[-2:] == ["synchronize copy", "synchronize h2d"]
    assert engine.host_syncs.by_reason()["copy stream drained"] == 2


def test_one_copy_stream_serves_both_directions(monkeypatch) -> None:  # noqa: ANN001
    engine, module = _scripted_engine(monkeypatch, True)
    assert engine.h2d_stream is engine.copy_stream
    engine.h2d(torch.ones(4), torch.zeros(4))
    assert "enter copy" in module.log and not any("h2d" in line for line in module.log)
    engine.synchronize()
    assert module.log[-1] == "synchronize copy" and engine.host_syncs.by_reason()["copy stream drained"] == 1


def test_copy_streams_is_one_or_two() -> None:
    with pytest.raises(ValueError, match=r"copy_streams=3.*1 \(one copy stream.*2 \(one per direction"):
        TransferEngine("cpu", copy_streams=3)
    cpu = TransferEngine("cpu", copy_streams=2)  # no streams on CPU: synchronous either way
    assert cpu.copy_stream is None and cpu.h2d_stream is None and not cpu.is_async
    assert repr(cpu) == "TransferEngine(cpu, synchronous)"
