"""ShadowTensor: resolve, host fallback, released data, autograd."""

from __future__ import annotations

import pytest
import torch

from hyper_offload.runtime import (
    DataLostError,
    PinnedMemoryPool,
    ResidencyManager,
    TransferEngine,
)
from hyper_offload.eager.shadow_tensor import ShadowTensor


@pytest.fixture()
def manager() -> ResidencyManager:
    return ResidencyManager(TransferEngine("cpu"), PinnedMemoryPool(1 << 24))


def test_resolve_on_device_and_from_host(manager: ResidencyManager) -> None:
    x = torch.randn(4, 6)
    expected = x.clone()
    buffer = manager.bind(0, x)
    shadow = ShadowTensor(buffer)
    assert shadow.shape == x.shape and shadow.dtype == x.dtype and shadow.stride() == x.stride()
    assert torch.equal(shadow.resolve(), expected)
    assert torch.equal(shadow * 2, expected * 2) and type(shadow * 2) is torch.Tensor
    manager.copy_d2h(0)
    manager.release_device(0)
    assert x.untyped_storage().nbytes() == 0  # the shadow keeps no device bytes alive
    assert torch.equal(shadow + 0, expected)  # demand-paged from the host copy
    assert manager.is_resident(0)
    manager.reset()


def test_released_data_raises_instead_of_reading_freed_memory(manager: ResidencyManager) -> None:
    x = torch.randn(8)
    shadow = ShadowTensor(manager.bind(0, x))
    manager.release_device(0)
    with pytest.raises(DataLostError, match="both the device and the host copy"):
        shadow.sum()
    manager.reset()


def test_views_keep_their_layout(manager: ResidencyManager) -> None:
    base = torch.arange(24.0).reshape(4, 6)
    view = base[1:, 2:5].t()
    buffer = manager.bind(0, base)
    from hyper_offload.runtime.physical_buffer import TensorLayout

    shadow = ShadowTensor(buffer, TensorLayout.of(view))
    expected = view.clone()
    manager.copy_d2h(0)
    manager.release_device(0)
    assert torch.equal(shadow.resolve(), expected)
    manager.reset()


def test_survives_autograd(manager: ResidencyManager) -> None:
    """Saved for backward while offloaded, read in backward, gradients flow through."""

    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):  # type: ignore[no-untyped-def]
            ctx.save_for_backward(t)
            return t * t * t

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            (t,) = ctx.saved_tensors
            return 3 * t * t * g

    leaf = torch.randn(5, requires_grad=True)
    h = leaf * 2
    shadow = ShadowTensor.wrap(h, manager.bind(0, h))
    assert shadow.requires_grad and shadow.grad_fn is not None
    y = Cube.apply(shadow) + torch.sin(shadow)  # both save the ShadowTensor
    manager.copy_d2h(0)
    manager.release_device(0)  # offloaded between forward and backward
    y.sum().backward()
    expected_leaf = leaf.detach().clone().requires_grad_()
    h2 = expected_leaf * 2
    (Cube.apply(h2) + torch.sin(h2)).sum().backward()
    assert torch.equal(leaf.grad, expected_leaf.grad)
    manager.reset()


def test_wrap_checks_the_storage(manager: ResidencyManager) -> None:
    a, b = torch.randn(3), torch.randn(3)
    with pytest.raises(ValueError, match="not the one"):
        ShadowTensor.wrap(a, manager.bind(0, b))
    manager.reset()
