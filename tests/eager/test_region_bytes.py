"""What compiled blocks (and ``skip_offload`` regions) keep for their backward is counted
and planned around, never a silent "feasible" (issue 42 item 3).

The session cannot move what a region's own ops save (they run untraced, compiled code
with every dispatch mode off). It reads those bytes from autograd's graph when the
region's forward ends and holds them, as one unmovable storage, until the region's
backward: the plan moves more of the rest, or says the budget cannot be met.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from hyper_offload import OffloadConfig, OffloadSession, skip_offload
from hyper_offload.compiler import autograd_saved_device_bytes, saved_device_bytes
from hyper_offload.config import MIB
from hyper_offload.errors import OffloadBudgetWarning

SLACK = 256 * 1024


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.fixture(scope="module")
def compiled_pair() -> tuple[nn.Module, nn.Module]:
    """Four blocks, the middle two compiled (aot_eager), and a plain-eager twin with the
    same compiled blocks' weights for the reference."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)])
    ref = copy.deepcopy(model)
    for m in (model, ref):
        for index in (1, 2):
            m[index] = torch.compile(m[index], backend="aot_eager")
    return model, ref


X = torch.randn(256, 32, generator=torch.Generator().manual_seed(1))


def _step(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor], int, int]:
    """Loss, gradients, all saved device bytes, and those the compiled blocks save
    besides their inputs (which the session plans: the eager blocks' outputs)."""
    inputs: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda _, a: inputs.append(a[0])) for m in model[1:3]]
    out = model(X).pow(2).mean()
    for hook in hooks:
        hook.remove()
    saved = autograd_saved_device_bytes(out, exclude=[*model.parameters(), X])
    compiled = saved_device_bytes(out, exclude=[*model.parameters(), X, *inputs])
    out.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.detach(), grads, saved, compiled


def test_compiled_blocks_are_counted_and_the_rest_planned_around_them(compiled_pair):
    model, ref = compiled_pair
    loss, grads, plain_saved, compiled_saved = _step(ref)
    assert compiled_saved > 0
    budget = plain_saved // 2
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget / MIB))
    for step in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OffloadBudgetWarning)
            with session:
                got, got_grads, saved, _ = _step(model)
        assert torch.equal(got, loss) and all(map(torch.equal, got_grads, grads)), step
        stats = session.last_stats
        # Both compiled blocks' saved bytes are alive at once before the backward.
        assert stats.region_bytes == compiled_saved, (stats.region_bytes, compiled_saved)
        if stats.phase == "replay":
            assert saved <= budget + SLACK, (saved, budget)
            assert stats.resident_curve == list(session.report.resident_bytes)
    # The held bytes are in the plan: every op from a compiled forward to its backward
    # reads them, and the peak counts them.
    assert session.report.peak_resident_bytes >= compiled_saved
    assert stats.bytes_d2h > 0


def test_a_budget_the_regions_alone_exceed_is_reported_not_called_feasible(compiled_pair):
    model, ref = compiled_pair
    *_, compiled_saved = _step(ref)
    session = OffloadSession(OffloadConfig(max_resident_activation_mb=compiled_saved / 2 / MIB))
    with pytest.warns(OffloadBudgetWarning, match="no schedule meets the budget"):
        with session:
            _step(model)
    assert not session.report.feasible
    assert session.report.peak_resident_bytes >= compiled_saved


def test_a_skip_offload_region_is_counted_too():
    torch.manual_seed(0)
    block = Block()

    @skip_offload
    def inner(x: torch.Tensor) -> torch.Tensor:
        return block(x)

    session = OffloadSession(OffloadConfig(max_resident_activation_mb=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OffloadBudgetWarning)
        with session:
            out = inner(X).sum()
            saved = autograd_saved_device_bytes(out, exclude=[*block.parameters(), X])
            assert saved > 0
            out.backward()
    assert session.last_stats.region_bytes == saved > 0
