"""Real kernels of every ``hyper_offload`` op, and Python entry points of the transfer ops.

The ops themselves (schemas, op handles, ``dense_layout``, fake kernels, autograd,
functionalization, ordered effects) are declared in :mod:`hyper_offload.passes.ir.ops`,
which imports nothing of the library so that the pure passes can use them; its docstring
shows the IR the lowering emits. This module adds what runs: one real kernel per op on
``REAL_KERNEL_KEY`` (``CompositeExplicitAutograd``). A transfer op's kernel is a one-liner
into a :class:`~hyper_offload.runtime.transfer_context.TransferRuntime`, which owns
engines, pool and every rule: ``copy_d2h`` uses the current runtime, the others the
runtime that made their tensors (``runtime_of``), so a backward needs no runtime block.
The disk tier's ops go to the runtime's :class:`~.disk_ops.DiskTransfers` (the handle's
or the host copy's runtime). The recompute barriers need no runtime: ``materialize``
clones, ``discard`` returns an empty tensor.

Invariant: importing this module registers the real kernels (replacing the declarations'
placeholders, which raise "import hyper_offload.runtime.ops") and does nothing else. Any
code that *runs* a graph holding transfer ops imports it first: the compile backend does.
The op handles are re-exported, so ``from hyper_offload.runtime.ops import COPY_D2H``
keeps working for runtime-side code.
"""

from __future__ import annotations

import torch

from hyper_offload.passes.ir import ops as declarations
from hyper_offload.errors import TransferMisuseError
from hyper_offload.passes.ir.ops import (
    COPY_D2H,
    COPY_H2D,
    DISK_OPS,
    LOAD_FROM_DISK,
    NAMESPACE,
    REAL_KERNEL_KEY,
    RELEASE_DISK,
    RELEASE_HOST,
    SPILL_TO_DISK,
    TRANSFER_OPS,
    WAIT_TRANSFER,
    dense_layout,
    dim_order_of,
    host_layout,
)

from .disk_ops import DiskTransfers
from .transfer_context import current_transfer_runtime, runtime_of
from .transfer_records import current_keep

__all__ = [
    "COPY_D2H",
    "COPY_H2D",
    "DISK_OPS",
    "LOAD_FROM_DISK",
    "NAMESPACE",
    "RELEASE_DISK",
    "RELEASE_HOST",
    "SPILL_TO_DISK",
    "TRANSFER_OPS",
    "WAIT_TRANSFER",
    "copy_d2h",
    "copy_h2d",
    "dense_layout",
    "dim_order_of",
    "host_layout",
    "release_host",
    "wait_transfer",
]


# ---------------------------------------------------------------- real kernels


def _copy_d2h_kernel(
    src: torch.Tensor, dim_order: list[int] | None = None, slot: int = -1
) -> torch.Tensor:
    runtime = current_transfer_runtime("hyper_offload::copy_d2h")
    # Kept: the step plan says so, or the host budget has no room (a plan made without
    # it, such as the step scope's first, floor step): a device copy, exact either way.
    if current_keep(slot) or runtime.host_full(src):
        return runtime.keep_on_device(src, *host_layout(src, dim_order))
    return runtime.copy_d2h(src, *host_layout(src, dim_order), slot)


def _copy_h2d_kernel(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    runtime = runtime_of("hyper_offload::copy_h2d", host)
    return runtime.copy_h2d(host, device, *dense_layout(host))


def _wait_transfer_kernel(
    tensor: torch.Tensor, keepalive: torch.Tensor | None = None
) -> torch.Tensor:
    runtime_of("hyper_offload::wait_transfer", tensor, keepalive).wait_transfer(tensor, keepalive)
    return tensor


def _release_host_kernel(host: torch.Tensor, after: torch.Tensor | None = None) -> None:
    runtime_of("hyper_offload::release_host", host).release_host(host)


def _disk(op: str, tensor: torch.Tensor) -> DiskTransfers:
    runtime = runtime_of(op, tensor)
    if runtime.disk is None:
        raise TransferMisuseError(
            f"{op}: the TransferRuntime that made this tensor has no disk tier. Rule: a "
            "graph that spills runs with a runtime made with disk=DiskStore(...). Fix: "
            "compile with OffloadConfig.max_disk_activation_mb and disk_dir")
    return runtime.disk


def _spill_to_disk_kernel(host: torch.Tensor) -> torch.Tensor:
    return _disk("hyper_offload::spill_to_disk", host).spill(host)


def _load_from_disk_kernel(
    handle: torch.Tensor, size: list[int], stride: list[int], dtype: torch.dtype
) -> torch.Tensor:
    return _disk("hyper_offload::load_from_disk", handle).load(handle, size, stride, dtype)


def _release_disk_kernel(handle: torch.Tensor, after: torch.Tensor | None = None) -> None:
    _disk("hyper_offload::release_disk", handle).release(handle)


def _hold_kernel(tensors: list[torch.Tensor]) -> None:
    return None  # its arguments lived until here: all it is for


def _materialize_kernel(value: torch.Tensor) -> torch.Tensor:
    return value.clone()


def _discard_kernel(value: torch.Tensor) -> torch.Tensor:
    return value.new_empty(0)


# The placeholders go first: registering over them would be an in-place override, which
# the dispatcher reports with a process-wide, once-only warning.
declarations.drop_placeholder_kernels()
# IMPL, not FRAGMENT: this library defines nothing, it only adds kernels to the ops
# the declarations defined (and torch refuses a definition here, should one creep in).
_IMPL = torch.library.Library(NAMESPACE, "IMPL")
_IMPL.impl("copy_d2h", _copy_d2h_kernel, REAL_KERNEL_KEY)
_IMPL.impl("copy_h2d", _copy_h2d_kernel, REAL_KERNEL_KEY)
_IMPL.impl("wait_transfer", _wait_transfer_kernel, REAL_KERNEL_KEY)
_IMPL.impl("release_host", _release_host_kernel, REAL_KERNEL_KEY)
_IMPL.impl("spill_to_disk", _spill_to_disk_kernel, REAL_KERNEL_KEY)
_IMPL.impl("load_from_disk", _load_from_disk_kernel, REAL_KERNEL_KEY)
_IMPL.impl("release_disk", _release_disk_kernel, REAL_KERNEL_KEY)
_IMPL.impl("hold", _hold_kernel, REAL_KERNEL_KEY)
_IMPL.impl("materialize", _materialize_kernel, REAL_KERNEL_KEY)
_IMPL.impl("discard", _discard_kernel, REAL_KERNEL_KEY)


# ---------------------------------------------------------------- Python entry points


def copy_d2h(
    src: torch.Tensor, dim_order: list[int] | None = None, slot: int = -1
) -> torch.Tensor:
    """Start copying ``src`` into a host buffer from the current runtime's pool, laid out
    densely in ``dim_order`` (default: ``src``'s own dense layout); a ``slot`` the current
    block keeps (``TransferRuntime.keeping``) gets a device copy instead."""
    return COPY_D2H(src, dim_order, slot)


def copy_h2d(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Start copying host copy ``host`` into a fresh tensor on ``device``."""
    return COPY_H2D(host, torch.device(device))


def wait_transfer(tensor: torch.Tensor, keepalive: torch.Tensor | None = None) -> torch.Tensor:
    """Order compute after the transfer into ``tensor``; use the returned tensor."""
    return WAIT_TRANSFER(tensor, keepalive)


def release_host(host: torch.Tensor, after: torch.Tensor | None = None) -> None:
    """Return host copy ``host`` to the pool once every copy touching it has completed."""
    RELEASE_HOST(host, after)
