"""``DiskStore``: the disk tier's files, written and read on a worker thread.

The schedule's ``SPILL_TO_DISK`` writes a host copy to a file and gives its host buffer
back; ``LOAD_FROM_DISK`` reads it into a fresh pool buffer; ``RELEASE_DISK`` removes
the file (:mod:`hyper_offload.passes.ir.schedule`). This module moves those bytes:

* **One file per spilled copy**, named by the caller's key, in a temporary directory of
  its own under ``disk_dir`` (``hyper-offload-XXXX``), so two sessions, two ranks or two
  processes never share a file.
* **One worker thread, first in first out**: the disk channel of the timeline model is
  serial, and so is this one. A read queued after the write of the same file, and a
  removal after the read, run in that order without a lock. Python releases the GIL
  inside ``os.write`` / ``readinto``, so compute goes on meanwhile.
* **A write waits for its bytes** (``ready``: the D2H that fills the host buffer, waited
  for on the worker), writes them, ``fdatasync``-s and drops them from the page cache
  (``posix_fadvise(DONTNEED)``): the point of the tier is host memory, and dirty or
  cached pages are host memory too (they count against a container's memory limit).
  A read drops its pages the same way.
* **Bit-exact**: bytes go to the file and come back as they are (no format, no header).
  ``OffloadConfig.verify`` checks the round trip as it checks every reload.
* **Handles** (:class:`DiskIO`) answer ``query()`` and ``synchronize()``, as a transfer
  does, so a host buffer released with a pending write as its event goes back to the
  pool only once the write is done, and the pool waits for it at its cap. A failed I/O
  raises :class:`~hyper_offload.errors.TransferFailedError` from ``synchronize()``,
  naming the file and the cause.
* **Files never outlive their owner**: :meth:`DiskStore.clear` (the end of a step, a
  failed step, an interrupt: the doors call it) waits for every I/O and removes every
  file; :meth:`DiskStore.discard` removes one from a finalizer (no lock, no wait: a
  pending write of it skips or undoes itself); :meth:`DiskStore.close` also removes the
  directory; a ``weakref.finalize`` does the same when the store is garbage collected or
  the process exits.

The files count against a budget (``budget_bytes``, raw bytes, from a write's request to
its removal's): a write past it raises
:class:`~hyper_offload.errors.ResidencyMisuseError` (a plan not made under this budget).

:func:`profile_disk_bandwidth` measures a directory once, the same way (write, sync,
drop, read), for the planners' ``disk_bandwidth_gbps``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from hyper_offload.errors import ConfigurationError, ResidencyMisuseError, TransferFailedError

__all__ = ["DiskBandwidth", "DiskIO", "DiskStore", "DiskStats", "profile_disk_bandwidth"]

PROBE_BYTES = 64 << 20


class DiskIO:
    """Handle of one write, read or removal queued on a :class:`DiskStore`."""

    __slots__ = ("op", "path", "nbytes", "_future")

    def __init__(self, op: str, path: Path, nbytes: int, future: Future[None]) -> None:
        self.op = op
        self.path = path
        self.nbytes = nbytes
        self._future = future

    def query(self) -> bool:
        """True once the I/O has finished (successfully or not); never blocks."""
        return self._future.done()

    def wait(self) -> None:
        """Block until the I/O finished, whether or not it failed (cleanup paths)."""
        self._future.exception()

    def synchronize(self) -> None:
        """Block until the I/O finished; raise ``TransferFailedError`` if it failed."""
        error = self._future.exception()
        if error is not None:
            raise TransferFailedError(
                f"disk tier: the {self.op} of {self.path} ({self.nbytes} B) failed: "
                f"{type(error).__name__}: {error}. Check the free space and permissions of "
                "OffloadConfig.disk_dir"
            ) from error

    def __repr__(self) -> str:
        state = "done" if self.query() else "pending"
        return f"DiskIO({self.op}, {self.path.name}, {self.nbytes} B, {state})"


@dataclass(frozen=True)
class DiskStats:
    """What a store did since it was made (bytes are raw file bytes)."""

    files: int
    bytes_held: int
    bytes_peak: int
    bytes_written: int
    bytes_read: int
    busy_s: float
    """Seconds the worker spent writing and reading (measured)."""


def host_bytes(buffer: torch.Tensor, nbytes: int) -> memoryview:
    """A writable view of the first ``nbytes`` bytes of the host tensor ``buffer``
    (no copy; the caller keeps ``buffer`` alive while the view is used)."""
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ResidencyMisuseError(
            f"disk tier: expected a contiguous host buffer, got one on {buffer.device}; spill "
            "host copies only"
        )
    if nbytes > buffer.numel() * buffer.element_size():
        raise ResidencyMisuseError(
            f"disk tier: {nbytes} B asked of a {buffer.numel() * buffer.element_size()} B buffer"
        )
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(buffer.data_ptr())).cast("B")


def _drop_cache(fd: int) -> None:
    # Clean pages only: the write syncs first. Where the call is missing the pages
    # stay cached, which costs memory, never correctness.
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


@dataclass(eq=False)
class _File:
    """One file of the store; ``dead`` once discarded (its write then skips or undoes
    itself: a discard never leaves a file behind, whichever side runs first)."""

    path: Path
    nbytes: int
    dead: bool = False


def _write(file: _File, view: memoryview, ready: Callable[[], object] | None) -> None:
    if ready is not None:
        ready()
    if file.dead:
        return
    _write_bytes(file.path, view)
    if file.dead:  # discarded while it was being written
        _unlink(file.path)


def _write_bytes(path: Path, view: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        os.fdatasync(fd)
        _drop_cache(fd)
    finally:
        os.close(fd)


def _read(path: Path, view: memoryview) -> None:
    with open(path, "rb", buffering=0) as file:
        done = 0
        while done < len(view):
            count = file.readinto(view[done:])
            if not count:
                raise TransferFailedError(
                    f"disk tier: {path} holds {done} B, {len(view)} B were written to it")
            done += count
        _drop_cache(file.fileno())


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def _close(executor: ThreadPoolExecutor, directory: Path) -> None:
    """Finalizer and :meth:`DiskStore.close`: drain the worker, remove every file."""
    executor.shutdown(wait=True)
    shutil.rmtree(directory, ignore_errors=True)


class _Meter:
    """Seconds the worker spent on jobs. Jobs reference this, never the store: a store
    whose last reference a finished job dropped would otherwise be finalized on its own
    worker thread, which cannot join itself."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds = 0.0

    def timed(self, job: Callable[[], object]) -> None:
        start = time.perf_counter()
        try:
            job()
        finally:
            with self._lock:
                self.seconds += time.perf_counter() - start


