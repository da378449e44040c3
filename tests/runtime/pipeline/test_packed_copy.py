"""PackedCopy: a swap group's storages moved as one packed host buffer, one copy each way.

CPU tests run the real synchronous engine, a spying engine, the deferred engine (copies
that complete later) and the scripted CUDA (copy stream, allocator model); the GPU test
is skipped without CUDA.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from hyper_offload.errors import ResidencyMisuseError
from hyper_offload.runtime.transfer import Transfer, TransferDirection, TransferEngine
from hyper_offload.runtime.memory_meter import DeviceMemoryMeter
from hyper_offload.runtime.pinned_pool import PinnedMemoryPool, bucket_bytes
from hyper_offload.runtime.pipeline.packed_copy import PackedCopy, PackState
from hyper_offload.runtime.pipeline.swap_group import SwapStateError

from ..doubles import DeferredEngine, random_tensor, same_bits
from ..scripted_cuda import ScriptedCudaEngine

CPU = torch.device("cpu")


class SpyEngine(TransferEngine):
    """A CPU engine that logs every copy it is asked for (independent of the counters)."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device)
        self.calls: list[TransferDirection] = []

    def d2h(self, src: torch.Tensor, dst_host: torch.Tensor, *, after: Iterable[Transfer] = (), free_before_wait: bool = False) -> Transfer:
        self.calls.append(TransferDirection.D2H)
        return super().d2h(src, dst_host, after=after, free_before_wait=free_before_wait)

    def h2d(self, src_host: torch.Tensor, dst: torch.Tensor, *, after: Iterable[Transfer] = (), free_before_wait: bool = False) -> Transfer:
        self.calls.append(TransferDirection.H2D)
        return super().h2d(src_host, dst, after=after, free_before_wait=free_before_wait)


def _tensors(device: torch.device = CPU) -> list[torch.Tensor]:
    """Storages of different sizes and dtypes (arbitrary bits: NaN payloads included)."""
    specs = [((3, 5), torch.float32), ((7,), torch.int64), ((2, 3, 4), torch.bfloat16),
             ((11,), torch.bool), ((1, 1), torch.float64)]
    return [random_tensor(shape, dtype, seed=i).to(device) for i, (shape, dtype) in enumerate(specs)]


def _cycle(packed: PackedCopy) -> None:
    packed.launch_offload()
    packed.wait_offload()
    packed.launch_load()
    packed.wait_load()


def _packed(tensors: list[torch.Tensor], engine: TransferEngine, pool: PinnedMemoryPool, name: str = "g") -> PackedCopy:
    return PackedCopy(name, [t.untyped_storage() for t in tensors], engine, pool, tensors[0].device if tensors else CPU)


def test_round_trip_frees_then_restores_every_storage_bit_for_bit(pool: PinnedMemoryPool) -> None:
    tensors = _tensors()
    views = [tensors[0][1:, ::2], tensors[2].transpose(0, 2)]  # views see the reload too
    originals = [t.clone() for t in tensors]
    view_originals = [v.clone() for v in views]
    packed = _packed(tensors, TransferEngine("cpu"), pool)
    assert packed.nbytes == sum(t.untyped_storage().nbytes() for t in tensors)
    packed.launch_offload()
    assert packed.state is PackState.OFFLOADING
    # The pack holds the bytes from here: the members are freed at once, not doubled.
    assert [t.untyped_storage().nbytes() for t in tensors] == [0] * len(tensors)
    packed.wait_offload()
    assert [t.untyped_storage().nbytes() for t in tensors] == [0] * len(tensors)
    assert packed.host_bytes == bucket_bytes(packed.nbytes)
    packed.launch_load()
    packed.wait_load()
    assert packed.state is PackState.LOADED
    assert all(same_bits(t, o) for t, o in zip(tensors, originals))
    assert all(same_bits(v, o) for v, o in zip(views, view_originals))
    assert packed.host_bytes == 0 and packed.num_storages == 0, "nothing held after wait_load"


@pytest.mark.parametrize("count", [1, 2, 5, 16])
def test_exactly_one_copy_each_way_whatever_the_number_of_storages(pool: PinnedMemoryPool, count: int) -> None:
    tensors = [random_tensor((i + 1, 3), seed=i) for i in range(count)]
    engine = SpyEngine()
    packed = _packed(tensors, engine, pool)
    packed.launch_offload()
    packed.wait_offload()
    assert (packed.d2h_copies, packed.h2d_copies) == (1, 0)
    packed.launch_load()
    packed.wait_load()
    assert (packed.d2h_copies, packed.h2d_copies) == (1, 1)
    assert engine.calls == [TransferDirection.D2H, TransferDirection.H2D]
    assert engine.host_syncs.total == 0


