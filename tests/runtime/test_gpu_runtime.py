"""Runtime on a real CUDA device: async overlap, prefetch integrity, free-after-D2H races,
timing events, bandwidth probe. Skipped without CUDA."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from hyper_offload.runtime.device import DeviceTimer, profile_transfer_bandwidth
from hyper_offload.runtime.transfer import TransferEngine
from hyper_offload.runtime.pinned_pool import PageableFallbackWarning, PinnedMemoryPool
from hyper_offload.runtime.residency import ResidencyManager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MIB = 1 << 20


def _slow_compute(x: torch.Tensor, steps: int) -> torch.Tensor:
    """A chain of dependent matmuls on the current (compute) stream."""
    for _ in range(steps):
        x = torch.tanh(x @ x)
    return x


def _pattern(nbytes: int, device: str, salt: int = 0) -> torch.Tensor:
    """Random bytes made in place (no temporaries), so the tensor's block is its own and a
    same-size allocation after its free lands exactly there."""
    generator = torch.Generator(device=device).manual_seed(salt)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=generator)


def _wall(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def test_d2h_on_copy_stream_overlaps_compute() -> None:
    engine = TransferEngine("cuda")
    pool = PinnedMemoryPool(2048 * MIB, pin=True)
    nbytes = 512 * MIB
    src = _pattern(nbytes, "cuda")
    host = pool.acquire(nbytes)[:nbytes]
    assert host.is_pinned()
    a = torch.randn(4096, 4096, device="cuda")
    _slow_compute(a, 2)  # warm-up cuBLAS
    engine.d2h(src, host).synchronize()

    copy_s = min(_wall(lambda: engine.d2h(src, host).synchronize()) for _ in range(3))
    steps = 1
    while _wall(lambda: _slow_compute(a, steps)) < copy_s:
        steps *= 2  # compute at least as long as the copy, so overlap is unmistakable
    compute_s = _wall(lambda: _slow_compute(a, steps))

    host.zero_()

    def both() -> None:
        transfer = engine.d2h(src, host)  # enqueued first, so it runs beside the matmuls
        _slow_compute(a, steps)
        transfer.synchronize()

    both_s = min(_wall(both) for _ in range(2))
    assert torch.equal(host, src.cpu())
    # Serial would take compute_s + copy_s; with copy_s <= compute_s < 2 * copy_s,
    # overlapping hides the copy almost entirely (ratio ~0.5-0.67 vs 1.0 when serial).
    assert both_s < 0.85 * (compute_s + copy_s), (compute_s, copy_s, both_s)


def _fill_free_block_with_junk(nbytes: int) -> None:
    """Leave a same-size free block holding 0xEE where the next allocation will land, so
    a read of not-yet-copied bytes sees junk instead of stale correct data."""
    torch.cuda.synchronize()
    junk = torch.full((nbytes,), 0xEE, dtype=torch.uint8, device="cuda")
    del junk


def test_prefetch_read_after_wait_h2d_sees_the_data_even_behind_slow_compute() -> None:
    # Twin on CPU: test_copy_stream.py::test_wait_h2d_makes_compute_wait_for_that_storages_h2d
    engine = TransferEngine("cuda")
    pool = PinnedMemoryPool(1024 * MIB, pin=True)
    manager = ResidencyManager(engine, pool)
    nbytes = 256 * MIB
    activation = _pattern(nbytes, "cuda", salt=5)
    reference = activation.clone()
    manager.bind(0, activation)
    a = torch.randn(4096, 4096, device="cuda")
    _slow_compute(a, 1)  # warm-up: cuBLAS workspace allocated before we count bytes
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    manager.copy_d2h(0)
    manager.release_device(0)
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # lets the allocator process the copy stream's events
    figures = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), allocated, reserved)
    assert torch.cuda.memory_allocated() <= allocated - nbytes + MIB, figures

    _fill_free_block_with_junk(nbytes)
    # Slow compute is queued *before* the H2D: the copy stream waits for it, so the copy
    # and the read below both start only when it ends. Without WAIT_H2D the read races
    # the copy and sees the junk.
    _slow_compute(a, 20)
    manager.copy_h2d(0)
    manager.wait_h2d(0)
    mismatches = (activation != reference).sum()  # queued on compute, after the wait
    manager.release_host(0)
    assert mismatches.item() == 0
    assert engine.host_syncs.total == 0, engine.host_syncs  # .item() is the test's own sync
    assert pool.stats().buffers_in_use == 0


def test_freeing_a_tensor_right_after_async_d2h_does_not_corrupt_the_copy() -> None:
    # Twin on CPU: test_copy_stream.py::test_d2h_freed_before_its_copy_ran_is_protected_...
    engine = TransferEngine("cuda")
    pool = PinnedMemoryPool(2048 * MIB, pin=True)
    manager = ResidencyManager(engine, pool)
    nbytes = 256 * MIB
    a = torch.randn(4096, 4096, device="cuda")
    for round_ in range(3):
        victim = _pattern(nbytes, "cuda", salt=round_)
        expected = victim.cpu()
        sid = round_
        manager.bind(sid, victim)
        syncs = engine.host_syncs.total  # sync_all_transfers below counts (on purpose)
        _slow_compute(a, 10)  # the D2H queues behind this on the copy stream
        manager.copy_d2h(sid)
        manager.release_device(sid)  # bytes go back to the allocator while the copy waits
        del victim
        # Same size right away: if the allocator reused the block, this would overwrite
        # the bytes the D2H has not read yet.
        intruder = torch.full((nbytes,), 0xEE, dtype=torch.uint8, device="cuda")
        assert engine.host_syncs.total == syncs, engine.host_syncs  # free + intruder: no block
        manager.sync_all_transfers()
        host = manager.buffer(sid).host_buffer[:nbytes]
        assert torch.equal(host, expected), f"round {round_}: the D2H read reused memory"
        del intruder
        manager.release_host(sid)
        manager.unbind(sid)


def test_engine_transfer_freed_before_its_wait_is_protected_by_record_stream() -> None:
    # Twin on CPU: test_copy_stream.py::test_engine_records_the_device_side_only_for_...
    engine = TransferEngine("cuda")
    nbytes = 128 * MIB
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    a = torch.randn(4096, 4096, device="cuda")
    _slow_compute(a, 1)  # warm-up: cuBLAS workspace allocated before we count bytes
    src = _pattern(nbytes, "cuda", salt=3)
    expected = src.cpu()
    torch.cuda.synchronize()
    with_src = torch.cuda.memory_allocated()
    _slow_compute(a, 10)  # the D2H queues behind this on the copy stream
    transfer = engine.d2h(src, host, free_before_wait=True)
    assert transfer.device_side_recorded
    del src
    # The handle does not keep the source allocated (the allocator guards the block for
    # the copy stream instead) ...
    assert torch.cuda.memory_allocated() <= with_src - nbytes + 64 * MIB
    # ... and a same-size allocation right away must not get the bytes the copy reads.
    torch.full((nbytes,), 0x11, dtype=torch.uint8, device="cuda")
    transfer.synchronize()
    assert torch.equal(host, expected)


def test_engine_transfer_keeps_its_source_until_the_wait_then_frees_it_for_real() -> None:
    # Twin on CPU: test_copy_stream.py::test_engine_keeps_the_device_side_until_the_wait_...
    engine = TransferEngine("cuda")
    nbytes = 128 * MIB
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    a = torch.randn(4096, 4096, device="cuda")
    _slow_compute(a, 1)
    src = _pattern(nbytes, "cuda", salt=4)
    expected = src.cpu()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no spare free block: reuse below must take src's block
    with_src = torch.cuda.memory_allocated()
    _slow_compute(a, 10)  # the D2H queues behind this on the copy stream
    transfer = engine.d2h(src, host)
    assert not transfer.device_side_recorded
    del src
    assert torch.cuda.memory_allocated() >= with_src  # held by the handle until the wait
    transfer.wait()  # compute waits for the copy: no host block
    assert torch.cuda.memory_allocated() <= with_src - nbytes + MIB
    reserved = torch.cuda.memory_reserved()
    # The freed block is reusable at once (no record_stream: nothing deferred), and the
    # fill is ordered after the copy because the compute stream waited.
    reuse = torch.full((nbytes,), 0x22, dtype=torch.uint8, device="cuda")
    assert torch.cuda.memory_reserved() == reserved, "the freed block was not reusable"
    torch.cuda.synchronize()
    assert torch.equal(host, expected)
    assert engine.host_syncs.total == 0, engine.host_syncs
    del reuse


def test_pinned_pool_bounds_what_torch_really_pins() -> None:
    # The cap counts torch's power-of-two rounding and its cache of freed pinned blocks.
    if not hasattr(torch.cuda, "host_memory_stats"):
        pytest.skip("this torch has no torch.cuda.host_memory_stats()")
    PinnedMemoryPool._empty_host_cache()
    before = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    cap = 3 * MIB
    pool = PinnedMemoryPool(cap, pin=True)
    small = [pool.acquire(MIB) for _ in range(3)]
    for buffer in small:
        pool.release(buffer)
    del small, buffer
    big = pool.acquire(2 * MIB)  # evicts two cached 1 MiB buffers to stay under the cap
    assert big.is_pinned() and pool.stats().pageable_fallbacks == 0
    held = torch.cuda.host_memory_stats()["allocated_bytes.current"] - before
    assert held <= cap, (held, pool.stats())
    assert pool.stats().host_allocator_pinned_bytes is not None
    pool.release(big)
    del big
    pool.trim()
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] - before <= 0


def test_pageable_fallback_warns_once_and_counts_its_host_blocks() -> None:
    engine = TransferEngine("cuda")
    pool = PinnedMemoryPool(0, pin=True, pageable_fallback=True)  # past the cap: pageable
    manager = ResidencyManager(engine, pool)
    manager.bind(0, torch.ones(1024, device="cuda"))
    with pytest.warns(PageableFallbackWarning, match="max_host_activation_mb"):
        manager.copy_d2h(0)
    manager.bind(1, torch.ones(1024, device="cuda"))
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        manager.copy_d2h(1)
    assert not later  # once per pool
    stats = manager.stats()
    assert stats.pageable_fallbacks == 2
    assert stats.host_syncs_by_reason["async copy with pageable host memory"] == 2
    assert "pageable" in str(stats)
    manager.reset()


def test_cross_device_copy_falls_back_to_synchronous() -> None:
    engine = TransferEngine("cuda")
    transfer = engine.d2h(torch.arange(10.0), torch.empty(10))  # "device" side is on CPU
    assert transfer.event is None and transfer.query()
    if torch.cuda.device_count() > 1:
        other = torch.arange(10.0, device="cuda:1")
        host = torch.empty(10)
        assert engine.d2h(other, host).event is None and torch.equal(host, other.cpu())


def test_timer_uses_events_and_probe_measures_both_directions() -> None:
    a = torch.randn(4096, 4096, device="cuda")
    with DeviceTimer("cuda") as timer:
        _slow_compute(a, 5)
    assert timer.elapsed_s > 0
    result = profile_transfer_bandwidth("cuda")
    assert result.measured and result.d2h_gbps > 1 and result.h2d_gbps > 1
    with pytest.warns(RuntimeWarning, match="probe failed"):
        failed = profile_transfer_bandwidth("cuda", probe_bytes=1 << 50)
    assert not failed.measured and failed.d2h_gbps == 16.0


def test_copy_engines_run_d2h_and_h2d_concurrently_on_two_streams() -> None:
    """The hardware fact behind ``TransferEngine(copy_streams=2)`` (issue 16, "Copy
    engines"): a D2H and an H2D issued together take about as long as the longer one on
    two streams, and about their sum on one. Bytes arrive intact either way."""
    nbytes = 256 * MIB
    device_src, device_dst = _pattern(nbytes, "cuda", 1), torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host_src = _pattern(nbytes, "cpu", 2).pin_memory()
    host_dst = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    elapsed = {}
    for streams in (1, 2, 1, 2):  # the second pass is the one measured (first warms up)
        engine = TransferEngine("cuda", copy_streams=streams)

        def both() -> None:
            engine.d2h(device_src, host_dst)
            engine.h2d(host_src, device_dst)
            engine.synchronize()

        elapsed[streams] = _wall(both)
        assert engine.host_syncs.total == streams  # one drain per stream; both hosts pinned
    assert torch.equal(host_dst, device_src.cpu()) and torch.equal(device_dst.cpu(), host_src)
    assert elapsed[2] < 0.8 * elapsed[1], elapsed
