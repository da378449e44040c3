"""``OffloadConfig(verify=...)`` in the eager session (issue 34): verified steps stay
exact, ``first_steps:N`` turns itself off, and a skipped wait (a planted race on the
scripted CUDA engine, where copies run only when something waits for them) raises
``TransferIntegrityError`` at the op that reads the reload, instead of silently giving
other gradients."""

from __future__ import annotations

import pytest
import torch

from hyper_offload import OffloadConfig, OffloadSession, TransferIntegrityError
from hyper_offload.config import MIB
from hyper_offload.runtime import ResidencyManager

from tests.runtime.scripted_cuda import ScriptedCudaEngine

from .models import CASES, assert_same_state, make_pair, train_step

TIGHT_MB = 24 * 1024 / MIB


def _run(session: OffloadSession, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``steps`` steps of the small transformer with and without ``session``."""
    model, ref, x = make_pair(CASES["transformer"], torch.float32, input_shape=(4, 16, 32))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, ref))
    losses, ref_losses = [], []
    for step in range(steps):
        with session:
            losses.append(train_step(model, x, opt, step))
        ref_losses.append(train_step(ref, x, ref_opt, step))
        assert_same_state(model, ref, f"step {step}")
        opt.step()
        ref_opt.step()
    return losses, ref_losses


def test_verified_steps_are_exact_and_first_steps_turns_itself_off():
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=TIGHT_MB,
                                           verify="first_steps:2"), engine=ScriptedCudaEngine())
    losses, ref_losses = _run(session, 4)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert session.verified_steps == 2 and session.steps == 4 and not session.verifying
    assert session.last_stats.transfers > 0


@pytest.mark.parametrize("verify", ["first_steps:0", "first_steps:x", "always", 1])
def test_a_malformed_verify_names_the_accepted_forms(verify):
    with pytest.raises(ValueError, match="first_steps:N"):
        OffloadConfig(verify=verify)


class _SkipsWaits(ResidencyManager):
    """A planted race: every WAIT_H2D is skipped, so an op reads a reload before its copy
    ran (the scripted copy stream runs a copy only when something waits for it)."""

    def wait_h2d(self, sid: int) -> None:
        return None


def _skipping_session(verify: bool) -> OffloadSession:
    engine = ScriptedCudaEngine()
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=TIGHT_MB, verify=verify),
                             engine=engine)
    session.manager = _SkipsWaits(session.engine, session.pool)
    return session


def test_a_skipped_wait_is_caught_with_verify_and_silent_without():
    with pytest.raises(AssertionError, match="differs"):  # no error of ours: other numbers
        _run(_skipping_session(verify=False), 2)
    with pytest.raises(TransferIntegrityError) as caught:
        _run(_skipping_session(verify=True), 2)
    error = caught.value
    assert error.check == "reload" and error.where.startswith("eager op ")
    assert str(error).startswith("eager door, op ") and "B on cpu" in str(error)
