"""PinnedMemoryPool: bucketing, reuse, cap + pageable fallback, pending release, misuse,
thread safety, trim. CPU runs use ``pin=False`` (the CPU build cannot pin)."""

from __future__ import annotations

import random
import threading
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_offload.errors import HostBudgetError, PoolMisuseError
from hyper_offload.runtime.memory_meter import is_host_labelled
from hyper_offload.runtime.pinned_pool import (
    MAX_BUCKET_BYTES,
    MIN_BUCKET_BYTES,
    PageableFallbackWarning,
    PinnedMemoryPool,
    bucket_bytes,
    pinned_cost,
)

KIB = 1 << 10
MIB = 1 << 20


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    ("request_bytes", "expected"),
    [(0, KIB), (1, KIB), (KIB, KIB), (KIB + 1, 2 * KIB), (3000, 4 * KIB), (MIB, MIB),
     (MAX_BUCKET_BYTES, MAX_BUCKET_BYTES), (MAX_BUCKET_BYTES + 1, MAX_BUCKET_BYTES + 1)],
)
def test_bucket_bytes_examples(request_bytes: int, expected: int) -> None:
    assert bucket_bytes(request_bytes) == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=MAX_BUCKET_BYTES))
def test_bucket_is_smallest_power_of_two_that_fits(nbytes: int) -> None:
    capacity = bucket_bytes(nbytes)
    assert capacity >= nbytes
    assert MIN_BUCKET_BYTES <= capacity <= MAX_BUCKET_BYTES
    assert capacity & (capacity - 1) == 0
    assert capacity == MIN_BUCKET_BYTES or capacity // 2 < nbytes


def test_acquire_returns_uint8_host_buffer_of_bucket_size() -> None:
    pool = PinnedMemoryPool(MIB, pin=False)
    buf = pool.acquire(3000)
    assert buf.dtype == torch.uint8 and buf.device.type == "cpu" and buf.dim() == 1
    assert buf.numel() == 4 * KIB
    assert not buf.is_pinned()
    assert is_host_labelled(buf)  # the live-storage meter never counts it as device bytes
    stats = pool.stats()
    assert stats.pinned_bytes_in_use == 4 * KIB and stats.misses == 1 and stats.hits == 0
    assert stats.buffers_in_use == 1 and not stats.pinned


def test_released_buffer_is_reused_for_same_bucket_only() -> None:
    pool = PinnedMemoryPool(MIB, pin=False)
    first = pool.acquire(3000)
    first_key = _key(first)
    pool.release(first)
    assert pool.stats().pinned_bytes_cached == 4 * KIB

    other_bucket = pool.acquire(5000)  # 8 KiB bucket: must not take the 4 KiB buffer
    assert other_bucket.numel() == 8 * KIB and _key(other_bucket) != first_key
    same_bucket = pool.acquire(2049)  # 4 KiB bucket: reuses it
    assert _key(same_bucket) == first_key

    stats = pool.stats()
    assert (stats.hits, stats.misses) == (1, 2)
    assert stats.pinned_bytes_cached == 0
    assert stats.pinned_bytes_in_use == 12 * KIB


def test_release_accepts_a_view_of_the_buffer() -> None:
    pool = PinnedMemoryPool(MIB, pin=False)
    buf = pool.acquire(2 * KIB)
    pool.release(buf[:100])
    assert pool.stats().buffers_in_use == 0 and pool.stats().pinned_bytes_cached == 2 * KIB


def test_past_the_cap_requests_get_pageable_memory_counted_separately() -> None:
    pool = PinnedMemoryPool(8 * KIB, pin=False, pageable_fallback=True)
    pooled = pool.acquire(8 * KIB)
    fallback = pool.acquire(100)
    assert fallback.numel() >= 100 and is_host_labelled(fallback)
    stats = pool.stats()
    assert stats.pinned_bytes_in_use == 8 * KIB  # the cap held
    assert stats.pageable_fallbacks == 1 and stats.pageable_bytes_in_use == 100
    assert stats.buffers_in_use == 2

    pool.release(fallback)
    stats = pool.stats()
    # Pageable buffers are dropped, never cached.
    assert stats.pageable_bytes_in_use == 0 and stats.pinned_bytes_cached == 0
    pool.release(pooled)
    assert pool.stats().pinned_bytes_held == 8 * KIB


