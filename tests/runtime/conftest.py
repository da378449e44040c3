"""Shared test doubles for runtime tests on CPU.

* :class:`FakeEvent` - a completion event that stays pending until fired.
* :class:`DeferredEngine` - a CPU engine whose copies *report* completion only when
  their event fires (the bytes move immediately), so tests can observe what waits on
  what, as on an accelerator with a copy stream.
* :class:`FailingEngine` - a CPU engine whose d2h/h2d raise on demand, optionally after
  scribbling garbage into the destination (a copy that died half way).
* :class:`~scripted_cuda.ScriptedCudaEngine` (fixture ``scripted_engine``) - the real
  async engine over a scripted CUDA (streams, events, lazy copies, an allocator model
  that flags use-after-free); see ``scripted_cuda.py``.
* ``runtime`` - a :class:`TransferRuntime` made current for the whole test, and
  ``manager`` - a :class:`ResidencyManager` over the CPU engine and ``pool``: what the
  two modules of the transfer ops' tests (``test_ops*.py``) and of the residency
  manager's (``test_residency*.py``) share (a module may define its own, as
  ``test_gpu_ops.py`` and ``test_copy_stream.py`` do).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
from hyper_offload.runtime.residency import ResidencyManager
from hyper_offload.runtime.transfer import TransferEngine
from hyper_offload.runtime.transfer_context import TransferRuntime

from .doubles import (
    DeferredEngine,
    FailingEngine,
    FakeEvent,
    HalfEnqueuedEngine,
    random_tensor,
    same_bits,
)
from .scripted_cuda import ScriptedCudaEngine


@pytest.fixture
def scripted_engine() -> ScriptedCudaEngine:
    """The real async engine over a scripted CUDA (see ``scripted_cuda.py``)."""
    return ScriptedCudaEngine()


@pytest.fixture
def fake_event() -> type[FakeEvent]:
    """The :class:`FakeEvent` class; call it to make events."""
    return FakeEvent


@pytest.fixture
def pool() -> PinnedMemoryPool:
    """A small unpinned pool (CPU)."""
    return PinnedMemoryPool(1 << 24, pin=False)


@pytest.fixture
def deferred_engine() -> DeferredEngine:
    return DeferredEngine()


@pytest.fixture
def deferred_engine_cls() -> type[DeferredEngine]:
    return DeferredEngine


@pytest.fixture
def failing_engine_cls() -> type[FailingEngine]:
    return FailingEngine


@pytest.fixture
def half_enqueued_engine_cls() -> type[HalfEnqueuedEngine]:
    return HalfEnqueuedEngine


@pytest.fixture
def make_random() -> object:
    return random_tensor


@pytest.fixture
def bits_equal() -> object:
    return same_bits


@pytest.fixture
def runtime() -> Iterator[TransferRuntime]:
    """A runtime over a 64 MiB pool, current for the whole test."""
    with TransferRuntime(pool=PinnedMemoryPool(64 << 20)) as rt:
        yield rt


@pytest.fixture
def manager(pool: PinnedMemoryPool) -> ResidencyManager:
    """A residency manager over the CPU engine and ``pool``."""
    return ResidencyManager(TransferEngine("cpu"), pool)