class DiskStore:
    """The disk tier's files for one owner (a session, a compiled model); see the module
    docstring. Thread-safe; ``key`` is any hashable naming one file at a time."""

    def __init__(self, directory: str | os.PathLike[str], *, budget_bytes: int | None = None) -> None:
        if budget_bytes is not None and (isinstance(budget_bytes, bool)
                                         or not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ConfigurationError(
                f"DiskStore: budget_bytes must be None or an int >= 0, got {budget_bytes!r}")
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix="hyper-offload-", dir=root))
        self.budget_bytes = budget_bytes
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hyper_offload_disk")
        self._lock = threading.Lock()
        self._files: dict[Hashable, _File] = {}
        self._pending: list[DiskIO] = []
        # Discarded (key, file) pairs, appended without the lock (finalizers), applied to
        # the bookkeeping by every locked operation (_reap_locked).
        self._discarded: deque[tuple[Hashable, _File]] = deque()
        self._held = self._peak = self._written = self._read = 0
        self._serial = 0
        self._busy = _Meter()
        self._finalizer = weakref.finalize(self, _close, self._executor, self.path)

    # ------------------------------------------------------------------ I/O

    def write(self, key: Hashable, buffer: torch.Tensor, nbytes: int, *,
              ready: Callable[[], object] | None = None) -> DiskIO:
        """Queue writing the first ``nbytes`` of host ``buffer`` to a new file for ``key``,
        after ``ready()`` returns (the copy that fills the buffer is done)."""
        view = host_bytes(buffer, nbytes)
        with self._lock:
            self._reap_locked()
            if key in self._files:
                raise ResidencyMisuseError(
                    f"DiskStore.write({key!r}): a file for it exists already; release it first")
            if self.budget_bytes is not None and self._held + nbytes > self.budget_bytes:
                raise ResidencyMisuseError(
                    f"DiskStore.write({key!r}): {nbytes} B would take the disk tier's files to "
                    f"{self._held + nbytes} B, past its budget of {self.budget_bytes} B "
                    "(OffloadConfig.max_disk_activation_mb): the plan was not made under this "
                    "budget. Plan through the door with the same config")
            self._serial += 1
            file = _File(self.path / f"{self._serial:08d}.bin", nbytes)
            self._files[key] = file
            self._held += nbytes
            self._peak = max(self._peak, self._held)
            self._written += nbytes
        # ``buffer`` rides along in the closure: alive until the bytes are on disk.
        return self._submit("write", file.path, nbytes,
                            lambda: (buffer, _write(file, view, ready)))

    def read(self, key: Hashable, buffer: torch.Tensor, nbytes: int | None = None) -> DiskIO:
        """Queue reading ``key``'s file into host ``buffer`` (all its bytes)."""
        with self._lock:
            file = self._file(key, "read")
            path, size = file.path, file.nbytes
            self._read += size
        if nbytes is not None and nbytes != size:
            raise ResidencyMisuseError(
                f"DiskStore.read({key!r}): the file holds {size} B, {nbytes} B were asked for")
        view = host_bytes(buffer, size)
        return self._submit("read", path, size, lambda: (buffer, _read(path, view)))

    def remove(self, key: Hashable) -> DiskIO:
        """Queue removing ``key``'s file, after every I/O queued before (a read of it)."""
        with self._lock:
            file = self._file(key, "remove")
            del self._files[key]
            self._held -= file.nbytes
        return self._submit("removal", file.path, 0, lambda: _unlink(file.path))

    def discard(self, key: Hashable) -> None:
        """Remove ``key``'s file now, from any context: no lock, never blocks, never
        raises (a finalizer's call: the handle that named the file died). A pending write
        of it skips or undoes itself; an unknown key is ignored."""
        file = self._files.get(key)
        if file is None:
            return
        file.dead = True
        self._discarded.append((key, file))
        try:
            _unlink(file.path)
        except OSError:  # pragma: no cover - clear() and close() remove it anyway
            pass

    def __contains__(self, key: object) -> bool:
        with self._lock:
            self._reap_locked()
            return key in self._files

    # ------------------------------------------------------------------ lifetimes

    def synchronize(self) -> None:
        """Block until every queued I/O finished; raise the first failure."""
        with self._lock:
            pending, self._pending = self._pending, []
        for io in pending:
            io.synchronize()

    def clear(self) -> None:
        """Wait for every I/O (failures ignored: this is the cleanup path) and remove
        every file: the end of every step, successful or not."""
        with self._lock:
            self._reap_locked()
            pending, self._pending = self._pending, []
            files = [file.path for file in self._files.values()]
            for file in self._files.values():
                file.dead = True
            self._files.clear()
            self._held = 0
        for io in pending:
            io.wait()  # the error, if any, was the step's to raise
        for path in files:
            _unlink(path)

    def close(self) -> None:
        """:meth:`clear`, then stop the worker and remove the directory (idempotent)."""
        self.clear()
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def stats(self) -> DiskStats:
        with self._lock:
            self._reap_locked()
            return DiskStats(len(self._files), self._held, self._peak, self._written,
                             self._read, self._busy.seconds)

    def __repr__(self) -> str:
        stats = self.stats()
        return (f"DiskStore({str(self.path)!r}, {stats.files} files, {stats.bytes_held} B, "
                f"budget {self.budget_bytes})")

    # ------------------------------------------------------------------ internals

    def _reap_locked(self) -> None:
        while self._discarded:
            key, file = self._discarded.popleft()
            if self._files.get(key) is file:
                del self._files[key]
                self._held -= file.nbytes

    def _file(self, key: Hashable, action: str) -> _File:
        # Caller holds the lock.
        self._reap_locked()
        found = self._files.get(key)
        if found is None:
            raise ResidencyMisuseError(
                f"DiskStore.{action}({key!r}): no file for it (never written, or removed "
                "already); a LOAD_FROM_DISK / RELEASE_DISK follows its SPILL_TO_DISK")
        return found

    def _submit(self, op: str, path: Path, nbytes: int, job: Callable[[], object]) -> DiskIO:
        if self.closed:
            raise ResidencyMisuseError(f"DiskStore: the {op} of {path.name} after close()")
        io = DiskIO(op, path, nbytes, self._executor.submit(self._busy.timed, job))
        with self._lock:
            self._pending = [p for p in self._pending if not p.query()] + [io]
        return io