def test_without_pageable_fallback_the_cap_is_a_budget_that_raises() -> None:
    pool = PinnedMemoryPool(8 * KIB, pin=False)  # the default: no pageable memory
    held = pool.acquire(6 * KIB)  # an 8 KiB bucket: the whole budget
    with pytest.raises(HostBudgetError, match="max_host_activation_mb") as info:
        pool.acquire(100)
    assert "pageable_fallback=True" in str(info.value) and "0.0078125 MiB" in str(info.value)
    stats = pool.stats()
    assert stats.pageable_fallbacks == 0 and stats.buffers_in_use == 1
    assert stats.pinned_bytes_peak == 8 * KIB  # never past the budget
    pool.release(held)
    assert pool.acquire(100).numel() == KIB  # room again: served from the pool


def test_at_the_cap_pending_releases_are_waited_for_before_raising(fake_event) -> None:
    pool = PinnedMemoryPool(8 * KIB, pin=False)
    event = fake_event()
    pool.release(pool.acquire(8 * KIB), event)  # its copy is still running
    again = pool.acquire(8 * KIB)  # no room until that copy ends: the pool waits for it
    assert event.synchronizes == 1 and again.numel() == 8 * KIB
    assert pool.stats().pinned_bytes_peak == 8 * KIB


def test_cached_buffers_are_evicted_before_falling_back_to_pageable() -> None:
    pool = PinnedMemoryPool(8 * KIB, pin=False)
    pool.release(pool.acquire(4 * KIB))
    assert pool.stats().pinned_bytes_cached == 4 * KIB
    big = pool.acquire(8 * KIB)  # needs the whole cap: the cached 4 KiB must go
    stats = pool.stats()
    assert big.numel() == 8 * KIB
    assert stats.pageable_fallbacks == 0
    assert stats.pinned_bytes_cached == 0 and stats.pinned_bytes_held == 8 * KIB


def test_zero_cap_serves_everything_pageable() -> None:
    pool = PinnedMemoryPool(0, pin=False, pageable_fallback=True)
    a, b = pool.acquire(0), pool.acquire(10)
    assert _key(a) != _key(b)
    stats = pool.stats()
    assert stats.pageable_fallbacks == 2 and stats.pinned_bytes_held == 0
    pool.release(a)
    pool.release(b)
    assert pool.stats().buffers_in_use == 0


def test_release_waits_for_its_event_before_reuse(fake_event) -> None:
    pool = PinnedMemoryPool(MIB, pin=False)
    buf = pool.acquire(KIB)
    key = _key(buf)
    event = fake_event()
    pool.release(buf, event)
    stats = pool.stats()
    assert stats.pending_releases == 1 and stats.pinned_bytes_pending == KIB
    assert stats.pinned_bytes_cached == 0

    while_pending = pool.acquire(KIB)  # the pending buffer must not be handed out
    assert _key(while_pending) != key

    event.fire()
    stats = pool.stats()
    assert stats.pending_releases == 0 and stats.pinned_bytes_pending == 0
    assert stats.pinned_bytes_cached == KIB
    assert _key(pool.acquire(KIB)) == key
    assert event.queries >= 2  # it was polled, not assumed done


def test_pageable_buffer_also_waits_for_its_event(fake_event) -> None:
    pool = PinnedMemoryPool(0, pin=False, pageable_fallback=True)
    buf = pool.acquire(64)
    event = fake_event()
    pool.release(buf, event)
    assert pool.stats().pending_releases == 1
    event.fire()
    assert pool.stats().pending_releases == 0


