"""ResidencyManager at work: actions by storage id, bit-exact reloads, real frees, transfers
in flight, reset, and a storage an op resized. Misuse, failing copies and the state-model
checks: ``test_residency_misuse.py``."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hyper_offload.errors import DataLostError, ResidencyMisuseError
from hyper_offload.passes import (
    AccessKind,
    ActivationTrace,
    ResidencyAction,
    ResidencySchedule,
    StorageAccess,
    TraceOp,
    check_schedule,
    resident_bytes_without_offload,
)
from hyper_offload.runtime.transfer import TransferEngine
from hyper_offload.runtime.memory_meter import DeviceMemoryMeter
from hyper_offload.runtime.physical_buffer import BufferState
from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
from hyper_offload.runtime.residency import ResidencyManager

from .residency_helpers import MIB, offloaded


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool,
     torch.complex64],
)
def test_offload_release_reload_is_bit_identical(manager, make_random, bits_equal, dtype) -> None:
    tensor = make_random((17, 9), dtype=dtype, seed=3)
    reference = tensor.clone()
    manager.bind(0, tensor)
    manager.copy_d2h(0)
    manager.release_device(0)
    assert tensor.untyped_storage().nbytes() == 0
    manager.copy_h2d(0)
    manager.wait_h2d(0)
    assert bits_equal(tensor, reference)
    assert bits_equal(manager.device_tensor(0), reference)


def test_zero_byte_storage_round_trips(manager) -> None:
    empty = torch.empty(0, 5)
    manager.bind(0, empty)
    manager.copy_d2h(0)
    manager.release_device(0)
    manager.copy_h2d(0)
    assert manager.device_tensor(0).shape == (0, 5) and manager.state(0) is BufferState.DEVICE_AND_HOST
    manager.release_host(0)
    assert manager.pool.stats().buffers_in_use == 0


def test_all_views_of_a_storage_see_the_reloaded_bytes(manager, make_random, bits_equal) -> None:
    base = make_random((8, 8), seed=4)
    row, col = base[3], base[:, 5]
    expected_row, expected_col = row.clone(), col.clone()
    manager.bind(7, row)
    with pytest.raises(ResidencyMisuseError, match="already bound as storage 7"):
        manager.bind(8, col)  # a view of the same storage
    manager.copy_d2h(7)
    manager.release_device(7)
    assert base.untyped_storage().nbytes() == 0 and col.untyped_storage().nbytes() == 0
    manager.copy_h2d(7)
    assert bits_equal(row, expected_row) and bits_equal(col, expected_col)


def test_apply_runs_schedule_actions(manager, bits_equal) -> None:
    tensor = torch.linspace(-3, 3, 100)
    reference = tensor.clone()
    manager.bind(2, tensor)
    started = [manager.apply(ResidencyAction.from_str(a)) for a in ("COPY_D2H 2", "RELEASE_DEVICE 2")]
    assert started[0] is not None and started[1] is None
    assert manager.state(2) is BufferState.HOST
    for text in ("COPY_H2D 2", "WAIT_H2D 2", "RELEASE_HOST 2"):
        manager.apply(ResidencyAction.from_str(text))
    assert manager.state(2) is BufferState.DEVICE and bits_equal(tensor, reference)


def _program(x: torch.Tensor, w: torch.Tensor):
    """Six ops over storages 0..5; storages 0 and 1 are read again late (offloadable gaps).
    Each entry: (name, reads, written storage, function of the read tensors)."""
    return [
        ("mm", (), 0, lambda: x @ w),
        ("relu", (0,), 1, lambda a: torch.relu(a)),
        ("mm2", (1,), 2, lambda a: a @ w.t()),
        ("tanh", (2,), 3, lambda a: torch.tanh(a)),
        ("mul", (3, 0), 4, lambda a, b: a[:, :1] * b),
        ("add", (4, 1), 5, lambda a, b: a + b),
    ]


def _trace_and_schedule(sizes: dict[int, int]):
    program = _program(torch.empty(0), torch.empty(0))
    ops = tuple(
        TraceOp(name, tuple(sorted([StorageAccess(r, AccessKind.READ) for r in reads]
                                   + [StorageAccess(out, AccessKind.WRITE)])), (out,))
        for name, reads, out, _ in program
    )
    budget = sizes[0] + sizes[1] + sizes[4]
    trace = ActivationTrace(ops, sizes, budget_bytes=budget, retained=frozenset({5}))
    act = ResidencyAction.from_str
    schedule = ResidencySchedule.from_slots(
        6,
        pre={4: [act("COPY_H2D 0"), act("WAIT_H2D 0")], 5: [act("COPY_H2D 1"), act("WAIT_H2D 1")]},
        post={
            1: [act("COPY_D2H 0"), act("RELEASE_DEVICE 0"), act("COPY_D2H 1")],
            2: [act("RELEASE_DEVICE 1")],
            3: [act("RELEASE_DEVICE 2")],
            4: [act("RELEASE_DEVICE 3"), act("RELEASE_DEVICE 0"), act("RELEASE_HOST 0")],
            5: [act("RELEASE_DEVICE 4"), act("RELEASE_DEVICE 1"), act("RELEASE_HOST 1")],
        },
    )
    return trace, schedule


def test_executing_a_validated_schedule_matches_the_validators_curve_bit_exactly(pool) -> None:
    """The runtime does what check_schedule simulates: real storage bytes per op equal the
    predicted resident-bytes curve, and the result is bit-identical to no offloading."""
    torch.manual_seed(0)
    x, w = torch.randn(48, 32), torch.randn(32, 32)
    plain: dict[int, torch.Tensor] = {}
    for _, reads, out, fn in _program(x, w):
        plain[out] = fn(*(plain[r] for r in reads))
    expected = plain[5].clone()
    sizes = {sid: t.untyped_storage().nbytes() for sid, t in plain.items()}
    trace, schedule = _trace_and_schedule(sizes)
    report = check_schedule(trace, schedule)
    assert report.ok, report.violations

    manager = ResidencyManager(TransferEngine("cpu"), pool)
    live: dict[int, torch.Tensor] = {}
    measured = []
    for i, (_, reads, out, fn) in enumerate(_program(x, w)):
        for action in schedule.pre[i]:
            manager.apply(action)
        live[out] = fn(*(live[r] for r in reads))
        manager.bind(out, live[out])
        measured.append(sum(live[s].untyped_storage().nbytes() for s in live))
        for action in schedule.post[i]:
            manager.apply(action)
    assert measured == list(report.resident_bytes)
    # Without the schedule op 3 would hold storages 0-3 at once: over the budget.
    assert max(measured) <= trace.budget_bytes < max(resident_bytes_without_offload(trace))
    assert torch.equal(live[5], expected)
    assert pool.stats().buffers_in_use == 0 and manager.transfers_in_flight() == 0


# ---------------------------------------------------------------- real frees


def test_release_device_leaves_no_reference_to_the_device_bytes(manager) -> None:
    tensor = torch.ones(1024)
    storage_ref = weakref.ref(tensor.untyped_storage())
    tensor_ref = weakref.ref(tensor)
    manager.bind(1, tensor)
    manager.copy_d2h(1)
    manager.release_device(1)
    # Every view of the storage, including the caller's, is now backed by zero bytes.
    assert tensor.untyped_storage().nbytes() == 0
    del tensor
    gc.collect()
    assert tensor_ref() is None  # the manager kept no tensor
    manager.copy_h2d(1)
    manager.release_host(1)
    manager.release_device(1)
    manager.unbind(1)
    gc.collect()
    assert storage_ref() is None  # and, once unbound, not the storage either


def test_live_storage_meter_sees_the_free_and_the_reload(pool) -> None:
    """An independent witness: the dispatch-level meter counts device bytes op by op."""
    manager = ResidencyManager(TransferEngine("cpu"), pool)
    x = torch.randn(256, 256)
    meter = DeviceMemoryMeter("cpu").register(x)
    with meter:
        activation = torch.tanh(x)  # 256 KiB, created inside the metered step
        nbytes = activation.untyped_storage().nbytes()
        with_activation = meter.live_bytes
        manager.bind(0, activation)
        manager.copy_d2h(0)  # the host buffer is host-labelled: no device bytes added
        assert meter.live_bytes == with_activation
        manager.release_device(0)
        assert meter.live_bytes == with_activation - nbytes
        manager.copy_h2d(0)
        assert meter.live_bytes == with_activation
        total = activation.sum()  # an op after the reload reads the restored bytes
    assert torch.equal(total, torch.tanh(x).sum())
    # Staging buffers were never counted: the peak is the activation plus the 4-byte sum.
    assert max(meter.curve()) == with_activation + total.untyped_storage().nbytes()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_release_device_returns_memory_to_the_operating_system(pool) -> None:
    # 64 MiB is served by mmap and unmapped on free, so the resident set shows the free.
    manager = ResidencyManager(TransferEngine("cpu"), PinnedMemoryPool(128 * MIB, pin=False))
    tensor = torch.ones(16 * MIB)  # 64 MiB, touched
    manager.bind(0, tensor)
    manager.copy_d2h(0)
    manager.release_host(0)
    manager.pool.trim()
    before = _rss_bytes()
    manager.release_device(0)
    after = _rss_bytes()
    assert before - after > 48 * MIB


def test_unbinding_a_resident_storage_keeps_its_bytes(manager) -> None:
    tensor = torch.arange(10.0)
    manager.bind(0, tensor)
    manager.copy_d2h(0)
    manager.unbind(0)
    assert 0 not in manager and torch.equal(tensor, torch.arange(10.0))
    assert manager.pool.stats().buffers_in_use == 0


def test_unbind_without_synchronize_leaves_the_load_in_flight(pool, deferred_engine_cls) -> None:
    engine = deferred_engine_cls(records_streams=True, stream_waits=True)
    manager = ResidencyManager(engine, pool)
    tensor = torch.arange(10.0)
    manager.bind(0, tensor)
    manager.copy_d2h(0)
    engine.fire_all()
    manager.release_device(0)
    manager.copy_h2d(0)
    with pytest.raises(ResidencyMisuseError, match="still has a host copy"):
        manager.unbind(0, synchronize=False)
    manager.release_host(0)
    manager.unbind(0, synchronize=False)
    assert 0 not in manager and manager.transfers_in_flight() == 1  # no host wait happened
    engine.fire_all()
    assert manager.transfers_in_flight() == 0
    assert torch.equal(tensor, torch.arange(10.0))


# ---------------------------------------------------------------- transfers and reset


def test_in_flight_transfers_are_tracked_until_synchronized(pool, deferred_engine) -> None:
    manager = ResidencyManager(deferred_engine, pool)
    for sid in range(3):
        manager.bind(sid, torch.full((16,), float(sid)))
        manager.copy_d2h(sid)
    assert manager.transfers_in_flight() == 3
    manager.sync_all_transfers()
    assert manager.transfers_in_flight() == 0
    assert all(event.is_done for _, event, _ in deferred_engine.log)


def test_wait_for_transfers_orders_compute_after_every_copy(pool, deferred_engine) -> None:
    manager = ResidencyManager(deferred_engine, pool)
    manager.bind(0, torch.ones(16))
    manager.copy_d2h(0)
    manager.wait_for_transfers()
    # On CPU the host is the compute stream: waiting means the copy completed.
    assert manager.transfers_in_flight() == 0
    assert deferred_engine.log[0][1].synchronizes == 1


def test_reset_restores_offloaded_storages_and_returns_every_buffer(pool, make_random, bits_equal) -> None:
    manager = ResidencyManager(TransferEngine("cpu"), pool)
    tensors = [make_random((50,), seed=s) for s in range(3)]
    references = [t.clone() for t in tensors]
    for sid, tensor in enumerate(tensors):
        manager.bind(sid, tensor)
        manager.copy_d2h(sid)
    manager.release_device(1)
    manager.reset()
    assert len(manager) == 0 and pool.stats().buffers_in_use == 0
    assert all(bits_equal(t, r) for t, r in zip(tensors, references))


def test_reset_without_restore_drops_offloaded_bytes(manager) -> None:
    tensor = offloaded(manager)
    manager.reset(restore_offloaded=False)
    assert len(manager) == 0 and manager.pool.stats().buffers_in_use == 0
    assert tensor.untyped_storage().nbytes() == 0


def test_reset_reports_storages_it_could_not_restore_after_cleaning_up(pool, failing_engine_cls) -> None:
    engine = failing_engine_cls()
    manager = ResidencyManager(engine, pool)
    manager.bind(0, torch.ones(8))
    manager.bind(5, torch.ones(8))
    manager.copy_d2h(5)
    manager.release_device(5)
    engine.fail_on = {"h2d"}
    with pytest.raises(DataLostError, match="storage 5"):
        manager.reset()
    assert len(manager) == 0 and pool.stats().buffers_in_use == 0


# ---------------------------------------------------------------- storages resized by an op


def test_a_storage_an_op_grew_is_adopted_at_its_new_size_and_round_trips(manager) -> None:
    """An in-place op may resize its output's storage (``addbmm_`` on a 0-dim tensor,
    ``resize_``, an ``out=`` of another size): the manager adopts the new size, a stale
    smaller host copy is replaced at the next D2H, and the grown bytes come back."""
    tensor = torch.ones(())
    manager.bind(0, tensor)
    manager.copy_d2h(0)
    manager.wait_for_transfers()  # a host copy of the 4-byte storage (stale after the write)
    tensor.resize_(5, 10).copy_(torch.arange(50.0).view(5, 10))
    with pytest.raises(ResidencyMisuseError, match="resized outside the manager"):
        manager.copy_d2h(0)
    assert manager.adopt_resize(0) == 200 - 4
    manager.copy_d2h(0)
    manager.release_device(0)
    manager.copy_h2d(0)
    manager.wait_h2d(0)
    assert torch.equal(tensor, torch.arange(50.0).view(5, 10))
    manager.release_host(0)
    manager.release_device(0)
    with pytest.raises(ResidencyMisuseError, match="not on the device"):
        manager.adopt_resize(0)
