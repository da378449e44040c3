"""PhysicalBuffer: the (device, device_event) <-> (host, host_event) state machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hyper_offload.errors import DataLostError, ResidencyMisuseError
from hyper_offload.runtime.transfer import TransferDirection, TransferEngine
from hyper_offload.runtime.physical_buffer import BufferState, PhysicalBuffer


def test_full_cycle_states_and_bits(pool, make_random, bits_equal) -> None:
    tensor = make_random((33, 7), seed=1)
    reference = tensor.clone()
    buf = PhysicalBuffer(tensor, TransferEngine("cpu"), pool, label="storage 5")
    assert buf.state is BufferState.DEVICE and buf.nbytes == 33 * 7 * 4

    assert buf.device_buffer is tensor.untyped_storage()
    buf.start_d2h()
    assert buf.state is BufferState.DEVICE_AND_HOST
    buf.release_device()
    assert buf.state is BufferState.HOST and buf.device_buffer is None
    assert tensor.untyped_storage().nbytes() == 0  # the caller's tensor lost its bytes

    buf.start_h2d()
    buf.wait_device()
    assert buf.state is BufferState.DEVICE_AND_HOST
    assert bits_equal(tensor, reference)  # the caller's own tensor sees the data again
    buf.release_host()
    assert buf.state is BufferState.DEVICE and pool.stats().buffers_in_use == 0
    buf.release_device()
    assert buf.state is BufferState.RELEASED


def test_device_storage_demand_pages_and_device_tensor_keeps_layout(pool, make_random, bits_equal) -> None:
    base = make_random((6, 10), dtype=torch.float64, seed=2)
    view = base[1:, 2:].t()  # non-contiguous, offset view
    reference = view.clone()
    buf = PhysicalBuffer(view, TransferEngine("cpu"), pool)
    buf.start_d2h()
    buf.release_device()

    storage = buf.device_storage()  # HOST -> demand page
    assert storage is base.untyped_storage() and storage.nbytes() == 6 * 10 * 8
    assert buf.state is BufferState.DEVICE_AND_HOST and not buf.pending_transfers()
    rebuilt = buf.device_tensor()
    assert rebuilt.stride() == view.stride() and rebuilt.storage_offset() == view.storage_offset()
    assert bits_equal(rebuilt, reference) and bits_equal(view, reference)


def test_device_storage_of_released_data_raises(pool) -> None:
    buf = PhysicalBuffer(torch.ones(8), TransferEngine("cpu"), pool)
    buf.start_d2h()
    buf.release_device()
    buf.release_host()
    assert buf.state is BufferState.RELEASED
    with pytest.raises(DataLostError, match="both the device and the host copy were released"):
        buf.device_storage()


def test_meta_and_borrowed_storages_are_refused(pool) -> None:
    with pytest.raises(ResidencyMisuseError, match="meta tensor"):
        PhysicalBuffer(torch.empty(4, device="meta"), TransferEngine("cpu"), pool)
    with pytest.raises(ResidencyMisuseError, match="not resizable"):
        PhysicalBuffer(torch.from_numpy(np.zeros(4)), TransferEngine("cpu"), pool)


def test_storage_resized_behind_the_buffers_back_is_refused(pool) -> None:
    tensor = torch.zeros(16)
    buf = PhysicalBuffer(tensor, TransferEngine("cpu"), pool)
    tensor.untyped_storage().resize_(128)
    with pytest.raises(ResidencyMisuseError, match="resized outside the manager"):
        buf.start_d2h()
    assert pool.stats().buffers_in_use == 0


def test_second_d2h_reuses_the_host_buffer_and_refreshes_it(pool, bits_equal) -> None:
    tensor = torch.arange(300, dtype=torch.int32)
    buf = PhysicalBuffer(tensor, TransferEngine("cpu"), pool)
    buf.start_d2h()
    host = buf.host_buffer
    tensor.mul_(3)  # written again after the first copy: the host copy is stale
    expected = tensor.clone()
    buf.start_d2h()
    assert buf.host_buffer is host and pool.stats().misses == 1
    buf.release_device()
    buf.start_h2d()
    assert bits_equal(tensor, expected)


def test_h2d_is_ordered_after_the_d2h_that_filled_the_host(pool, deferred_engine) -> None:
    buf = PhysicalBuffer(torch.ones(64), deferred_engine, pool)
    d2h = buf.start_d2h()
    buf.release_device()
    h2d = buf.start_h2d()
    direction, _, after = deferred_engine.log[-1]
    assert direction is TransferDirection.H2D and after == (d2h,)
    assert buf.device_event is h2d and buf.host_event is d2h


def test_release_device_waits_for_h2d_still_writing(pool, deferred_engine) -> None:
    buf = PhysicalBuffer(torch.ones(64), deferred_engine, pool)
    buf.start_d2h()
    deferred_engine.fire_all()
    buf.release_device()
    buf.start_h2d()
    _, h2d_event, _ = deferred_engine.log[-1]
    assert not h2d_event.is_done
    buf.release_device()
    assert h2d_event.synchronizes == 1


def test_release_device_waits_for_d2h_still_reading_without_stream_tracking(pool, deferred_engine) -> None:
    tensor = torch.ones(64)
    buf = PhysicalBuffer(tensor, deferred_engine, pool)
    transfer = buf.start_d2h()
    assert not transfer.device_side_recorded
    _, d2h_event, _ = deferred_engine.log[-1]
    buf.release_device()
    assert d2h_event.synchronizes == 1  # the bytes were not freed under a running copy
    assert tensor.untyped_storage().nbytes() == 0


def test_stream_tracked_d2h_lets_release_device_free_without_blocking(pool, deferred_engine_cls) -> None:
    engine = deferred_engine_cls(records_streams=True)  # as on CUDA
    tensor = torch.ones(64)
    buf = PhysicalBuffer(tensor, engine, pool)
    buf.start_d2h()
    buf.release_device()
    _, d2h_event, _ = engine.log[-1]
    assert d2h_event.synchronizes == 0 and not d2h_event.is_done
    assert tensor.untyped_storage().nbytes() == 0


def test_host_buffer_returns_only_after_every_transfer_touching_it(pool, deferred_engine_cls) -> None:
    deferred_engine = deferred_engine_cls(records_streams=True)
    buf = PhysicalBuffer(torch.ones(256), deferred_engine, pool)
    buf.start_d2h()
    buf.release_device()
    buf.start_h2d()
    (_, d2h_event, _), (_, h2d_event, _) = deferred_engine.log
    assert len(buf.pending_transfers()) == 2
    buf.release_host()
    assert pool.stats().pending_releases == 1
    d2h_event.fire()
    assert pool.stats().pending_releases == 1  # the H2D still reads it
    h2d_event.fire()
    stats = pool.stats()
    assert stats.pending_releases == 0 and stats.pinned_bytes_cached == 1024
    assert not buf.pending_transfers()


def test_synchronize_completes_every_pending_transfer(pool, deferred_engine) -> None:
    buf = PhysicalBuffer(torch.ones(64), deferred_engine, pool)
    buf.start_d2h()
    assert buf.pending_transfers()
    buf.synchronize()
    assert not buf.pending_transfers()
    assert all(event.synchronizes == 1 for _, event, _ in deferred_engine.log)


def test_repr_names_label_and_state(pool) -> None:
    buf = PhysicalBuffer(torch.ones(4), TransferEngine("cpu"), pool, label="storage 9")
    assert repr(buf) == "PhysicalBuffer(storage 9, 16 B, cpu, DEVICE)"
