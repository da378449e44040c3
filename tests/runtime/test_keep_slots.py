"""``TransferRuntime.keeping``: a step plan keeps chosen ``copy_d2h`` slots on the device.

The same lowered ops run either way; a kept slot must give the backward the same bits,
never a host copy, never a buffer the graph may overwrite, and count as kept, not moved.
"""

from __future__ import annotations

import torch

from hyper_offload.runtime import ops
from hyper_offload.runtime.memory_meter import is_host_labelled
from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
from hyper_offload.runtime.transfer_context import TransferRuntime
from hyper_offload.runtime.transfer_records import current_keep


def _runtime() -> TransferRuntime:
    return TransferRuntime(pool=PinnedMemoryPool(1 << 20, pin=False))


def _round_trip(src: torch.Tensor, slot: int, dim_order: list[int] | None = None):
    """copy_d2h + wait in the forward; the value after copy_h2d + wait + release."""
    host = ops.wait_transfer(ops.copy_d2h(src, dim_order, slot), src)
    return host


def _reload(host: torch.Tensor) -> torch.Tensor:
    back = ops.wait_transfer(ops.copy_h2d(host, "cpu"), host)
    ops.release_host(host, back)
    return back


def test_a_kept_slot_stays_a_device_tensor_and_a_moved_one_goes_to_the_host() -> None:
    rt = _runtime()
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    with rt.keeping(frozenset({3})):
        kept, moved = _round_trip(a, 3), _round_trip(b, 4)
    assert not is_host_labelled(kept) and rt.is_kept(kept)
    assert is_host_labelled(moved) and not rt.is_kept(moved)
    assert _reload(kept) is kept  # no transfer: the kept tensor is the reload
    assert torch.equal(_reload(kept), a) and torch.equal(_reload(moved), b)
    assert rt.bytes_kept == a.nbytes and rt.bytes_d2h == b.nbytes == rt.bytes_h2d
    assert rt.stats().extra == {"bytes_d2h": b.nbytes, "bytes_h2d": b.nbytes, "bytes_kept": a.nbytes,
                                "bytes_kept_for_host": 0}
    assert rt.transfers_pending == 0


def test_a_copy_the_host_budget_has_no_room_for_stays_on_the_device() -> None:
    # A 2 KiB host budget: the first 1.5 KiB tensor takes its whole 2 KiB bucket.
    rt = TransferRuntime(pool=PinnedMemoryPool(2048, pin=False))
    a, b = torch.randn(384), torch.randn(384)
    with rt:
        moved = _round_trip(a, 0)
        kept = _round_trip(b, 1)  # no room left: kept on the device, not past the budget
    assert is_host_labelled(moved) and not is_host_labelled(kept) and rt.is_kept(kept)
    assert rt.bytes_kept_for_host == rt.bytes_kept == b.nbytes and rt.bytes_d2h == a.nbytes
    assert rt.pool.stats().pinned_bytes_peak == 2048 and rt.pool.stats().pageable_fallbacks == 0
    assert torch.equal(_reload(moved), a) and torch.equal(_reload(kept), b)
    # With room again (the host copy died and went back to the pool), the next copy moves.
    del moved
    with rt:
        assert is_host_labelled(_round_trip(torch.randn(384), 2))


def test_a_kept_copy_is_never_the_source() -> None:
    rt = _runtime()
    src = torch.randn(8, 8)
    expected = src.clone()
    with rt.keeping(frozenset({0})):
        kept = _round_trip(src, 0)
    # copy_d2h is functional (its output aliases no input), and an inner compiler may reuse
    # a dead buffer (Inductor does): the kept copy must not care.
    assert kept.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    src.fill_(7.0)
    assert torch.equal(_reload(kept), expected)
    assert rt.bytes_kept == src.nbytes


def test_a_kept_copy_takes_the_host_layout() -> None:
    rt = _runtime()
    src = torch.randn(6, 4).t()  # strides (1, 4): not the row-major dim_order below
    with rt.keeping(frozenset({1})):
        kept = _round_trip(src, 1, dim_order=[1, 0])
    assert kept is not src and kept.stride() == (6, 1) and torch.equal(kept, src)


def test_slots_are_kept_only_inside_the_block_that_names_them() -> None:
    rt = _runtime()
    x = torch.randn(5)
    assert not current_keep(2)
    with rt.keeping(frozenset({2})):
        assert current_keep(2) and not current_keep(3)
        with rt:  # a nested plain block keeps nothing
            assert not current_keep(2)
            nested = _round_trip(x, 2)
        assert current_keep(2)
    with rt:
        outside = _round_trip(x, 2)
    assert is_host_labelled(nested) and is_host_labelled(outside)
    _reload(nested), _reload(outside)


def test_a_kept_copy_serves_a_retained_graphs_second_backward() -> None:
    rt = _runtime()
    x = torch.randn(3, 3)
    with rt.keeping(frozenset({0})):
        kept = _round_trip(x, 0)
    first, second = _reload(kept), _reload(kept)
    assert torch.equal(first, x) and torch.equal(second, x) and rt.bytes_h2d == 0