def test_host_buffer_returns_to_the_pool_and_is_reused_without_growth(pool: PinnedMemoryPool) -> None:
    tensors = _tensors()
    originals = [t.clone() for t in tensors]
    packed = _packed(tensors, TransferEngine("cpu"), pool)
    _cycle(packed)
    first = pool.stats()
    capacity = bucket_bytes(packed.nbytes)
    assert (first.buffers_in_use, first.pending_releases) == (0, 0)
    assert first.pinned_bytes_cached == capacity and first.pinned_bytes_in_use == 0
    for _ in range(19):
        _cycle(_packed(tensors, TransferEngine("cpu"), pool))
    stats = pool.stats()
    assert (stats.misses, stats.hits) == (1, 19), "one allocation, then reuse"
    assert stats.pinned_bytes_peak == capacity and stats.pinned_bytes_held == capacity
    assert all(same_bits(t, o) for t, o in zip(tensors, originals))


def test_meter_sees_the_staging_transient_and_the_freed_bytes(pool: PinnedMemoryPool) -> None:
    """The staging buffer takes the members' place: levels are what a per-storage swap
    holds, and the two coexist only inside launch_offload (the pack) and wait_load (the
    unpack): a transient of the packed size there, never a level."""
    tensors = _tensors()
    packed = _packed(tensors, TransferEngine("cpu"), pool)
    size = packed.nbytes
    meter = DeviceMemoryMeter("cpu").register(*tensors)
    with meter:
        base = meter.live_bytes
        assert base == size
        packed.launch_offload()
        offload_transient = meter.peak_bytes - base
        assert meter.live_bytes == base, "the staging buffer replaces the members"
        packed.wait_offload()
        assert meter.live_bytes == base - size, "staging freed; host not counted"
        packed.launch_load()
        assert meter.live_bytes == base, "load staging only; the members grow at wait_load"
        index = meter.sample_count
        packed.wait_load()
        load_transient = meter.peak_since(index) - base
        assert meter.live_bytes == base
    assert offload_transient == size and load_transient == size
    assert meter.peak_bytes == base + size


def test_out_of_order_steps_raise_and_change_nothing(pool: PinnedMemoryPool) -> None:
    tensors = _tensors()
    packed = _packed(tensors, TransferEngine("cpu"), pool, name="pp_swap_run0_s1_m2")
    with pytest.raises(SwapStateError, match="pp_swap_run0_s1_m2: packed wait_offload needs state OFFLOADING, found IDLE"):
        packed.wait_offload()
    packed.launch_offload()
    for step in (packed.launch_offload, packed.launch_load, packed.wait_load):
        with pytest.raises(SwapStateError, match="found OFFLOADING"):
            step()
    assert packed.state is PackState.OFFLOADING and packed.d2h_copies == 1
    packed.wait_offload()
    with pytest.raises(SwapStateError, match="wait_load needs state LOADING, found OFFLOADED"):
        packed.wait_load()
    packed.launch_load()
    packed.wait_load()
    with pytest.raises(SwapStateError, match="launch_offload needs state IDLE, found LOADED"):
        packed.launch_offload()


@pytest.mark.parametrize("steps", [0, 1, 2, 3])
def test_abort_from_any_state_restores_the_bytes_and_returns_the_host_buffer(pool: PinnedMemoryPool, steps: int) -> None:
    tensors = _tensors()
    originals = [t.clone() for t in tensors]
    packed = _packed(tensors, TransferEngine("cpu"), pool)
    for step in (packed.launch_offload, packed.wait_offload, packed.launch_load)[:steps]:
        step()
    packed.abort()
    assert packed.state is PackState.CLOSED and packed.host_bytes == 0
    assert all(same_bits(t, o) for t, o in zip(tensors, originals))
    assert pool.stats().buffers_in_use == 0
    packed.abort()  # finished: a no-op
    with pytest.raises(SwapStateError, match="found CLOSED"):
        packed.launch_offload()


def test_abort_after_wait_load_is_a_no_op(pool: PinnedMemoryPool) -> None:
    packed = _packed(_tensors(), TransferEngine("cpu"), pool)
    _cycle(packed)
    packed.abort()
    assert packed.state is PackState.LOADED and (packed.d2h_copies, packed.h2d_copies) == (1, 1)


@pytest.mark.parametrize("tensors", [[], [torch.empty(0)]], ids=["no storages", "zero bytes"])
def test_nothing_to_move_issues_no_copy(pool: PinnedMemoryPool, tensors: list[torch.Tensor]) -> None:
    engine = SpyEngine()
    packed = _packed(tensors, engine, pool)
    _cycle(packed)
    assert packed.state is PackState.LOADED and packed.nbytes == 0
    assert (packed.d2h_copies, packed.h2d_copies, engine.calls) == (0, 0, [])
    assert pool.stats().misses == 0


