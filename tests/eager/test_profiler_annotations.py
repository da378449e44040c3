"""Profiler annotations are no part of a step (issue 51: Lightning's automatic
optimization in the eager door).

``torch.profiler.record_function`` enters and exits through ops
(``profiler::_record_function_enter_new`` / ``_record_function_exit``) that the session's
dispatch mode sees. ``Optimizer.zero_grad`` and ``Optimizer.step`` each record one, so
under gradient accumulation only some micro-batches run them, between the same compute:
Lightning calls ``zero_grad`` between a batch's forward and backward on the first batch
of each accumulation window only. Traced, they made every other micro-batch another op
sequence (``ReplayMismatchError`` after ``max_warmups`` warmups that never agreed);
untraced, the session settles after its first warmup and replays exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from hyper_offload import OffloadConfig, OffloadSession

BUDGET_MB = 0.5  # the step peaks at 656,900 B without offload, its floor 459,784 B
MICRO_BATCHES = 6


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                         nn.Linear(128, 1))


def _accumulate(session: OffloadSession | None) -> list[torch.Tensor]:
    """Micro-batches of 2-step accumulation, ``zero_grad`` (a profiler annotation) between
    forward and backward of each window's first micro-batch, and a ``record_function``
    of the user's own around every third; each micro-batch is one session step."""
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))
    seen = []
    for micro in range(MICRO_BATCHES):
        with session if session is not None else torch.autograd.set_grad_enabled(True):
            if micro % 3 == 0:
                with torch.profiler.record_function("user annotation"):
                    loss = model(x).pow(2).mean() / 2
            else:
                loss = model(x).pow(2).mean() / 2
            if micro % 2 == 0:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
        seen += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
        if micro % 2 == 1:
            optimizer.step()
    return seen


def test_annotated_micro_batches_replay_one_plan_exactly() -> None:
    want = _accumulate(None)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=BUDGET_MB))
    got = _accumulate(session)
    assert all(map(torch.equal, want, got))
    stats = session.last_stats
    assert (session.warmups, session.rewarms, session.settled) == (1, 0, True)
    assert stats.phase == "replay" and stats.bytes_d2h > 0  # the budget made it move
    assert stats.peak_resident_bytes <= session.config.budget_bytes
