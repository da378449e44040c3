"""``verify`` in the compile door's transfer ops (issue 34): the op sequence a lowered
graph runs (``copy_d2h`` -> ``wait_transfer`` -> source freed; in the backward
``copy_h2d`` -> ``wait_transfer`` -> read -> ``release_host``), on the scripted CUDA
engine, with each copy-stream race planted. With ``verify`` each raises
:class:`TransferIntegrityError` naming the region and the copy; without it the step goes
through with other bytes than the program wrote.

In a compiled graph every reader of a reload consumes ``wait_transfer``'s *output*, so no
op can read a reload before its wait; the reload-side races are therefore a wait that
orders nothing and an event recorded before its copy, both caught at the wait's check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hyper_offload import TransferIntegrityError
from hyper_offload.runtime import PinnedMemoryPool, TransferRuntime
from hyper_offload.runtime.transfer import Transfer, TransferDirection, TransferEngine
from hyper_offload.runtime.ops import copy_d2h, copy_h2d, release_host, wait_transfer

from .scripted_cuda import JUNK, ScriptedCudaEngine

WHERE = "compile door, region 3"
SLOT = 5
NAMES = {SLOT: "of fw:gelu (slot 5)"}
Plant = Callable[[str, dict[str, torch.Tensor]], None]


class _UnwrittenEngine(ScriptedCudaEngine):
    """A reload's device bytes hold junk until its H2D runs (fresh device memory holds
    whatever was there before: deterministic here)."""

    def _enqueue_copy(self, direction: TransferDirection, src: torch.Tensor,
                      dst: torch.Tensor) -> None:
        if direction is TransferDirection.H2D:
            dst.view(torch.uint8).fill_(JUNK)
        super()._enqueue_copy(direction, src, dst)


class _EarlyEventEngine(_UnwrittenEngine):
    """Records an H2D's event before enqueueing the copy: a wait on it orders nothing."""

    def h2d(self, src_host: torch.Tensor, dst: torch.Tensor, **kwargs: Any) -> Transfer:
        self._late: list[tuple[torch.Tensor, torch.Tensor]] = []
        transfer = super().h2d(src_host, dst, **kwargs)
        for src, late_dst in self._late:
            super()._enqueue_copy(TransferDirection.H2D, src, late_dst)
        return transfer

    def _enqueue_copy(self, direction: TransferDirection, src: torch.Tensor,
                      dst: torch.Tensor) -> None:
        if direction is TransferDirection.H2D:
            dst.view(torch.uint8).fill_(JUNK)
            self._late.append((src, dst))
            return
        super()._enqueue_copy(direction, src, dst)


class _UnprotectedEngine(ScriptedCudaEngine):
    """A D2H's handle does not hold its source until a wait (neither ``record_stream``
    nor ``until_wait``): a source freed before its copy ran is read as freed memory."""

    def d2h(self, src: torch.Tensor, dst_host: torch.Tensor, **kwargs: Any) -> Transfer:
        transfer = super().d2h(src, dst_host, **kwargs)
        transfer._until_wait = None
        return transfer


def _skip_waits(direction: TransferDirection) -> Callable[[pytest.MonkeyPatch], None]:
    """Plants ``Transfer.wait`` ordering nothing for copies in ``direction``."""
    def plant(monkeypatch: pytest.MonkeyPatch) -> None:
        original = Transfer.wait

        def wait(self: Transfer, stream: Any | None = None) -> None:
            if self.direction is not direction:
                original(self, stream)

        monkeypatch.setattr(Transfer, "wait", wait)
    return plant


def _graph_step(
    engine: TransferEngine, verify: bool, plant: Plant
) -> tuple[torch.Tensor, torch.Tensor]:
    """One offloaded saved tensor through the lowered ops; returns (what the backward
    read, what the program had in the tensor when the forward let go of it)."""
    runtime = TransferRuntime(pool=PinnedMemoryPool(1 << 20, pin=False), engines=[engine],
                              verify=verify)
    src = torch.arange(1024, dtype=torch.float32)
    with runtime.keeping(frozenset(), where=WHERE, slot_names=NAMES):
        host = copy_d2h(src, None, SLOT)
        plant("issued", {"src": src, "host": host})
        wait_transfer(host, src)
    intended = src.clone()
    del src  # the graph frees the source after its wait
    device = copy_h2d(host, "cpu")
    plant("reloading", {"host": host, "device": device})
    read = wait_transfer(device, host).clone()
    release_host(host)
    return read, intended


def _write_after_copy(stage: str, tensors: dict[str, torch.Tensor]) -> None:
    if stage == "issued":
        tensors["src"].add_(1)


def _free_source_early(stage: str, tensors: dict[str, torch.Tensor]) -> None:
    if stage == "issued":  # the allocator hands the source's block to the next kernel
        storage = tensors["src"].untyped_storage()
        storage.resize_(0)
        storage.resize_(4096)
        tensors["src"].view(torch.uint8).fill_(JUNK)  # which writes it


def _reuse_host(stage: str, tensors: dict[str, torch.Tensor]) -> None:
    if stage == "reloading":  # the pool gave the host buffer to another copy
        tensors["host"].fill_(3.0)


def _nothing(stage: str, tensors: dict[str, torch.Tensor]) -> None:
    pass