def test_double_release_raises_naming_the_rule(fake_event) -> None:
    pool = PinnedMemoryPool(MIB, pin=False)
    buf = pool.acquire(KIB)
    pool.release(buf)
    with pytest.raises(PoolMisuseError, match="already released"):
        pool.release(buf)
    pending = pool.acquire(KIB)
    pool.release(pending, fake_event())
    with pytest.raises(PoolMisuseError, match="already released"):
        pool.release(pending)
    # Neither failed release corrupted the counters.
    stats = pool.stats()
    assert stats.buffers_in_use == 0 and stats.pending_releases == 1


def test_releasing_a_foreign_tensor_raises() -> None:
    pool = PinnedMemoryPool(MIB, pin=False)
    with pytest.raises(PoolMisuseError, match="not handed out by this pool"):
        pool.release(torch.empty(KIB, dtype=torch.uint8))


def test_trim_frees_cached_only(fake_event) -> None:
    pool = PinnedMemoryPool(MIB, pin=False)
    kept = pool.acquire(KIB)
    pool.release(pool.acquire(4 * KIB))
    pool.release(pool.acquire(16 * KIB), fake_event())  # pending: must survive trim
    assert pool.trim() == 4 * KIB
    stats = pool.stats()
    assert stats.pinned_bytes_cached == 0
    assert stats.pinned_bytes_in_use == KIB and stats.pinned_bytes_pending == 16 * KIB
    assert stats.pinned_bytes_held == 17 * KIB
    misses = stats.misses
    pool.acquire(4 * KIB)
    assert pool.stats().misses == misses + 1  # nothing cached any more
    assert pool.owns(kept)


def test_peak_tracks_the_footprint() -> None:
    pool = PinnedMemoryPool(MIB, pin=False)
    a, b = pool.acquire(KIB), pool.acquire(2 * KIB)
    pool.release(a)
    pool.release(b)
    pool.trim()
    stats = pool.stats()
    assert stats.pinned_bytes_peak == 3 * KIB and stats.pinned_bytes_held == 0


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError, match="max_host_bytes"):
        PinnedMemoryPool(-1)
    with pytest.raises(ValueError, match="nbytes"):
        PinnedMemoryPool(MIB, pin=False).acquire(-5)


def test_default_pool_pins_exactly_when_this_process_can_pin() -> None:
    try:
        can_pin = torch.empty(8, pin_memory=True).is_pinned()
    except RuntimeError:  # the CPU build refuses to pin
        can_pin = False
    pool = PinnedMemoryPool(MIB)
    buffer = pool.acquire(KIB)
    assert buffer.is_pinned() is can_pin  # what the buffers are, not how pin was chosen
    pool.release(buffer)
    if not can_pin:
        with pytest.raises(ValueError, match="pin=True"):
            PinnedMemoryPool(MIB, pin=True)


def test_eight_threads_never_share_a_buffer_and_stats_stay_consistent() -> None:
    pool = PinnedMemoryPool(64 * KIB, pin=False, pageable_fallback=True)  # small cap: exercises fallback too
    holders: dict[int, int] = {}
    holders_lock = threading.Lock()
    errors: list[str] = []
    iterations = 300

    def worker(thread_id: int) -> None:
        rng = random.Random(thread_id)
        for i in range(iterations):
            buf = pool.acquire(rng.choice([100, 1500, 3000, 9000]))
            key = _key(buf)
            with holders_lock:
                if key in holders:
                    errors.append(f"buffer {key:#x} handed to {thread_id} while {holders[key]} holds it")
                holders[key] = thread_id
            marker = (thread_id * 31 + i) % 251
            buf.fill_(marker)
            if i % 7 == 0:
                threading.Event().wait(0.0001)
            if not bool((buf == marker).all()):
                errors.append(f"thread {thread_id}: buffer overwritten while held")
            with holders_lock:
                del holders[key]
            pool.release(buf)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    stats = pool.stats()
    assert stats.hits + stats.misses == 8 * iterations
    assert stats.buffers_in_use == 0 and stats.pending_releases == 0
    assert stats.pinned_bytes_in_use == 0 and stats.pageable_bytes_in_use == 0
    assert stats.pinned_bytes_held == stats.pinned_bytes_cached <= 64 * KIB
    assert stats.pinned_bytes_peak <= 64 * KIB
    assert stats.hits > 0


