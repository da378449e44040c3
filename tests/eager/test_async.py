"""The session with transfers that complete later (CUDA-like, scripted on CPU), and with
transfers that fail: nothing is left in flight, no host buffer is lost."""

from __future__ import annotations

import pytest
import torch

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.config import MIB
from hyper_offload.runtime import TransferFailedError

from tests.runtime import doubles

from .models import CASES, assert_same_state, make_pair, train_step


TIGHT = OffloadConfig(max_resident_activation_mb=24 * 1024 / MIB)


def _idle(session: OffloadSession) -> None:
    stats = session.pool.stats()
    assert stats.buffers_in_use == 0 and stats.pinned_bytes_in_use == 0
    assert len(session.manager) == 0 and session.manager.transfers_in_flight() == 0


def test_replay_with_transfers_in_flight() -> None:
    engine = doubles.DeferredEngine(records_streams=True, stream_waits=True)
    session = OffloadSession(TIGHT, engine=engine)
    model, ref, x = make_pair(CASES["transformer"], torch.float32, input_shape=(4, 16, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    for step in range(3):
        with session:
            loss = train_step(model, x, opt, step)
        assert not engine.in_flight(), "a transfer outlived its step"
        assert torch.equal(loss, train_step(ref, x, ref_opt, step))
        assert_same_state(model, ref, f"deferred engine, step {step}")
        _idle(session)
        opt.step()
        ref_opt.step()
    assert session.last_stats.transfers > 0 and len(engine.log) > 0


@pytest.mark.parametrize("phase", ["warmup", "replay"])
def test_exception_syncs_transfers(phase: str) -> None:
    engine = doubles.DeferredEngine(records_streams=True, stream_waits=True)
    session = OffloadSession(TIGHT, engine=engine)
    model, _, x = make_pair(CASES["mlp"], torch.float32, input_shape=(128, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    armed = [False]

    def fail(*_: object) -> None:
        if armed[0]:
            raise KeyError("boom")

    model.layers[1].register_full_backward_hook(fail)
    if phase == "replay":
        with session:
            train_step(model, x, opt, 0)
    armed[0] = True
    with pytest.raises(KeyError, match="boom"):
        with session:
            train_step(model, x, opt, 1)
    assert not engine.in_flight() and engine.engine_syncs > 0
    _idle(session)


def test_failed_transfer_propagates_and_cleans_up() -> None:
    engine = doubles.FailingEngine()
    session = OffloadSession(TIGHT, engine=engine)
    model, ref, x = make_pair(CASES["mlp"], torch.float32, input_shape=(128, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with session:
        train_step(model, x, opt, 0)
    engine.fail_on = {"h2d"}
    with pytest.raises(TransferFailedError) as info:
        with session:
            train_step(model, x, opt, 1)
    # The original error propagates; the failed page-back during cleanup is a note on it.
    notes = getattr(info.value, "__notes__", [])
    assert any("DataLostError" in note for note in notes), notes
    _idle(session)
    engine.fail_on = set()
    session.reset()
    for step in range(2):
        with session:
            loss = train_step(model, x, opt, step)
        assert torch.equal(loss, train_step(ref, x, torch.optim.SGD(ref.parameters(), lr=0.0), step))