def test_misuse_at_construction_names_the_storage(pool: PinnedMemoryPool) -> None:
    t = torch.ones(4)
    with pytest.raises(ResidencyMisuseError, match="g: PackedCopy storage 1 was already passed"):
        PackedCopy("g", [t.untyped_storage(), t[1:].untyped_storage()], TransferEngine("cpu"), pool, CPU)
    with pytest.raises(ResidencyMisuseError, match="storage 0 is a Tensor"):
        PackedCopy("g", [t], TransferEngine("cpu"), pool, CPU)  # type: ignore[list-item]
    packed = PackedCopy("g", [t.untyped_storage()], TransferEngine("cpu"), pool, CPU)
    t.untyped_storage().resize_(8)
    with pytest.raises(ResidencyMisuseError, match="resized outside the packed copy"):
        packed.launch_offload()


def test_host_buffer_is_reused_only_after_both_copies_completed(pool: PinnedMemoryPool) -> None:
    # Copies that complete later and stream waits that do not complete them (as on CUDA).
    engine = DeferredEngine(records_streams=True, stream_waits=True)
    tensors = _tensors()
    originals = [t.clone() for t in tensors]
    packed = _packed(tensors, engine, pool)
    _cycle(packed)
    assert [direction for direction, _, _ in engine.log] == [TransferDirection.D2H, TransferDirection.H2D]
    assert engine.log[1][2] and engine.log[1][2][0].direction is TransferDirection.D2H, "H2D after D2H"
    stats = pool.stats()
    assert (stats.buffers_in_use, stats.pending_releases) == (0, 1), "released, gated by the copies"
    engine.log[1][1].fire()
    assert pool.stats().pending_releases == 1, "the D2H is still pending"
    engine.log[0][1].fire()
    assert pool.stats().pending_releases == 0 and pool.stats().pinned_bytes_cached > 0
    assert engine.engine_syncs == 0
    assert all(same_bits(t, o) for t, o in zip(tensors, originals))


class _NoRecordEngine(ScriptedCudaEngine):
    """A scripted CUDA whose allocator has no ``record_stream`` (the other free path)."""

    def _record_stream(self, tensor: torch.Tensor, stream: object) -> bool:
        return False


@pytest.mark.parametrize("engine_cls", [ScriptedCudaEngine, _NoRecordEngine], ids=["record_stream", "stream wait"])
def test_copy_stream_cycle_never_blocks_the_host_nor_frees_bytes_mid_copy(pool: PinnedMemoryPool, engine_cls: type[ScriptedCudaEngine]) -> None:
    engine = engine_cls()
    tensors = _tensors()
    originals = [t.clone() for t in tensors]
    packed = _packed(tensors, engine, pool)
    packed.launch_offload()
    packed.wait_offload()
    assert engine.sim.pending() == (1 if engine_cls is ScriptedCudaEngine else 0)
    packed.launch_load()
    assert engine.sim.pending() >= 1, "the H2D is queued, not run"
    packed.wait_load()
    assert engine.sim.host_blocks == [] and engine.host_syncs.total == 0
    assert engine.sim.violations == []
    assert len(engine.sim.queue) == 2 and engine.sim.stream_waits, "one copy each way, stream waits"
    assert all(same_bits(t, o) for t, o in zip(tensors, originals))
    assert pool.stats().buffers_in_use == 0


@pytest.mark.parametrize("steps", [1, 2], ids=["OFFLOADING", "OFFLOADED"])
def test_abort_while_copies_are_queued_drains_them_first(pool: PinnedMemoryPool, steps: int) -> None:
    engine = ScriptedCudaEngine()
    tensors = _tensors()
    originals = [t.clone() for t in tensors]
    packed = _packed(tensors, engine, pool)
    for step in (packed.launch_offload, packed.wait_offload)[:steps]:
        step()
    assert engine.sim.pending() == 1
    packed.abort()  # the D2H never ran: it is drained (and a reload waits for it)
    assert engine.sim.violations == [] and engine.sim.pending() == 0
    assert all(same_bits(t, o) for t, o in zip(tensors, originals))
    assert pool.stats().buffers_in_use == 0 and pool.stats().pending_releases == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_one_copy_each_way_and_no_host_sync() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    engine = SpyEngine("cuda")
    pool = PinnedMemoryPool(1 << 26)
    assert engine.is_async and pool.pin
    tensors = [torch.randn(1 << 16, device=device), torch.randint(0, 9, (333,), device=device),
               torch.randn(64, 64, device=device).half()]
    originals = [t.clone() for t in tensors]
    before = torch.cuda.memory_allocated(device)
    packed = _packed(tensors, engine, pool)
    packed.launch_offload()
    packed.wait_offload()
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    # Blocks are rounded up by the caching allocator, so at least the packed bytes go.
    assert before - torch.cuda.memory_allocated(device) >= packed.nbytes, "members and staging freed"
    packed.launch_load()
    packed.wait_load()
    assert engine.host_syncs.total == 0, engine.host_syncs
    assert engine.calls == [TransferDirection.D2H, TransferDirection.H2D]
    assert all(torch.equal(t, o) for t, o in zip(tensors, originals))  # the test's own sync
    torch.cuda.synchronize(device)
    assert pool.stats().buffers_in_use == 0
