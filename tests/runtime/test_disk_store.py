"""The disk tier's runtime on CPU with a real directory (issue 50): ``DiskStore`` round
trips bytes bit for bit, one file per copy in a directory of its own, in order on one
worker; the residency manager's SPILL / LOAD / RELEASE_DISK keep data and pool buffers
through every path; a write waits for its D2H; the pool waits for pending writes at its
cap; and files are removed on every exit path: a step, a failure injected mid-step,
garbage collection and process exit."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from hyper_offload.errors import ResidencyMisuseError, TransferFailedError
from hyper_offload.runtime.transfer import TransferEngine
from hyper_offload.runtime.disk_store import DiskStore, profile_disk_bandwidth
from hyper_offload.runtime.physical_buffer import BufferState
from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
from hyper_offload.runtime.residency import ResidencyManager

from .doubles import DeferredEngine, same_bits


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _odd_floats(n: int) -> torch.Tensor:
    """Floats with NaN payloads, infinities, signed zeros and subnormals."""
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32)
    bits[:6] = torch.tensor([0x7FC00001, 0x7F800000, -0x80000000, 1, 0xFF800000 - 2**32,
                             0x7FBFFFFF], dtype=torch.int32)
    return bits.view(torch.float32)


def test_bytes_round_trip_bit_for_bit_in_a_directory_of_their_own(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    assert store.path.parent == tmp_path and store.path.name.startswith("hyper-offload-")
    data = _odd_floats(3001)  # an odd byte count
    source = data.view(torch.uint8)
    write = store.write("a", source, source.numel())
    back = torch.empty_like(source)
    store.read("a", back).synchronize()  # queued after the write: same worker, in order
    assert write.query() and same_bits(back.view(torch.float32), data)
    assert [p.parent for p in _files(tmp_path)] == [store.path]
    store.remove("a").synchronize()
    assert _files(tmp_path) == [] and "a" not in store
    stats = store.stats()
    assert (stats.bytes_written, stats.bytes_read, stats.bytes_held) == (12004, 12004, 0)
    store.close()
    assert not store.path.exists() and store.closed
    store.close()  # idempotent


def test_misuse_and_the_disk_budget_are_named(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, budget_bytes=100)
    buffer = torch.zeros(64, dtype=torch.uint8)
    store.write(1, buffer, 64)
    with pytest.raises(ResidencyMisuseError, match="exists already"):
        store.write(1, buffer, 64)
    with pytest.raises(ResidencyMisuseError, match="past its budget of 100 B"):
        store.write(2, buffer, 64)
    with pytest.raises(ResidencyMisuseError, match="no file for it"):
        store.read(3, buffer)
    with pytest.raises(ResidencyMisuseError, match="128 B asked of a 64 B buffer"):
        store.write(4, buffer, 128)
    store.close()
    with pytest.raises(ResidencyMisuseError, match="after close"):
        store.write(5, buffer, 8)


def test_a_failed_write_raises_at_its_sync_naming_the_file(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)

    def fail() -> None:
        raise OSError(28, "No space left on device")

    io = store.write("x", torch.zeros(8, dtype=torch.uint8), 8, ready=fail)
    with pytest.raises(TransferFailedError, match="No space left on device") as info:
        io.synchronize()
    assert "write of" in str(info.value) and "disk_dir" in str(info.value)
    store.clear()  # the cleanup path ignores it and still removes everything
    assert _files(tmp_path) == []


def test_a_discard_removes_the_file_whichever_side_runs_first(tmp_path: Path) -> None:
    # What a dying handle does (a finalizer: no lock, no wait). Before its write ran:
    store = DiskStore(tmp_path)
    gate = threading.Event()
    pending = store.write("early", torch.ones(64, dtype=torch.uint8), 64, ready=gate.wait)
    store.discard("early")
    gate.set()
    pending.synchronize()
    # ... and after it ran:
    store.write("late", torch.ones(64, dtype=torch.uint8), 64).synchronize()
    assert len(_files(tmp_path)) == 1
    store.discard("late")
    store.discard("unknown")  # ignored
    assert _files(tmp_path) == [] and store.stats().files == 0 and store.stats().bytes_held == 0
    store.close()


def test_the_directory_goes_with_the_store_and_with_the_process(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    store.write(0, torch.ones(16, dtype=torch.uint8), 16)
    path = store.path
    del store
    gc.collect()
    assert not path.exists()
    # A process that exits without closing its store (an interrupt, sys.exit) leaves
    # nothing behind: the finalizer runs at exit.
    code = ("import sys, torch; from hyper_offload.runtime.disk_store import DiskStore; "
            f"s = DiskStore({str(tmp_path)!r}); s.write(0, torch.ones(1 << 20, "
            "dtype=torch.uint8), 1 << 20); print(s.path); sys.exit(3)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stderr
    assert not Path(done.stdout.strip()).exists() and list(tmp_path.iterdir()) == []


def test_the_probe_measures_and_leaves_nothing(tmp_path: Path) -> None:
    figures = profile_disk_bandwidth(tmp_path, probe_bytes=1 << 20, repeats=1)
    assert figures.write_gbps > 0 and figures.read_gbps > 0
    assert figures.gbps == min(figures.write_gbps, figures.read_gbps)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- the residency manager


@pytest.fixture
def disk_manager(tmp_path: Path) -> ResidencyManager:
    return ResidencyManager(TransferEngine("cpu"), PinnedMemoryPool(1 << 24, pin=False),
                            disk=DiskStore(tmp_path), verify=True)


def test_spill_load_and_release_keep_the_data_and_the_pool(disk_manager: ResidencyManager,
                                                           tmp_path: Path) -> None:
    manager = disk_manager
    data = _odd_floats(1000)
    tensor = data.clone()
    manager.bind(7, tensor)
    manager.copy_d2h(7)
    manager.spill_to_disk(7)
    manager.release_device(7)
    manager.disk.synchronize()  # type: ignore[union-attr]  # the write is asynchronous
    assert manager.state(7) is BufferState.HOST and manager.on_disk(7)
    assert not manager.has_host_copy(7) and len(_files(tmp_path)) == 1
    assert tensor.untyped_storage().nbytes() == 0
    manager.load_from_disk(7)
    manager.copy_h2d(7)  # waits for the read first
    manager.wait_h2d(7)  # verify: the reload is checked against the D2H's checksum
    manager.release_host(7)
    manager.release_disk(7)
    manager.disk.synchronize()  # type: ignore[union-attr]
    assert same_bits(tensor, data) and _files(tmp_path) == []
    manager.unbind(7)
    assert manager.pool.stats().pinned_bytes_in_use == 0


def test_the_write_waits_for_its_d2h(tmp_path: Path) -> None:
    engine = DeferredEngine()
    manager = ResidencyManager(engine, PinnedMemoryPool(1 << 20, pin=False),
                               disk=DiskStore(tmp_path))
    manager.bind(0, torch.arange(256, dtype=torch.float32))
    d2h = manager.copy_d2h(0)
    assert not d2h.query()  # on a copy stream, still in flight
    manager.spill_to_disk(0).synchronize()
    # The worker waited on the D2H's own event before it wrote (the host never did).
    assert d2h.event.synchronizes == 1  # type: ignore[union-attr]
    assert engine.host_syncs.total == 0
    manager.reset()


def test_a_failure_mid_step_pages_everything_back_and_leaves_no_file(
    disk_manager: ResidencyManager, tmp_path: Path
) -> None:
    manager = disk_manager
    tensors = {sid: _odd_floats(500 + sid) for sid in range(4)}
    originals = {sid: t.clone() for sid, t in tensors.items()}
    for sid, tensor in tensors.items():
        manager.bind(sid, tensor)
        manager.copy_d2h(sid)
        manager.spill_to_disk(sid)
        manager.release_device(sid)
    manager.load_from_disk(1)  # one read in flight, one storage loaded and reloaded
    manager.load_from_disk(2)
    manager.copy_h2d(2)
    manager.disk.synchronize()  # type: ignore[union-attr]
    assert len(_files(tmp_path)) == 4
    manager.reset()  # what a failed step (an exception, an interrupt) runs
    assert _files(tmp_path) == [] and manager.pool.stats().pinned_bytes_in_use == 0
    assert all(same_bits(tensors[s], originals[s]) for s in tensors)
    assert len(manager) == 0


def test_the_pool_waits_for_a_pending_write_at_its_cap(tmp_path: Path) -> None:
    pool = PinnedMemoryPool(4096, pin=False)
    store = DiskStore(tmp_path)
    gate = threading.Event()
    buffer = pool.acquire(4096)
    write = store.write(0, buffer, 4096, ready=gate.wait)
    pool.release(buffer, write)  # what a spill does: back once the write is done
    threading.Timer(0.05, gate.set).start()
    again = pool.acquire(4096)  # the pool is full: it waits for the write, then reuses
    assert write.query() and pool.stats().pinned_bytes_peak <= 4096
    pool.release(again)
    store.close()


def test_without_a_disk_tier_a_spill_is_refused() -> None:
    manager = ResidencyManager(TransferEngine("cpu"), PinnedMemoryPool(1 << 20, pin=False))
    manager.bind(0, torch.ones(4))
    manager.copy_d2h(0)
    with pytest.raises(ResidencyMisuseError, match="max_disk_activation_mb"):
        manager.spill_to_disk(0)
    manager.reset()


def test_verify_still_catches_a_write_after_the_copy_of_a_spilled_storage(
    disk_manager: ResidencyManager,
) -> None:
    from hyper_offload.errors import TransferIntegrityError

    tensor = torch.ones(64)
    disk_manager.bind(0, tensor)
    disk_manager.copy_d2h(0)
    disk_manager.spill_to_disk(0)
    tensor.add_(1)  # a write the plan did not see: the file holds the old bytes
    with pytest.raises(TransferIntegrityError, match="write after copy"):
        disk_manager.release_device(0)
    disk_manager.reset()