# name: (engine, plant into the program, plant into the runtime, check that fails)
RACES: dict[str, tuple[Callable[[], TransferEngine], Plant, Any, str]] = {
    "a wait that is skipped": (
        _UnwrittenEngine, _nothing, _skip_waits(TransferDirection.H2D), "reload"),
    "a release before its D2H is done": (
        _UnprotectedEngine, _nothing, _skip_waits(TransferDirection.D2H), "reload"),
    "a reload read before its event": (_EarlyEventEngine, _nothing, None, "reload"),
    "a host buffer reused while its H2D is in flight": (
        ScriptedCudaEngine, _reuse_host, None, "reload"),
    "a write to the storage after its copy was issued": (
        lambda: TransferEngine("cpu"), _write_after_copy, None, "write after copy"),
}


@pytest.mark.parametrize("race", list(RACES))
def test_a_planted_race_raises_with_verify_and_is_silent_without(race, monkeypatch):
    make_engine, plant, runtime_plant, check = RACES[race]
    if runtime_plant is not None:
        runtime_plant(monkeypatch)
    read, intended = _graph_step(make_engine(), verify=False, plant=plant)
    assert not torch.equal(read, intended)  # no error, other numbers
    with pytest.raises(TransferIntegrityError) as caught:
        _graph_step(make_engine(), verify=True, plant=plant)
    error = caught.value
    assert error.check == check
    assert error.where.startswith(f"{WHERE}, copy_d2h of fw:gelu (slot 5)")
    assert "(1024,) float32 on cpu (4096 B)" in str(error) and "Fix:" in str(error)


def test_the_allocator_reusing_a_source_before_its_copy_ran_is_caught_at_the_reload(monkeypatch):
    """A free of the D2H's source before the copy read it (no record_stream, no wait):
    the copy reads reused memory; the reload check sees it."""
    _skip_waits(TransferDirection.D2H)(monkeypatch)
    read, _ = _graph_step(_UnprotectedEngine(), verify=False, plant=_free_source_early)
    assert not torch.equal(read, torch.arange(1024, dtype=torch.float32))
    with pytest.raises(TransferIntegrityError, match=r"verify \(write after copy\)"):
        _graph_step(_UnprotectedEngine(), verify=True, plant=_free_source_early)


def test_verified_copies_without_a_race_pass_and_keep_every_bit():
    """A reload's bytes are junk until its H2D ran: only a wait that really orders the
    read after the copy passes the check."""
    engine = _UnwrittenEngine()
    read, intended = _graph_step(engine, verify=True, plant=_nothing)
    assert torch.equal(read, intended)
    assert engine.sim.violations == []


def test_a_checksum_taken_while_verify_was_on_is_checked_after_it_was_turned_off():
    """``first_steps:N`` turns verify off between steps: a copy issued while it was on is
    still checked at its reload (the checksum travels with the host copy)."""
    runtime = TransferRuntime(pool=PinnedMemoryPool(1 << 20, pin=False),
                              engines=[ScriptedCudaEngine()], verify=True)
    src = torch.arange(256, dtype=torch.float32)
    with runtime:
        host = copy_d2h(src)
        wait_transfer(host, src)
    runtime.verify = False
    device = copy_h2d(host, "cpu")
    host.fill_(7.0)  # reused while the H2D is in flight
    with pytest.raises(TransferIntegrityError, match="reloaded bytes differ"):
        wait_transfer(device, host)
    assert runtime.checks == 1  # the D2H side passed


def test_a_copy_into_another_layout_is_checked_in_the_host_layout():
    """The host copy may be laid out in another dim order than its source (a channels-last
    source copied densely): the checksum follows the bytes the copy writes."""
    runtime = TransferRuntime(pool=PinnedMemoryPool(1 << 20, pin=False),
                              engines=[ScriptedCudaEngine()], verify=True)
    src = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).view(2, 3, 4, 5)
    src = src.contiguous(memory_format=torch.channels_last)
    with runtime:
        host = copy_d2h(src, [0, 1, 2, 3])
        wait_transfer(host, src)
    assert host.stride() != src.stride()
    read = wait_transfer(copy_h2d(host, "cpu"), host)
    assert torch.equal(read, src) and runtime.checks == 2


def _host_copy(runtime: TransferRuntime, src: torch.Tensor) -> torch.Tensor:
    with runtime:
        host = copy_d2h(src)
        wait_transfer(host, src)
    return host


@pytest.mark.parametrize("change", ["size", "dtype"])
def test_a_reload_that_is_another_tensor_than_what_left_is_caught(change: str):
    """``verify`` checks the reload's metadata against what the D2H read (dtype, sizes,
    conjugate and negative bits, in the host copy's layout): a host copy whose metadata
    changed between the copies reloads as another tensor with the very same bytes,
    which the checksum alone cannot see."""
    runtime = TransferRuntime(pool=PinnedMemoryPool(1 << 20, pin=False),
                              engines=[ScriptedCudaEngine()], verify=True)
    src = torch.arange(256, dtype=torch.float32)
    host = _host_copy(runtime, src)
    # the same host bytes, seen as another tensor
    host = host.view(16, 16) if change == "size" else host.view(torch.int32)
    with pytest.raises(TransferIntegrityError, match=rf"reload metadata.*{change}"):
        wait_transfer(copy_h2d(host, "cpu"), host)
    unchanged = _host_copy(runtime, src)
    assert torch.equal(wait_transfer(copy_h2d(unchanged, "cpu"), unchanged), src)
