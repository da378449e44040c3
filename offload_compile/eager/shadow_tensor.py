"""``ShadowTensor``: a tensor that names a managed storage instead of holding its bytes.

Design section 4.3. A ``ShadowTensor`` is a wrapper subclass (``_make_wrapper_subclass``:
metadata only, no storage of its own) holding a :class:`PhysicalBuffer` and the layout
of the tensor it stands for. Whenever an op needs it, :meth:`ShadowTensor.resolve` builds
a fresh view over :meth:`PhysicalBuffer.device_storage`:

* bytes on the device: a view, after waiting for a pending H2D;
* bytes only on the host: demand-paged back synchronously (the fallback path);
* both copies released: :class:`~hyper_offload.runtime.DataLostError`, never a read of
  freed memory.

The resolved view is dropped when the op returns, so a ShadowTensor never keeps device
bytes alive: ``release_device`` really frees them while ShadowTensors exist.

Autograd. :meth:`ShadowTensor.wrap` is differentiable (an autograd Function whose
backward passes the gradient through), a ShadowTensor can be saved for backward by any
op or custom Function (autograd stores the ShadowTensor object, which resolves again
when backward reads it), and ops on it return plain tensors with ordinary ``grad_fn``s.

Who holds what, and how this relates to the eager session: the ``ResidencyManager``
owns the ``PhysicalBuffer``s; a ShadowTensor only references one. The
``OffloadSession`` does *not* wrap every activation: its storages are freed and reloaded
in place (``resize_``), which already keeps every plain tensor, view and autograd saved
tensor valid, and its dispatch mode checks residency before any op reads one. A
ShadowTensor is the handle for code that must read a managed storage *outside* that
dispatch mode (a hook, another thread, a later step), where only the resolve-on-use
check stands between a read and a 0-byte storage.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from hyper_offload.errors import ConfigurationError
from hyper_offload.runtime.physical_buffer import PhysicalBuffer, TensorLayout

__all__ = ["ShadowTensor"]


class ShadowTensor(torch.Tensor):
    """A tensor resolved from a :class:`PhysicalBuffer` on every use (module docstring)."""

    buffer: PhysicalBuffer
    layout_of_view: TensorLayout

    @staticmethod
    def __new__(
        cls, buffer: PhysicalBuffer, layout: TensorLayout | None = None, *, requires_grad: bool = False
    ) -> ShadowTensor:
        view = layout if layout is not None else buffer.layout
        shadow = torch.Tensor._make_wrapper_subclass(
            cls,
            view.size,
            strides=view.stride,
            storage_offset=view.storage_offset,
            dtype=view.dtype,
            device=buffer.device,
            requires_grad=requires_grad,
        )
        shadow.buffer = buffer
        shadow.layout_of_view = view
        return shadow

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # metadata set in __new__
        super().__init__()

    @classmethod
    def wrap(cls, tensor: torch.Tensor, buffer: PhysicalBuffer) -> ShadowTensor:
        """A ShadowTensor for ``tensor`` (whose storage ``buffer`` manages), connected to
        ``tensor``'s autograd graph."""
        if tensor.untyped_storage()._cdata != buffer.storage._cdata:
            raise ConfigurationError(
                f"ShadowTensor.wrap: the tensor's storage is not the one {buffer!r} manages; "
                "bind the tensor's storage first (ResidencyManager.bind) and pass its buffer"
            )
        return _ToShadow.apply(tensor, buffer)

    def resolve(self) -> torch.Tensor:
        """A plain view over the device-resident bytes (paged back if needed)."""
        storage = self.buffer.device_storage()
        view = self.layout_of_view
        return torch.empty(0, dtype=view.dtype, device=self.buffer.device).set_(
            storage, view.storage_offset, view.size, view.stride
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"ShadowTensor({self.buffer!r}, size={tuple(self.shape)}, dtype={self.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return [], (self.buffer, self.layout_of_view)

    @staticmethod
    def __tensor_unflatten__(inner: Any, meta: Any, outer_size: Any, outer_stride: Any) -> ShadowTensor:
        buffer, layout = meta
        return ShadowTensor(buffer, layout)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        resolve = lambda t: t.resolve()  # noqa: E731
        args, kwargs = tree_map_only(ShadowTensor, resolve, (args, kwargs or {}))
        return func(*args, **kwargs)


class _ToShadow(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, buffer: PhysicalBuffer) -> ShadowTensor:
        return ShadowTensor(buffer, TensorLayout.of(tensor))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
