"""The doors the lifecycle machine drives. ``EagerDoor``: ``OffloadSession`` around each
step. (The compile door, ``torch.compile(backend="hyper_offload")``, implements the same
:class:`~.harness.Door` protocol.)"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import cache

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.compiler import autograd_saved_device_bytes
from hyper_offload.config import MIB
from hyper_offload.eager import ReplayMismatchError, current_session
from hyper_offload.eager.lifecycle import StepState
from hyper_offload.runtime import DeviceMemoryMeter

from .harness import Config, StepKind, StepResult, seeded
from .models import MODELS, WIDTH


@cache
def plain_peak_bytes(model: str) -> int:
    """Peak bytes of the storages one plain training step of ``model`` creates (batch 8,
    measured once per model): the scale of the drawn budgets."""
    torch.manual_seed(0)
    probe = MODELS[model]()
    meter = DeviceMemoryMeter("cpu")
    seeded(0)
    with meter:
        probe(torch.randn(8, WIDTH)).backward()
    return meter.peak_bytes


class EagerDoor:
    """One ``OffloadSession`` for the whole sequence, entered around every step."""

    name = "eager"

    def __init__(self, config: Config) -> None:
        self.budget = int(config.budget_fraction * plain_peak_bytes(config.model))
        self.session = OffloadSession(OffloadConfig(
            max_resident_activation_mb=self.budget / MIB, max_warmups=config.max_warmups,
            rewarm_on_mismatch=config.rewarm_on_mismatch))
        self._plan_at_start: object = None

    def attach(self, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return model

    def step(self) -> AbstractContextManager[None]:
        self._plan_at_start = self.session.lifecycle.plan
        return self.session  # type: ignore[return-value]

    def saved_bytes(self, loss: torch.Tensor, exclude: list[torch.Tensor]) -> int | None:
        # Reading saved tensors may run ops (a saved output's detach): none of the step's.
        with _disable_current_modes():
            return autograd_saved_device_bytes(loss, exclude=exclude)

    def strict(self, ops_changed: bool) -> type[BaseException] | None:
        life = self.session.lifecycle
        if not ops_changed or life.state is StepState.COLD or life.rewarm_allowed:
            return None
        return ReplayMismatchError

    def recover(self) -> None:
        self.session.reset()

    def plan_token(self) -> object:
        return self.session.lifecycle.plan

    def check_step(self, kind: str, result: StepResult, ops_changed: bool) -> None:
        """Saved device bytes after the forward within the budget, or at the step's floor
        as the session reports it: the plan's peak where it cannot meet the budget (a
        replay), the warmup's own measured resident bytes (a warmup)."""
        stats = self.session.last_stats
        assert stats is not None and stats.pool is not None and stats.pool.buffers_in_use == 0
        if kind != StepKind.TRAIN or result.saved_bytes is None:
            return
        if stats.phase == "replay" and not stats.evictions:
            plan = self._plan_at_start
            report = plan.report  # type: ignore[attr-defined]
            floor = self.budget if report.feasible else report.peak_resident_bytes
        else:  # a warmup (the first, a re-warm, one that finished a tainted step), or a
            # replay larger than its plan, which evicts online as a warmup does
            floor = max(self.budget, max(stats.resident_curve, default=0))
        assert result.saved_bytes <= floor, (
            f"eager door: {result.saved_bytes} B saved after the forward, above the budget "
            f"{self.budget} B and the step's floor {floor} B ({stats.phase})")

    def check_idle(self) -> None:
        session = self.session
        stats = session.pool.stats()
        assert stats.buffers_in_use == 0 and stats.pinned_bytes_in_use == 0
        assert stats.pageable_bytes_in_use == 0, stats
        assert len(session.manager) == 0 and session.manager.transfers_in_flight() == 0
        assert not session.active and current_session() is None


def copy_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