@dataclass(frozen=True)
class DiskBandwidth:
    """A directory's measured write and read bandwidth, GB/s (10^9 bytes/s)."""

    write_gbps: float
    read_gbps: float

    @property
    def gbps(self) -> float:
        """What the planners price both directions at: the slower one."""
        return min(self.write_gbps, self.read_gbps)


def profile_disk_bandwidth(directory: str | os.PathLike[str], *, probe_bytes: int = PROBE_BYTES,
                           repeats: int = 2) -> DiskBandwidth:
    """Write ``probe_bytes`` to a file in ``directory`` and read them back, as the store
    does (``fdatasync``, page cache dropped), ``repeats`` times; the fastest run of each
    direction counts. The file and its directory are removed on every path."""
    if isinstance(probe_bytes, bool) or not isinstance(probe_bytes, int) or probe_bytes <= 0:
        raise ConfigurationError(
            f"profile_disk_bandwidth: probe_bytes must be an int > 0, got {probe_bytes!r}")
    buffer = torch.empty(probe_bytes, dtype=torch.uint8).random_(0, 256)
    view = host_bytes(buffer, probe_bytes)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hyper-offload-probe-", dir=root) as scratch:
        path = Path(scratch) / "probe.bin"
        write = read = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            _write_bytes(path, view)
            write = min(write, time.perf_counter() - start)
            start = time.perf_counter()
            _read(path, view)
            read = min(read, time.perf_counter() - start)
    return DiskBandwidth(probe_bytes / write / 1e9, probe_bytes / read / 1e9)
