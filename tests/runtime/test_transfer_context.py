"""TransferRuntime under accelerator-like timing, simulated on CPU.

On CUDA a ``wait_transfer`` only orders the compute stream: the copy is still in flight
when the op returns, the host does not block, and the allocator (``record_stream``) rather
than a Python reference protects the device bytes. :class:`DeferredEngine` with
``stream_waits`` and ``records_streams`` reproduces exactly that, so these tests check
the buffer and memory lifetimes the CPU engine (where every copy is born complete) can
never exercise.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hyper_offload.errors import TransferFailedError, TransferMisuseError
from hyper_offload.runtime import ops
from hyper_offload.runtime.transfer import TransferDirection
from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
from hyper_offload.runtime.transfer_context import TransferRuntime
from hyper_offload.runtime.transfer_records import HostCopyState


@pytest.fixture
def cuda_like(deferred_engine_cls):  # noqa: ANN001, ANN201
    """Factory of CUDA-like engines: stream waits, optional record_stream."""
    return lambda records_streams=True: deferred_engine_cls(
        records_streams=records_streams, stream_waits=True
    )


def test_released_host_buffer_returns_to_the_pool_once_its_copies_complete(cuda_like) -> None:  # noqa: ANN001
    engine, pool = cuda_like(), PinnedMemoryPool(1 << 20, pin=False)
    with TransferRuntime(pool=pool, engines=[engine]) as rt:
        act = torch.randn(256)
        host = ops.wait_transfer(ops.copy_d2h(act), act)
        back = ops.wait_transfer(ops.copy_h2d(host, "cpu"), host)
        ops.release_host(host, back)
        del host
        assert pool.stats().buffers_in_use == 1  # both copies still in flight hold it
        engine.fire_all()
        rt.collect()
        stats = pool.stats()
        # The in-flight handles held the last reference to the host copy; once they
        # are observed complete it dies, and the buffer must come back.
        assert stats.buffers_in_use == 0 and stats.pinned_bytes_cached == 1024
        again = ops.wait_transfer(ops.copy_d2h(torch.randn(256)))
        assert pool.stats().hits == 1
        engine.fire_all()
        ops.release_host(again)
        assert torch.equal(back, act)


def test_offloaded_source_is_freed_at_its_wait_while_the_copy_still_runs(cuda_like) -> None:  # noqa: ANN001
    engine = cuda_like(records_streams=True)
    with TransferRuntime(pool=PinnedMemoryPool(1 << 20, pin=False), engines=[engine]):
        act = torch.randn(1024)
        storage = weakref.ref(act.untyped_storage())
        host = ops.copy_d2h(act)
        del act
        gc.collect()
        assert storage() is not None, "the source died before its wait"
        ops.wait_transfer(host)
        gc.collect()
        (_, d2h_event, _), = engine.log
        assert not d2h_event.is_done  # the copy is still running...
        # ...yet nothing in the runtime holds the device bytes: the allocator protects
        # them (record_stream), so offloading frees device memory in the forward pass.
        assert storage() is None, "the offloaded activation is kept alive after its wait"
        engine.fire_all()
        ops.release_host(host)


def test_without_stream_tracking_the_source_lives_until_the_copy_completes(cuda_like) -> None:  # noqa: ANN001
    engine = cuda_like(records_streams=False)
    pool = PinnedMemoryPool(1 << 20, pin=False)
    with TransferRuntime(pool=pool, engines=[engine]) as rt:
        act = torch.randn(1024)
        storage = weakref.ref(act.untyped_storage())
        host = ops.wait_transfer(ops.copy_d2h(act), act)
        del act
        gc.collect()
        assert storage() is not None  # nothing else keeps the bytes from reuse
        ops.release_host(host)
        del host
        engine.fire_all()
        rt.collect()  # observes the completion...
        gc.collect()
        assert storage() is None  # ...and the handle dropped the last reference
        assert pool.stats().buffers_in_use == 0


def test_prefetch_is_ordered_after_a_waited_but_unfinished_d2h(cuda_like) -> None:  # noqa: ANN001
    engine = cuda_like()
    with TransferRuntime(pool=PinnedMemoryPool(1 << 20, pin=False), engines=[engine]):
        act = torch.randn(16)
        host = ops.wait_transfer(ops.copy_d2h(act), act)
        back = ops.wait_transfer(ops.copy_h2d(host, "cpu"), host)
        (d2h_dir, d2h_event, _), (h2d_dir, _, h2d_after) = engine.log
        assert (d2h_dir, h2d_dir) == (TransferDirection.D2H, TransferDirection.H2D)
        # The wait ordered only the compute stream; the H2D names the D2H explicitly.
        assert [t.event for t in h2d_after] == [d2h_event]
        engine.fire_all()
        ops.release_host(host, back)


class _WatchingPool(PinnedMemoryPool):
    """Records, at every release, whether the engine still had a copy in flight."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        super().__init__(1 << 20, pin=False)
        self.engine = engine
        self.in_flight_at_release: list[bool] = []

    def release(self, buffer, event=None) -> None:  # noqa: ANN001
        self.in_flight_at_release.append(self.engine.in_flight())
        super().release(buffer, event)


def test_failed_d2h_drains_the_copy_stream_before_the_buffer_goes_back(
    half_enqueued_engine_cls,  # noqa: ANN001
) -> None:
    engine = half_enqueued_engine_cls("d2h")
    pool = _WatchingPool(engine)
    with TransferRuntime(pool=pool, engines=[engine]) as rt:
        with pytest.raises(TransferFailedError, match="host buffer went back to the pool"):
            ops.copy_d2h(torch.ones(8))
        assert pool.in_flight_at_release == [False]  # never reusable under a running copy
        assert engine.engine_syncs == 1
        stats = pool.stats()
        assert stats.buffers_in_use == 0 and stats.pending_releases == 0
        assert rt.transfers_pending == 0


