"""``verify`` on the pipeline swap steps (issue 34): per-storage swaps (the four SWAP_*
steps, through the residency manager) and packed swaps (``group_swap=True``). A host
buffer reused while its load is in flight, or a write to a storage after its offload was
launched, raises :class:`TransferIntegrityError` naming the swap step; without verify the
gradients silently differ. ``"first_steps:N"`` checks N generations.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hyper_offload import TransferIntegrityError
from hyper_offload.passes.pipeline import MetaStep, StepKind
from hyper_offload.pipeline import swap_wrapper
from hyper_offload.runtime.transfer import TransferEngine
from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
from hyper_offload.runtime.pipeline import PipelineSwapSession
from hyper_offload.runtime.pipeline.packed_copy import PackedCopy

from ..scripted_cuda import ScriptedCudaEngine
from .test_swap_session import MICRO, Net, _order, _run

Plant = Callable[[PipelineSwapSession, MetaStep], None]


def _reuse_loading_hosts(session: PipelineSwapSession, step: MetaStep) -> None:
    """After a SWAP_LAUNCH_LOAD: the pool hands the loading host buffers to another copy."""
    if step.kind is StepKind.SWAP_LAUNCH_LOAD and step.micro == 1:
        for buffer in session.manager._buffers.values():
            loading = buffer.device_event is not None and not buffer.device_event.query()
            if buffer.host_buffer is not None and loading:
                assert buffer.host_event is not None
                buffer.host_event.synchronize()  # the D2H filled it; the H2D is queued
                buffer.host_buffer.fill_(0x5A)


def _write_after_offload(session: PipelineSwapSession, step: MetaStep) -> None:
    """After a SWAP_LAUNCH_OFFLOAD: the program writes a storage the copy is reading."""
    if step.kind is StepKind.SWAP_LAUNCH_OFFLOAD and step.micro == 1:
        group = session.group((0, 1))
        assert group is not None
        sid = next(member.sid for member in group._members.values() if member.bound)
        session.manager.buffer(sid).device_tensor().view(torch.uint8).add_(1)


class _Planting(PipelineSwapSession):
    """Runs ``plant`` right after each swap step."""

    def __init__(self, plant: Plant, **kwargs: object) -> None:
        super().__init__(_order(), device="cpu", **kwargs)  # type: ignore[arg-type]
        self.plant = plant

    def run_swap_step(self, step: MetaStep) -> None:
        super().run_swap_step(step)
        self.plant(self, step)


def _step(plant: Plant, engine: TransferEngine, verify: bool) -> dict[str, torch.Tensor]:
    xs = [torch.randn(16, 8, generator=torch.Generator().manual_seed(m)) for m in range(MICRO)]
    session = _Planting(plant, engine=engine, verify=verify)
    session.begin()
    try:
        return _run(_order(), swap_wrapper(Net()), session, xs)
    finally:
        session.abort()


def _reference() -> dict[str, torch.Tensor]:
    xs = [torch.randn(16, 8, generator=torch.Generator().manual_seed(m)) for m in range(MICRO)]
    return _run(_order(), Net(), None, xs)


def _assert_names_the_step(
    error: TransferIntegrityError, check: str, step: str, group: str
) -> None:
    assert error.check == check
    assert error.where.startswith("pipeline swap, ") and step in error.where
    assert error.where.endswith(f" of {group}") and "Fix:" in str(error)


def test_a_host_buffer_reused_while_its_load_is_in_flight_raises_with_verify():
    reference = _reference()
    silent = _step(_reuse_loading_hosts, ScriptedCudaEngine(), verify=False)
    assert not all(torch.equal(silent[k], reference[k]) for k in reference)  # other numbers
    with pytest.raises(TransferIntegrityError) as caught:
        _step(_reuse_loading_hosts, ScriptedCudaEngine(), verify=True)
    # the buffers loading when the plant ran were micro-batch 0's (the backward goes 0, 1, ...)
    _assert_names_the_step(caught.value, "reload", "SWAP_WAIT_LOAD", "pp_swap_run1_s0_m0")


def test_a_write_after_the_offload_was_launched_raises_with_verify():
    """The copy had read the bytes before the write (a synchronous engine): without
    verify the backward reads the old bytes, so the gradients are those of a run in
    which the write never happened (the program's write is silently lost)."""
    silent = _step(_write_after_offload, TransferEngine("cpu"), verify=False)
    reference = _reference()
    assert all(torch.equal(silent[k], reference[k]) for k in reference)
    with pytest.raises(TransferIntegrityError) as caught:
        _step(_write_after_offload, TransferEngine("cpu"), verify=True)
    _assert_names_the_step(caught.value, "write after copy", "SWAP_WAIT_OFFLOAD",
                           "pp_swap_run1_s0_m1")


def test_verified_swaps_without_a_race_are_exact_and_first_steps_turns_itself_off():
    reference = _reference()
    xs = [torch.randn(16, 8, generator=torch.Generator().manual_seed(m)) for m in range(MICRO)]
    session = PipelineSwapSession(_order(), device="cpu", engine=ScriptedCudaEngine(),
                                  verify="first_steps:1")
    net = swap_wrapper(Net())
    for generation in (1, 2):
        net.zero_grad(set_to_none=True)
        session.begin()
        assert session.manager.verify is (generation == 1)
        grads = _run(_order(), net, session, xs)
        session.end()
        assert all(torch.equal(grads[k], reference[k]) for k in reference)
    assert session.verified_steps == 1


def _packed_round_trip(verify: bool) -> torch.Tensor:
    engine = ScriptedCudaEngine()
    tensor = torch.arange(512, dtype=torch.float32)
    packed = PackedCopy("pp_swap_run1_s0_m2[activations]", [tensor.untyped_storage()], engine,
                        PinnedMemoryPool(1 << 20, pin=False), torch.device("cpu"), verify=verify)
    packed.launch_offload()
    packed.wait_offload()
    engine.sim.run_all()  # the D2H filled the host buffer
    packed.launch_load()
    assert packed._host is not None
    packed._host.fill_(9)  # the planted race: the pool reused the buffer mid-H2D
    packed.wait_load()
    return tensor


def test_a_packed_swap_checks_its_reload_too():
    assert not torch.equal(_packed_round_trip(verify=False), torch.arange(512, dtype=torch.float32))
    with pytest.raises(TransferIntegrityError, match=r"verify \(reload\): pp_swap_run1_s0_m2"):
        _packed_round_trip(verify=True)
