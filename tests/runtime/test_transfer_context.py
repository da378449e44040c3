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

from hyper_offload.runtime import ops
from hyper_offload.runtime.device import TransferDirection
from hyper_offload.runtime.errors import TransferFailedError
from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
from hyper_offload.runtime.transfer_context import (
    HostCopyState,
    TransferMisuseError,
    TransferRuntime,
)


@pytest.fixture
def cuda_like(deferred_engine_cls):  # noqa: ANN001, ANN201
    """Factory of CUDA-like engines: stream waits, optional record_stream."""
    return lambda records_streams=True: deferred_engine_cls(
        records_streams=records_streams, stream_waits=True
    )


def test_released_host_buffer_returns_to_the_pool_once_its_copies_complete(cuda_like) -> None:  # noqa: ANN001
    engine, pool = cuda_like(), PinnedMemoryPool(1 << 20, pin=False)
    with TransferRuntime(pool=pool, engines=[engine]):
        act = torch.randn(256)
        host = ops.wait_transfer(ops.copy_d2h(act), act)
        back = ops.wait_transfer(ops.copy_h2d(host, "cpu"), host)
        ops.release_host(host, back)
        del host
        assert pool.stats().pending_releases == 1  # both copies still in flight
        engine.fire_all()
        stats = pool.stats()
        # The in-flight handles held the last reference to the host view; once they
        # complete the buffer must come back (it used to stay pending forever).
        assert stats.pending_releases == 0 and stats.pinned_bytes_cached == 1024
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
    with TransferRuntime(pool=pool, engines=[engine]):
        act = torch.randn(1024)
        storage = weakref.ref(act.untyped_storage())
        host = ops.wait_transfer(ops.copy_d2h(act), act)
        del act
        gc.collect()
        assert storage() is not None  # nothing else keeps the bytes from reuse
        ops.release_host(host)
        del host
        engine.fire_all()
        assert pool.stats().pending_releases == 0  # reaping observed the completion...
        gc.collect()
        assert storage() is None  # ...and dropped the last reference


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


def test_an_exception_in_the_block_returns_every_host_buffer(cuda_like) -> None:  # noqa: ANN001
    engine, pool = cuda_like(), PinnedMemoryPool(1 << 20, pin=False)
    rt = TransferRuntime(pool=pool, engines=[engine])
    with pytest.raises(ValueError, match="boom"):
        with rt:
            act = torch.randn(64)
            valid = ops.wait_transfer(ops.copy_d2h(act), act)  # waited, never released
            filling = ops.copy_d2h(torch.randn(64))  # never waited
            raise ValueError("boom")
    assert rt.transfers_pending == 0 and not engine.in_flight()  # drained
    assert pool.stats().buffers_in_use == 0  # nothing lost with the aborted step
    with rt:  # a stale host copy is refused, not silently reused
        with pytest.raises(TransferMisuseError, match="already released"):
            ops.copy_h2d(valid, "cpu")
    del valid, filling
    stats = pool.stats()
    assert stats.pending_releases == 0 and stats.pinned_bytes_cached == 2 * 1024


def test_transfers_drained_at_a_faulty_exit_can_still_be_released(cuda_like) -> None:  # noqa: ANN001
    engine, pool = cuda_like(), PinnedMemoryPool(1 << 20, pin=False)
    rt = TransferRuntime(pool=pool, engines=[engine])
    with pytest.raises(TransferMisuseError, match="never waited"):
        with rt:
            host = ops.copy_d2h(torch.arange(4.0))
    assert rt.host_state(host) is HostCopyState.VALID  # synchronized: the copy is complete
    with rt:
        ops.release_host(host)
    del host
    assert pool.stats().buffers_in_use == 0 and pool.stats().pinned_bytes_cached == 1024


def test_release_orphans_returns_unreachable_host_copies_only() -> None:
    # A forward whose backward never runs (a later backward raised, or no backward at
    # all) leaves host copies no release_host will ever reach; they must not stay lost.
    pool = PinnedMemoryPool(1 << 20, pin=False)
    runtime = TransferRuntime(pool=pool)
    with runtime:
        act = torch.randn(256)
        kept = ops.wait_transfer(ops.copy_d2h(act), act)
        orphan = ops.wait_transfer(ops.copy_d2h(torch.randn(128)))
        done = ops.wait_transfer(ops.copy_d2h(torch.randn(64)))
        ops.release_host(done)
    del orphan, done
    gc.collect()
    assert pool.stats().buffers_in_use == 2
    assert runtime.release_orphans() == 1  # the live one stays, the released one is done
    assert pool.stats().buffers_in_use == 1
    assert runtime.host_state(kept) is HostCopyState.VALID
    assert runtime.release_orphans() == 0
    with runtime:
        ops.release_host(kept)
    assert pool.stats().buffers_in_use == 0


def test_a_host_copy_reached_only_through_a_fresh_alias_is_not_an_orphan() -> None:
    # Inductor hands the backward a new tensor object on the host copy's storage
    # (reinterpret_tensor); the object the op returned dies. A forward of the same region
    # that runs again before that backward (one compiled layer reused by several layers)
    # calls release_orphans: the copy is still reachable and must survive it.
    pool = PinnedMemoryPool(1 << 20, pin=False)
    runtime = TransferRuntime(pool=pool)
    with runtime:
        returned = ops.wait_transfer(ops.copy_d2h(torch.randn(8, 4)))
    alias = torch.as_strided(returned, (4, 8), (8, 1))  # another object, same storage
    del returned
    gc.collect()
    assert runtime.release_orphans() == 0
    assert runtime.host_state(alias) is HostCopyState.VALID
    with runtime:
        back = ops.wait_transfer(ops.copy_h2d(alias, torch.device("cpu")))
        ops.release_host(alias)
    assert back.shape == (4, 8)
    del alias
    gc.collect()
    assert runtime.release_orphans() == 0  # released by release_host, not an orphan
    assert pool.stats().buffers_in_use == 0
