"""The hand-written baselines of the anchor benchmark (``benchmarks/anchors.py``): what a
user writes when torch ships no ready-made method.

* :class:`HookOffloader` — the ``hook_offload`` method: a saved-tensor-hooks offloader in
  the style of torchtune's ``OffloadActivations``.
* :func:`checkpointed_model` — the ``checkpoint`` method's model: its first blocks run
  under non-reentrant ``torch.utils.checkpoint`` (:class:`Checkpointed`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["Checkpointed", "HookOffloader", "checkpointed_model"]


class HookOffloader(torch.autograd.graph.saved_tensors_hooks):
    """Offload every saved activation at pack time, bring it back at unpack time.

    Written after torchtune's ``OffloadActivations``: tensors under ``min_bytes`` and
    parameters (by storage, so ``weight.t()`` counts as a parameter) stay; everything else
    is copied to a host buffer. On CUDA the copy runs on a side stream into pinned memory;
    the device tensor is kept in a stash until the next pack makes the compute stream wait
    for the copy (so its block is not reused before the copy read it). Unpack copies back
    on the side stream and makes the compute stream wait. On CPU the "host" buffer is a
    second CPU buffer (a host-to-host copy), allocated outside any dispatch mode and
    host-labelled so that ``DeviceMemoryMeter`` does not count it as device memory.
    """

    def __init__(self, params: Iterator[nn.Parameter], min_bytes: int = 1024) -> None:
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.min_bytes = min_bytes
        self.moved = 0
        self.cuda = torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.stash: list[tuple[torch.Tensor, Any]] = []
        super().__init__(self.pack, self.unpack)

    def _drain_stash(self) -> None:
        for _, event in self.stash:
            torch.cuda.current_stream().wait_event(event)
        self.stash.clear()

    def pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or t.untyped_storage().data_ptr() in self.param_storages:
            return t
        self.moved += 2 * nbytes
        if t.device.type == "cuda":
            self._drain_stash()
            assert self.stream is not None
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            self.stash.append((t, event))
            return t.device, host
        with _disable_current_modes():  # the host buffer is not device memory
            host = torch.empty(t.shape, dtype=t.dtype)
            from hyper_offload.runtime import label_host

            label_host(host)
            host.copy_(t)
        return t.device, host

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        if device.type == "cuda":
            self._drain_stash()
            assert self.stream is not None
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                back = host.to(device, non_blocking=True)
            torch.cuda.current_stream().wait_stream(self.stream)
            back.record_stream(torch.cuda.current_stream())
            return back
        return host.clone()  # the reload allocates device memory, as on an accelerator


class Checkpointed(nn.Module):
    """Run ``inner`` under non-reentrant ``torch.utils.checkpoint`` (same parameters)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=False)


def checkpointed_model(model: nn.Module, blocks: int) -> nn.Module:
    """A copy of the GPT whose first ``blocks`` blocks run under checkpoint."""
    model = copy.deepcopy(model)
    for i in range(blocks):
        model.blocks[i] = Checkpointed(model.blocks[i])
    return model