class _PinningRefusedPool(PinnedMemoryPool):
    """Simulates the accelerator refusing to pin more memory."""

    @staticmethod
    def _allocate(capacity: int, *, pin: bool) -> torch.Tensor | None:
        return None


def test_failed_pinned_allocation_falls_back_and_returns_the_reservation() -> None:
    pool = _PinningRefusedPool(MIB, pin=False)
    buf = pool.acquire(KIB)
    stats = pool.stats()
    assert buf.numel() >= KIB
    assert stats.pageable_fallbacks == 1 and stats.pinned_bytes_held == 0
    pool.release(buf)
    assert pool.stats().buffers_in_use == 0


class _DedicatedStubPool(PinnedMemoryPool):
    """Records a >2 GiB capacity without allocating it (bookkeeping under test)."""

    @staticmethod
    def _allocate(capacity: int, *, pin: bool) -> torch.Tensor | None:
        return torch.empty(1, dtype=torch.uint8)


def test_requests_above_two_gib_get_dedicated_buffers_that_are_not_cached() -> None:
    huge = MAX_BUCKET_BYTES + 1
    pool = _DedicatedStubPool(4 * MAX_BUCKET_BYTES, pin=False)
    first = pool.acquire(huge)
    assert pool.stats().pinned_bytes_in_use == huge  # exact size, no power-of-two round-up
    pool.release(first)
    stats = pool.stats()
    assert stats.pinned_bytes_cached == 0 and stats.pinned_bytes_held == 0
    pool.acquire(huge)
    assert pool.stats().misses == 2 and pool.stats().hits == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 20_000), st.integers(0, 99)), max_size=40))
def test_random_acquire_release_sequences_keep_the_books(ops) -> None:
    cap = 32 * KIB
    pool = PinnedMemoryPool(cap, pin=False, pageable_fallback=True)
    held: list[torch.Tensor] = []
    acquires = 0
    for is_acquire, nbytes, pick in ops:
        if is_acquire or not held:
            buf = pool.acquire(nbytes)
            acquires += 1
            assert buf.numel() >= nbytes
            assert all(_key(buf) != _key(other) for other in held)  # never handed out twice
            held.append(buf)
        else:
            pool.release(held.pop(pick % len(held)))
        stats = pool.stats()
        assert stats.buffers_in_use == len(held)
        in_use = stats.pinned_bytes_in_use + stats.pageable_bytes_in_use
        assert in_use == sum(b.numel() for b in held)
        assert stats.pinned_bytes_held <= cap and stats.pinned_bytes_peak <= cap
        assert stats.hits + stats.misses == acquires


# ---------------------------------------------------------------- near the cap


def test_trim_gives_its_bytes_back_to_the_cap() -> None:
    pool = PinnedMemoryPool(8 * KIB, pin=False)
    pool.release(pool.acquire(8 * KIB))
    assert pool.trim() == 8 * KIB
    again = pool.acquire(8 * KIB)  # the whole cap again: must be a pool buffer
    stats = pool.stats()
    assert stats.pageable_fallbacks == 0 and stats.pinned_bytes_in_use == 8 * KIB
    pool.release(again)


class _RefusesOncePool(PinnedMemoryPool):
    """The accelerator refuses the first pinning, then accepts."""

    refusals = 1

    def _allocate(self, capacity: int, *, pin: bool) -> torch.Tensor | None:  # type: ignore[override]
        if self.refusals:
            self.refusals -= 1
            return None
        return PinnedMemoryPool._allocate(capacity, pin=pin)


