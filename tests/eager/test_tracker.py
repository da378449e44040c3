"""ActivationTracker: storage identity and lifetime."""

from __future__ import annotations

import gc

import pytest
import torch

from hyper_offload.eager.dispatch_mode import ActivationTracker


def test_ids_are_dense_and_views_share_them() -> None:
    tracker = ActivationTracker()
    a, b = torch.randn(4, 4), torch.randn(8)
    assert tracker.adopt(a.untyped_storage(), producer=0) == 0
    assert tracker.adopt(b.untyped_storage(), producer=1) == 1
    assert tracker.sid_of(a.t().untyped_storage()) == 0  # a view: same storage, same id
    assert tracker.sid_of(torch.randn(2).untyped_storage()) is None  # never adopted
    assert tracker.entry(1).producer == 1 and tracker.sizes() == {0: 64, 1: 32}
    with pytest.raises(ValueError, match="already tracked"):
        tracker.adopt(a.untyped_storage(), producer=2)


def test_death_is_reported_and_an_address_is_never_inherited() -> None:
    freed: list[int] = []
    tracker = ActivationTracker(on_free=freed.append)
    x = torch.randn(1024)
    key = x.untyped_storage()._cdata
    tracker.adopt(x.untyped_storage(), producer=0)
    assert tracker.referenced_elsewhere(0)
    del x
    gc.collect()
    assert freed == [0] and not tracker.entry(0).alive and tracker.storage(0) is None
    assert not tracker.referenced_elsewhere(0)
    # Allocate until one storage reuses the freed address: it is not storage 0.
    for _ in range(64):
        y = torch.randn(1024)
        if y.untyped_storage()._cdata == key:
            assert tracker.sid_of(y.untyped_storage()) is None
            break


def test_referenced_elsewhere_counts_tensors_not_python_references() -> None:
    tracker = ActivationTracker()
    x = torch.randn(16)
    storage = x.untyped_storage()
    tracker.adopt(storage, producer=0)
    del x  # only the storage object is left
    assert tracker.storage(0) is storage and not tracker.referenced_elsewhere(0)


def test_continuing_another_executors_ids() -> None:
    tracker = ActivationTracker()
    x = torch.randn(4)
    tracker.add_dead(3, 128, producer=1)
    tracker.adopt_as(x.untyped_storage(), 5, 16, producer=2)
    assert tracker.adopt(torch.randn(2).untyped_storage(), producer=3) == 6
    assert tracker.sizes()[3] == 128 and not tracker.entry(3).alive
    with pytest.raises(ValueError, match="already in use"):
        tracker.add_dead(5, 1, producer=0)
    tracker.clear()
    assert len(tracker) == 0 and tracker.sid_of(x.untyped_storage()) is None