def test_failed_h2d_drains_the_copy_stream_before_dropping_its_destination(
    half_enqueued_engine_cls,  # noqa: ANN001
) -> None:
    engine = half_enqueued_engine_cls()
    pool = PinnedMemoryPool(1 << 20, pin=False)
    with TransferRuntime(pool=pool, engines=[engine]) as rt:
        src = torch.arange(8.0)
        host = ops.wait_transfer(ops.copy_d2h(src), src)
        engine.fail = "h2d"
        with pytest.raises(TransferFailedError, match="host copy is untouched"):
            ops.copy_h2d(host, "cpu")
        # The destination tensor was dropped: nothing may still be writing into it.
        assert engine.engine_syncs == 1 and not engine.in_flight()
        assert rt.transfers_pending == 0
        engine.fail = ""
        back = ops.wait_transfer(ops.copy_h2d(host, "cpu"), host)
        engine.fire_all()
        assert torch.equal(back, src)
        ops.release_host(host, back)


def test_an_exception_in_the_block_drains_and_loses_no_host_buffer(cuda_like) -> None:  # noqa: ANN001
    engine, pool = cuda_like(), PinnedMemoryPool(1 << 20, pin=False)
    rt = TransferRuntime(pool=pool, engines=[engine])
    with pytest.raises(ValueError, match="boom"):
        with rt:
            act = torch.randn(64)
            valid = ops.wait_transfer(ops.copy_d2h(act), act)  # waited, never released
            filling = ops.copy_d2h(torch.randn(64))  # never waited
            raise ValueError("boom")
    assert rt.transfers_pending == 0  # the unwaited copy was synchronized: complete
    assert rt.host_state(filling) is HostCopyState.VALID
    back = ops.wait_transfer(ops.copy_h2d(valid, "cpu"), valid)  # still held: still valid
    assert torch.equal(back, act)
    engine.fire_all()
    del valid, filling
    rt.collect()
    stats = pool.stats()
    assert stats.buffers_in_use == 0 and stats.pinned_bytes_cached == 2 * 1024


def test_transfers_drained_at_a_faulty_exit_can_still_be_released(cuda_like) -> None:  # noqa: ANN001
    engine, pool = cuda_like(), PinnedMemoryPool(1 << 20, pin=False)
    rt = TransferRuntime(pool=pool, engines=[engine])
    with pytest.raises(TransferMisuseError, match="never waited"):
        with rt:
            host = ops.copy_d2h(torch.arange(4.0))
    assert rt.host_state(host) is HostCopyState.VALID  # synchronized: the copy is complete
    ops.release_host(host)  # no block needed: the copy names its runtime
    del host
    assert pool.stats().buffers_in_use == 0 and pool.stats().pinned_bytes_cached == 1024


def test_an_exit_drains_only_the_transfers_its_block_started(cuda_like) -> None:  # noqa: ANN001
    # A backward runs outside any block (possibly on another thread) while a later
    # forward's block opens and closes: that exit must leave the backward's copy alone.
    engine = cuda_like()
    rt = TransferRuntime(pool=PinnedMemoryPool(1 << 20, pin=False), engines=[engine])
    with rt:
        src = torch.arange(8.0)
        host = ops.wait_transfer(ops.copy_d2h(src), src)
    prefetch = ops.copy_h2d(host, "cpu")  # the "backward": no block
    with rt:
        other = ops.wait_transfer(ops.copy_d2h(torch.ones(4)))
    assert rt.transfers_pending == 1  # still the backward's to wait
    back = ops.wait_transfer(prefetch, host)
    engine.fire_all()
    assert torch.equal(back, src)
    del other


def test_a_prefetch_whose_destination_died_unwaited_frees_its_host_copy(cuda_like) -> None:  # noqa: ANN001
    # A backward that raised between a copy_h2d and its wait: nothing will wait, and
    # neither the device tensor nor the host copy may stay held by the record.
    engine, pool = cuda_like(), PinnedMemoryPool(1 << 20, pin=False)
    rt = TransferRuntime(pool=pool, engines=[engine])
    with rt:
        host = ops.wait_transfer(ops.copy_d2h(torch.ones(256)))
    engine.fire_all()
    prefetch = ops.copy_h2d(host, "cpu")
    device_side = weakref.ref(prefetch.untyped_storage())
    del prefetch, host
    gc.collect()
    assert device_side() is None, "the pending record kept the prefetched tensor"
    assert rt.transfers_pending == 0
    engine.fire_all()
    rt.collect()
    assert pool.stats().buffers_in_use == 0


def test_host_copies_outlive_the_block_and_name_their_runtime() -> None:
    outer, inner = (TransferRuntime(pool=PinnedMemoryPool(1 << 20, pin=False)) for _ in range(2))
    with outer:
        host = ops.wait_transfer(ops.copy_d2h(torch.arange(4.0)))
    with inner:  # another runtime is current: the copy still goes to its own
        back = ops.wait_transfer(ops.copy_h2d(host, "cpu"), host)
        ops.release_host(host, back)
    assert outer.host_state(host) is HostCopyState.RELEASED and inner.host_state(host) is None
    assert torch.equal(back, torch.arange(4.0))
