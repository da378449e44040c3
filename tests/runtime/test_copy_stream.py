"""The copy-stream path on a scripted CUDA (CPU): no host blocks on the normal path,
stream waits where ordering is needed, record_stream only where a free can precede
every wait, and no use-after-free.

Each GPU test in ``test_gpu_runtime.py`` / ``test_gpu_ops.py`` has a twin here that runs
the same sequence on :class:`scripted_cuda.ScriptedCudaEngine`; the model there turns
the race the GPU test guards into a wrong byte or a recorded violation, so breaking the
rule fails the twin (``scripts/mutation_check.py`` plants each such bug).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hyper_offload.passes import ActivationTrace, GreedyResidencyPlanner, check_schedule
from hyper_offload.runtime import ops
from hyper_offload.runtime.transfer import TransferDirection
from hyper_offload.runtime.stats import SyncReason
from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
from hyper_offload.runtime.residency import ResidencyManager
from hyper_offload.runtime.transfer_context import TransferRuntime

from .doubles import random_tensor, same_bits
from .scripted_cuda import JUNK, ScriptedCudaEngine


@pytest.fixture
def manager(scripted_engine: ScriptedCudaEngine, pool: PinnedMemoryPool) -> ResidencyManager:
    return ResidencyManager(scripted_engine, pool)


def _assert_no_host_block(engine: ScriptedCudaEngine) -> None:
    assert engine.host_syncs.total == 0, engine.host_syncs
    assert engine.sim.host_blocks == []  # ground truth, independent of the counter
    assert engine.sim.violations == []


# ---------------------------------------------------------------- the normal cycle


def test_offload_prefetch_wait_release_cycle_never_blocks_the_host(manager) -> None:
    engine: ScriptedCudaEngine = manager.engine
    tensors = [random_tensor((64,), seed=s) for s in range(3)]
    expected = [t.clone() for t in tensors]
    for sid, tensor in enumerate(tensors):
        manager.bind(sid, tensor)
    for sid in range(3):  # COPY_D2H + RELEASE_DEVICE in one slot, copies still queued
        manager.copy_d2h(sid)
        manager.release_device(sid)
        assert tensors[sid].untyped_storage().nbytes() == 0
    assert engine.sim.pending() == 3
    engine.sim.run(2)  # time passes: the copy stream is part way through
    for sid in range(3):  # COPY_H2D ... WAIT_H2D before the reading op
        manager.copy_h2d(sid)
    for sid in range(3):
        manager.wait_h2d(sid)
        assert same_bits(tensors[sid], expected[sid])  # the "kernel" reading it
        manager.release_host(sid)
        manager.release_device(sid)
    engine.sim.run_all()
    _assert_no_host_block(engine)
    assert len(engine.sim.stream_waits) == 3  # one WAIT_H2D each, as stream waits
    stats = manager.stats()
    assert stats.host_syncs == 0 and stats.pool.buffers_in_use == 0
    assert stats.pool.pending_releases == 0  # host buffers came back once copies ran


def test_a_planned_schedule_runs_without_host_blocks(pool) -> None:
    trace = ActivationTrace.from_accesses(
        [{0: "W"}, {1: "W"}, {1: "R"}, {2: "W"}, {2: "R"}, {0: "R"}, {1: "R"}],
        {0: 400, 1: 200, 2: 40},
        budget_bytes=440,
    )
    schedule = GreedyResidencyPlanner().plan(trace)
    check_schedule(trace, schedule).raise_if_invalid()
    engine = ScriptedCudaEngine()
    manager = ResidencyManager(engine, pool)
    values: dict[int, torch.Tensor] = {}
    expected: dict[int, torch.Tensor] = {}
    for index, op in enumerate(trace.ops):
        for action in schedule.pre[index]:
            manager.apply(action)
        for sid in sorted(access.storage for access in op.accesses):
            if sid not in values:  # born here
                values[sid] = random_tensor((trace.storage_sizes[sid] // 4,), seed=sid)
                expected[sid] = values[sid].clone()
                manager.bind(sid, values[sid])
            else:
                assert same_bits(values[sid], expected[sid]), f"op {index} read storage {sid}"
        for action in schedule.post[index]:
            manager.apply(action)
        engine.sim.run(1)  # the copy stream moves at one copy per op
    engine.sim.run_all()
    _assert_no_host_block(engine)
    assert len(engine.sim.queue) > 0  # the budget forced transfers


# ---------------------------------------------------------------- release_device


def test_release_device_of_a_waited_h2d_neither_blocks_nor_waits_again(manager) -> None:
    engine: ScriptedCudaEngine = manager.engine
    manager.bind(0, random_tensor((32,)))
    manager.copy_d2h(0)
    manager.release_device(0)
    manager.copy_h2d(0)
    manager.wait_h2d(0)
    waits = list(engine.sim.stream_waits)
    manager.release_device(0)
    assert engine.sim.stream_waits == waits
    _assert_no_host_block(engine)


def test_release_device_of_an_unwaited_h2d_orders_the_stream_instead_of_blocking(manager) -> None:
    engine: ScriptedCudaEngine = manager.engine
    tensor = random_tensor((32,))
    manager.bind(0, tensor)
    manager.copy_d2h(0)
    manager.release_device(0)
    manager.copy_h2d(0)  # no WAIT_H2D: the bytes are freed while the H2D may still write
    manager.release_device(0)
    assert tensor.untyped_storage().nbytes() == 0
    engine.sim.run_all()
    assert len(engine.sim.stream_waits) == 1  # the allocating stream waited for the H2D
    _assert_no_host_block(engine)


def test_d2h_freed_before_its_copy_ran_is_protected_by_record_stream(manager) -> None:
    # Twin of test_gpu_runtime.py::test_freeing_a_tensor_right_after_async_d2h_...
    engine: ScriptedCudaEngine = manager.engine
    victim = random_tensor((256,), seed=7)
    expected = victim.clone()
    manager.bind(0, victim)
    transfer = manager.copy_d2h(0)
    assert transfer.device_side_recorded
    manager.release_device(0)  # bytes back to the allocator while the copy is queued
    del victim
    intruder = torch.full((256,), 1.0)  # noqa: F841 - would take the block on a GPU
    engine.sim.run_all()
    assert same_bits(manager.buffer(0).host_buffer[: 1024].view(torch.float32), expected)
    _assert_no_host_block(engine)


# ---------------------------------------------------------------- demand paging


def test_demand_paging_waits_on_the_stream_not_the_host(manager) -> None:
    engine: ScriptedCudaEngine = manager.engine
    tensor = random_tensor((40,), seed=3)
    expected = tensor.clone()
    manager.bind(0, tensor)
    manager.copy_d2h(0)
    manager.release_device(0)
    storage = manager.device_storage(0)  # no COPY_H2D was scheduled: page it in
    assert storage.nbytes() == 160 and same_bits(tensor, expected)
    assert len(engine.sim.stream_waits) == 1
    _assert_no_host_block(engine)


# ---------------------------------------------------------------- WAIT_H2D is observed


def test_wait_h2d_makes_compute_wait_for_that_storages_h2d(manager) -> None:
    # Twin of test_gpu_runtime.py::test_prefetch_...: the read comes after the wait only.
    engine: ScriptedCudaEngine = manager.engine
    tensor = random_tensor((64,), seed=11)
    expected = tensor.clone()
    manager.bind(0, tensor)
    manager.copy_d2h(0)
    manager.release_device(0)
    engine.sim.run_all()
    h2d = manager.copy_h2d(0)
    assert not h2d.query()  # the copy is still queued; fresh device memory is junk:
    tensor.view(torch.uint8).fill_(JUNK)  # (the CPU allocator may hand back old bytes)
    manager.wait_h2d(0)
    assert engine.sim.stream_waits == [h2d.event.name]
    assert same_bits(tensor, expected)
    _assert_no_host_block(engine)


# ---------------------------------------------------------------- the transfer ops


def test_op_d2h_source_lives_until_its_wait_then_compute_reuse_follows_the_copy(
    scripted_engine: ScriptedCudaEngine,
) -> None:
    # Twin of test_gpu_ops.py::test_reuse_of_the_source_after_its_wait_...
    pool = PinnedMemoryPool(1 << 20, pin=False)
    with TransferRuntime(pool=pool, engines=[scripted_engine]):
        src = random_tensor((128,), seed=5)
        expected = src.clone()
        src_storage = weakref.ref(src.untyped_storage())
        host = ops.copy_d2h(src)
        del src
        gc.collect()
        assert src_storage() is not None  # the pending copy keeps its source
        host = ops.wait_transfer(host)
        gc.collect()
        assert src_storage() is None  # freed at the wait: really free, no deferred reuse
        junk = torch.full((128,), float("nan"))  # noqa: F841 - reuse after the wait
        scripted_engine.sim.run_all()
        assert same_bits(host, expected)
        ops.release_host(host)
    _assert_no_host_block(scripted_engine)
    # The wait comes before any free here, so record_stream (which would defer the block's
    # reuse to the end of the copy stream's queue) must not be used.
    assert not any(copy.recorded for copy in scripted_engine.sim.queue)


def test_op_h2d_destination_is_read_only_after_its_wait(scripted_engine: ScriptedCudaEngine) -> None:
    pool = PinnedMemoryPool(1 << 20, pin=False)
    with TransferRuntime(pool=pool, engines=[scripted_engine]):
        src = random_tensor((16, 8), seed=9)
        host = ops.wait_transfer(ops.copy_d2h(src), src)
        back = ops.copy_h2d(host, "cpu")
        assert scripted_engine.sim.pending() >= 1
        back = ops.wait_transfer(back, host)
        assert same_bits(back, src)
        ops.release_host(host, back)
    _assert_no_host_block(scripted_engine)
    assert not any(copy.recorded for copy in scripted_engine.sim.queue)


# ---------------------------------------------------------------- engine policy


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_engine_keeps_the_device_side_until_the_wait_unless_told_it_is_freed_first(
    scripted_engine: ScriptedCudaEngine, direction: str
) -> None:
    device, host = random_tensor((64,), seed=2), torch.zeros(64, dtype=torch.float32)
    device_ref = weakref.ref(device.untyped_storage())
    if direction == "d2h":
        transfer = scripted_engine.d2h(device, host)
    else:
        transfer = scripted_engine.h2d(host, device)
    assert not transfer.device_side_recorded
    del device
    gc.collect()
    assert device_ref() is not None  # held for the copy
    transfer.wait()
    gc.collect()
    assert device_ref() is None  # released at the stream wait
    _assert_no_host_block(scripted_engine)


def test_engine_records_the_device_side_only_for_frees_before_any_wait(
    scripted_engine: ScriptedCudaEngine,
) -> None:
    device, host = random_tensor((64,), seed=4), torch.zeros(64)
    expected = device.clone()
    transfer = scripted_engine.d2h(device, host, free_before_wait=True)
    assert transfer.device_side_recorded
    device.untyped_storage().resize_(0)  # freed before the copy ran
    scripted_engine.sim.run_all()
    assert same_bits(host, expected)
    _assert_no_host_block(scripted_engine)


def test_the_scripted_model_flags_a_free_before_the_copy_without_protection(
    scripted_engine: ScriptedCudaEngine,
) -> None:
    # The model itself: without record_stream or a wait, freeing first is a violation.
    device, host = random_tensor((64,), seed=4), torch.zeros(64)
    scripted_engine.sim.enqueue(TransferDirection.D2H, device, host)
    device.untyped_storage().resize_(0)
    scripted_engine.sim.run_all()
    assert len(scripted_engine.sim.violations) == 1
    assert bool((host.view(torch.uint8) == JUNK).all())


def test_pageable_host_buffers_are_counted_as_host_syncs(scripted_engine: ScriptedCudaEngine) -> None:
    host = torch.zeros(16)
    scripted_engine.sim.mark_pageable(host)
    scripted_engine.d2h(torch.ones(16), host).wait()
    assert scripted_engine.host_syncs.by_reason() == {SyncReason.PAGEABLE_COPY: 1}


def test_synchronize_and_drains_are_counted(scripted_engine: ScriptedCudaEngine) -> None:
    transfer = scripted_engine.d2h(torch.ones(16), torch.zeros(16))
    transfer.synchronize()
    transfer.synchronize()  # already complete: not a block
    scripted_engine.synchronize()
    assert scripted_engine.host_syncs.by_reason() == {
        SyncReason.SYNCHRONIZE: 1, SyncReason.ENGINE_DRAIN: 1
    }
    assert len(scripted_engine.sim.host_blocks) == 2
