"""The session settles before it plans, accumulates gradients per micro-step, and lets the
step's own error propagate (issue 42, items 1 and 2).

Real loops run other ops on their first step or two (optimizer state, DDP's bucket
rebuild, pipeline stage setup). The session re-warms by itself until a replayed step runs
the ops its warmup recorded (``OffloadConfig.max_warmups``, default 3), then is strict.
Creating a ``.grad`` (``detach``) and accumulating into one (``add_``) are one virtual op,
so an accumulation loop with one ``with session:`` per micro-step replays.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.compiler import autograd_saved_device_bytes
from hyper_offload.config import MIB
from hyper_offload.eager import OffloadSessionError, ReplayMismatchError
from hyper_offload.eager.executor_base import ACCUMULATE_GRAD

from .models import CASES, assert_same_state, make_pair, train_step

SLACK = 256 * 1024
BUDGET_MB = 16 * 1024 / MIB


def test_the_session_settles_by_itself_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """``opt.step()`` inside the session: its first call creates the optimizer state, so
    step 1 runs other ops than step 0. No option needed: step 1 re-warms, step 2 replays
    and the session has settled after 2 warmups (in ``last_stats`` and the log)."""
    model, ref, x = make_pair(CASES["mlp"], torch.float32, input_shape=(128, 32))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=BUDGET_MB))
    seen = []
    with caplog.at_level(logging.INFO, logger="hyper_offload"):
        for step in range(4):
            with session:
                loss = train_step(model, x, opt, step)
                opt.step()
            ref_loss = train_step(ref, x, ref_opt, step)
            ref_opt.step()
            assert torch.equal(loss, ref_loss)
            assert_same_state(model, ref, f"step {step}")
            stats = session.last_stats
            seen.append((stats.phase, stats.warmups, stats.settled))
    assert seen == [("warmup", 1, False), ("warmup", 2, False), ("replay", 2, True),
                    ("replay", 2, True)]
    assert session.rewarms == 1 and session.settled
    messages = [r.getMessage() for r in caplog.records]
    assert any("re-warming (warmup 2" in m and "replay op" in m for m in messages), messages
    assert any("settled after 2 warmup step(s)" in m for m in messages), messages


class Alternating(nn.Module):
    """Runs another branch every step: never settles."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.lin(x)
        return (h.tanh() if self.calls % 2 else h.sigmoid()).sum()


def test_it_gives_up_after_max_warmups_and_raises_the_mismatch() -> None:
    model, x = Alternating(), torch.randn(8, 16)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=BUDGET_MB))
    for number in range(1, 4):
        with session:
            model(x).backward()
        assert (session.last_stats.phase, session.warmups) == ("warmup", number)
        model.zero_grad(set_to_none=True)
    with pytest.raises(ReplayMismatchError) as info:
        with session:
            model(x).backward()
    assert "replay op" in str(info.value)
    assert any("ran 3 warmup step(s)" in note and "max_warmups=3" in note
               for note in info.value.__notes__)
    assert not session.settled and session.pool.stats().buffers_in_use == 0


def test_a_settled_session_is_strict() -> None:
    model, x = Alternating(), torch.randn(8, 16)
    model.calls = 1  # sigmoid, sigmoid, ... by hand below
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=BUDGET_MB))
    for _ in range(2):
        with session:
            model(x).backward()
        model.calls = 1
    assert session.settled and session.warmups == 1
    model.calls = 0  # tanh
    with pytest.raises(ReplayMismatchError):
        with session:
            model(x).backward()


def _profiled(x: torch.Tensor, w: torch.Tensor, branch: bool) -> torch.Tensor:
    with torch.autograd.profiler.record_function("block"):  # as DDP's forward
        h = x @ w
        if branch:
            h = h.tanh()
        return h.sum()


def test_the_error_raised_is_the_original_not_one_raised_while_unwinding() -> None:
    """A mismatch inside ``record_function``: leaving it runs ``_record_function_exit``,
    an op; the session used to raise a second mismatch there, in place of the first."""
    x, w = torch.randn(8, 16), torch.randn(16, 16, requires_grad=True)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=BUDGET_MB, max_warmups=1))
    with session:
        _profiled(x, w, False).backward()
    with pytest.raises(ReplayMismatchError) as info:
        with session:
            _profiled(x, w, True).backward()
    assert "aten.tanh.default" in str(info.value)
    assert "record_function" not in str(info.value) and info.value.__context__ is None


def _indexed(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    with torch.autograd.profiler.record_function("block"):
        return (x @ w)[index].sum()


def test_a_kernel_error_in_a_replay_propagates_itself() -> None:
    """The same ops, but the index kernel raises: the unwinding's ``_record_function_exit``
    (no op the plan expects there) must not replace the IndexError."""
    x, w = torch.randn(8, 16), torch.randn(16, 16, requires_grad=True)
    good, bad = torch.tensor([1]), torch.tensor([99])
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=BUDGET_MB, max_warmups=1))
    for _ in range(2):
        with session:
            _indexed(x, w, good).backward()
    with pytest.raises(IndexError):
        with session:
            _indexed(x, w, bad).backward()
    assert session.pool.stats().buffers_in_use == 0
    with session:  # the plan is intact
        _indexed(x, w, good).backward()
    assert session.last_stats.phase == "replay"