def test_a_refused_pinning_gives_its_reservation_back_near_the_cap() -> None:
    pool = _RefusesOncePool(8 * KIB, pin=False)
    first = pool.acquire(8 * KIB)  # refused: pageable, the 8 KiB reservation returned
    second = pool.acquire(8 * KIB)  # the full cap must still be available
    stats = pool.stats()
    assert stats.pageable_fallbacks == 1 and stats.pinned_bytes_in_use == 8 * KIB
    assert pool.owns(first) and pool.owns(second)


# ---------------------------------------------------------------- pinned pools (simulated)


class _SimulatedPinnedPool(PinnedMemoryPool):
    """A ``pin=True`` pool on CPU: allocations are plain host buffers (bookkeeping under
    test), and emptying torch's host cache is counted instead of done."""

    def __init__(self, max_host_bytes: int) -> None:
        self.empties = 0
        super().__init__(max_host_bytes, pin=True, pageable_fallback=True)

    @staticmethod
    def _allocate(capacity: int, *, pin: bool) -> torch.Tensor | None:
        return torch.empty(min(capacity, 1 << 20), dtype=torch.uint8)

    def _empty_host_cache(self) -> None:  # type: ignore[override]
        self.empties += 1


@pytest.fixture
def pinned_pool_cls(monkeypatch: pytest.MonkeyPatch) -> type[_SimulatedPinnedPool]:
    from hyper_offload.runtime import pinned_pool

    monkeypatch.setattr(pinned_pool, "pin_memory_available", lambda: True)
    return _SimulatedPinnedPool


def test_pinned_dedicated_buffers_count_what_torch_really_pins(pinned_pool_cls) -> None:
    huge = MAX_BUCKET_BYTES + 1  # torch's host allocator pins 2^32 for this
    pool = pinned_pool_cls(2 * pinned_cost(huge))
    assert pinned_cost(huge) == 2 * MAX_BUCKET_BYTES
    first = pool.acquire(huge)
    assert pool.stats().pinned_bytes_in_use == 2 * MAX_BUCKET_BYTES
    second = pool.acquire(huge)
    assert pool.stats().pinned_bytes_held == pool.max_host_bytes  # the cap is reached
    with pytest.warns(PageableFallbackWarning):
        small = pool.acquire(KIB)  # even 1 KiB more would pin past the cap: pageable
    assert pool.stats().pageable_fallbacks == 1
    for buffer in (first, second, small):
        pool.release(buffer)
    assert pool.stats().pinned_bytes_held == 0
    assert pool.empties == 2  # each dedicated buffer also left torch's host cache


def test_pinned_evictions_and_trim_empty_torchs_host_cache(pinned_pool_cls) -> None:
    pool = pinned_pool_cls(8 * KIB)
    pool.release(pool.acquire(4 * KIB))
    assert pool.empties == 0  # cached by the pool: still ours, still counted
    big = pool.acquire(8 * KIB)  # evicts the cached 4 KiB
    assert pool.empties == 1 and pool.stats().pageable_fallbacks == 0
    pool.release(big)
    assert pool.trim() == 8 * KIB and pool.empties == 2
    assert pool.trim() == 0 and pool.empties == 2  # nothing freed: nothing to empty


def test_a_pinned_pool_warns_once_naming_the_knob(pinned_pool_cls) -> None:
    pool = pinned_pool_cls(0)
    with pytest.warns(PageableFallbackWarning, match="OffloadConfig.max_host_activation_mb"):
        a = pool.acquire(KIB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = pool.acquire(KIB)  # counted, not warned again
    stats = pool.stats()
    assert stats.pageable_fallbacks == 2
    assert stats.summary()["pageable_fallbacks"] == 2 and "2 pageable fallback(s)" in str(stats)
    pool.release(a)
    pool.release(b)


def test_an_unpinned_pool_counts_fallbacks_without_warning() -> None:
    pool = PinnedMemoryPool(0, pin=False, pageable_fallback=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.release(pool.acquire(KIB))
    assert pool.stats().pageable_fallbacks == 1
    assert pool.stats().host_allocator_pinned_bytes is None
