"""Numerics: a session never changes loss, gradients, parameters or buffers.

Each case runs warmup + several replay steps with an optimizer, under a budget of half
the plain step's peak, against the same model without a session: every value must be
``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.config import MIB

from .models import CASES, assert_same_state, make_pair, plain_peak_bytes, train_step

COMBOS = [
    ("mlp", torch.float32), ("mlp", torch.bfloat16), ("mlp", torch.float16),
    ("transformer", torch.float32), ("transformer", torch.bfloat16), ("transformer", torch.float16),
    ("cnn", torch.float32), ("cnn", torch.bfloat16), ("cnn", torch.float16),
    ("lstm", torch.float32), ("lstm", torch.bfloat16), ("lstm", torch.float16),
]


@pytest.mark.parametrize("case_name,dtype", COMBOS, ids=[f"{c}-{str(d)[6:]}" for c, d in COMBOS])
def test_session_matches_plain_training(case_name: str, dtype: torch.dtype) -> None:
    model, ref, x = make_pair(CASES[case_name], dtype)
    budget = plain_peak_bytes(model, x) // 2
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(4):
        with session:
            loss = train_step(model, x, opt, step)
        ref_loss = train_step(ref, x, ref_opt, step)
        where = f"{case_name}/{dtype} step {step} ({'warmup' if step == 0 else 'replay'})"
        assert torch.equal(loss, ref_loss), f"{where}: loss differs"
        assert_same_state(model, ref, where)
        assert session.last_stats is not None and session.last_stats.bytes_d2h > 0, (
            f"{where}: nothing was offloaded, so the test proves nothing"
        )
        if step > 0:
            assert session.last_stats.demand_loads == 0, f"{where}: the plan missed a prefetch"
        opt.step()
        ref_opt.step()
    assert session.phase == "replay" and session.steps == 4
    assert_same_state(model, ref, f"{case_name}/{dtype} after the last optimizer step")