def test_a_step_that_goes_on_after_its_error_is_refused_at_its_end() -> None:
    x, w = torch.randn(8, 16), torch.randn(16, 16, requires_grad=True)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=BUDGET_MB, max_warmups=1))
    with session:
        _profiled(x, w, False).backward()
    with pytest.raises(OffloadSessionError, match="raised ReplayMismatchError.*went on"):
        with session:
            try:
                _profiled(x, w, True).backward()
            except ReplayMismatchError:
                pass  # swallowed: the rest of the step was not replayed


# ----------------------------------------------------------------- gradient accumulation

MICRO_STEPS = 4


def _accumulate(model: nn.Module, xs: list[torch.Tensor], session: OffloadSession | None,
                saved: list[int]) -> list[torch.Tensor]:
    """One optimizer step's micro-steps, each in its own ``with session:`` (HF-style)."""
    losses = []
    for x in xs:
        with session if session is not None else _Null():
            loss = model(x) / len(xs)
            saved.append(autograd_saved_device_bytes(loss, exclude=[*model.parameters(), x]))
            loss.backward()
        losses.append(loss.detach())
    return losses


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("max_warmups", [1, 3])
def test_gradient_accumulation_per_micro_step_replays_exactly_within_the_budget(max_warmups):
    """Micro-step 1 creates every ``.grad``, 2-4 accumulate: one op sequence. Exact at
    every micro-step, within half the plain saved bytes, one warmup (also strict)."""
    model, ref, _ = make_pair(CASES["transformer"], torch.float32)
    torch.manual_seed(5)
    xs = [torch.randn(4, 16, 32) for _ in range(MICRO_STEPS)]
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    plain_saved: list[int] = []
    torch.manual_seed(7)
    plain_probe = copy.deepcopy(ref)
    _accumulate(plain_probe, xs, None, plain_saved)
    budget = max(plain_saved) // 2
    config = OffloadConfig(max_resident_activation_mb=budget / MIB, max_warmups=max_warmups)
    session = OffloadSession(config)
    for step in range(3):
        saved: list[int] = []
        torch.manual_seed(100 + step)
        losses = _accumulate(model, xs, session, saved)
        torch.manual_seed(100 + step)
        ref_losses = _accumulate(ref, xs, None, [])
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses)), f"step {step}"
        assert_same_state(model, ref, f"step {step}")
        if step:
            assert all(s <= budget + SLACK for s in saved), (saved, budget)
        assert session.last_stats.bytes_d2h > 0
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert session.warmups == 1 and session.rewarms == 0 and session.settled
    names = [op.name for op in session.trace.ops]
    params = len(list(model.parameters()))
    assert names.count(ACCUMULATE_GRAD) == params


def test_accumulating_into_a_grad_created_in_the_same_step_is_a_write() -> None:
    """Two backward passes in one step (pipelining's micro-batches): the second ``add_``s
    into the ``.grad`` the first created in the step. A READ there would let the plan
    reload a stale host copy of it (measured: wrong gradients under 1F1B)."""
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    xs = [torch.randn(32, 64) for _ in range(2)]

    def step() -> torch.Tensor:
        for x in xs:
            h = torch.tanh(x @ w)
            (h * h).sum().backward()
            for _ in range(6):  # a gap between the two accumulations
                x = torch.sin(x) * 2
        return w.grad.clone()

    plain = step()
    w.grad = None
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    for _ in range(3):
        with session:
            got = step()
        assert torch.equal(got, plain)
        w.grad = None
    created, accumulated = [op for op in session.trace.ops if op.name == ACCUMULATE_GRAD]
    (grad,) = created.storages
    assert dict(accumulated.accesses)[grad].value == "W"


@pytest.mark.parametrize("value", [0, True, 1.5, -2])
def test_max_warmups_is_a_whole_number_of_steps_from_one(value):
    with pytest.raises(ValueError, match="max_warmups"):
        OffloadConfig(max_warmups=value)


def test_reset_starts_settling_again() -> None:
    model, x = Alternating(), torch.randn(8, 16)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=BUDGET_MB))
    for _ in range(2):
        model.calls = 1
        with session:
            model(x).backward()
    assert session.settled
    session.reset()
    assert (session.settled, session.warmups) == (False, 0)
    model.calls = 1
    with session:
        model(x).backward()
    model.calls = 0  # another branch: re-warms by itself again
    with session:
        model(x).backward()
    assert session.warmups == 2 and not session.settled
