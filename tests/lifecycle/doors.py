"""The doors the lifecycle machine drives: ``EagerDoor`` (``OffloadSession`` around each
step) and ``CompileDoor`` (``torch.compile`` with a ``hyper_offload`` backend), each
implementing the :class:`~.harness.Door` protocol."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import cache

import torch
from torch import nn
from torch._dynamo.backends.registry import lookup_backend
from torch.utils._python_dispatch import _disable_current_modes

import hyper_offload
from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.compiler import autograd_saved_device_bytes
from hyper_offload.compiler.backend import HyperOffloadBackend
from hyper_offload.compiler.step.recorder import release_failed_backward_pass
from hyper_offload.runtime.saved_bytes import saved_device_bytes
from hyper_offload.config import MIB
from hyper_offload.eager import ReplayMismatchError, current_session
from hyper_offload.eager.lifecycle import StepState
from hyper_offload.runtime import DeviceMemoryMeter

from .harness import Config, StepKind, StepResult, seeded
from .models import MODELS, WIDTH, compiled_by_the_user


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
    op_error_taints = True

    def __init__(self, config: Config) -> None:
        self.budget = int(config.budget_fraction * plain_peak_bytes(config.model))
        self.session = OffloadSession(OffloadConfig(
            max_resident_activation_mb=self.budget / MIB, max_warmups=config.max_warmups,
            rewarm_on_mismatch=config.rewarm_on_mismatch))
        self._plan_at_start: object = None

    def attach(self, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return model

    def attach_twin(self, twin: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return twin

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


class CompileDoor:
    """``torch.compile(model, backend=hyper_offload.backend(...))`` with ``aot_eager`` as
    the inner compiler and the default step scope: one backend per sequence (a deep copy
    of the model is compiled again with it). The twin is plain
    ``torch.compile(..., backend="aot_eager")``: the same graphs without the transfers,
    so losses and gradients compare with ``torch.equal`` (dropout included).

    A changed op recompiles as plain ``torch.compile`` does; the door is never strict.
    Its plan token changes when the door learns a step: plans are made from the
    timelines of completed steps only, so a step without grad or a failed step must
    leave it. Which plan is in force may change at any training forward all the same:
    the re-lowering the step before asked for plans that step again, and a forward
    whose shape is a step planned before (another branch) puts that plan in force
    (found by make fuzz on the branchy model, 12-07: the token was the plan in force,
    and a failed step of another shape switched it)."""

    name = "compile"
    op_error_taints = False

    def __init__(self, config: Config) -> None:
        fraction = config.budget_fraction
        if config.fraction_option and 0 < fraction <= 1:
            budget: dict[str, float] = {"max_resident_activation_fraction": fraction}
            self.budget: int | None = None  # resolved by the step's first plan
        else:
            self.budget = int(fraction * plain_peak_bytes(config.model))
            budget = {"max_resident_activation_mb": self.budget / MIB}
        # A fresh backend and Dynamo per sequence (a sequence reproduces on its own: a
        # backend shared by sequences carries one's leftovers into the next, see
        # test_compile_lifecycle); new backends' entries would otherwise pile up on the
        # models' code objects. Reset after the measurement above: it runs the compiled
        # stack's blocks under a dispatch mode, and Dynamo then marks the blocks' code as
        # skipped until the next reset, so the process's first sequence ran them eagerly
        # where later ones compiled them (found by make fuzz, 12-07: a failure that passed
        # alone and failed as the second run of itself in one process).
        torch._dynamo.reset()
        self.backend: HyperOffloadBackend = hyper_offload.backend(
            inner_compiler="aot_eager", verify=True, **budget)
        self.twin_graph_runs = 0
        """Calls of the twin's compiled graphs (plain ``aot_eager``), to tell a step that
        plain ``torch.compile`` ran eagerly (below)."""
        self._checked = (0, 0)  # (twin_graph_runs, backend steps) at the last check
        self._tokens: dict[int, object] = {}  # steps learnt -> plan token

    def attach(self, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return torch.compile(model, backend=self.backend)

    def attach_twin(self, twin: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return torch.compile(twin, backend=self._counting_aot_eager)

    def _counting_aot_eager(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compiled = lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args: object) -> object:
            self.twin_graph_runs += 1
            return compiled(*args)

        return run

    def step(self) -> AbstractContextManager[None]:
        return nullcontext()

    def saved_bytes(self, loss: torch.Tensor, exclude: list[torch.Tensor]) -> int | None:
        # What the door's compiled regions hold for their backward. Eager code between
        # regions, which the step plan does not count unless measured, is not counted
        # either; nor are regions the model's own torch.compile made, which run outside
        # the door when Dynamo gives up the outer frame (models.compiled_by_the_user).
        return saved_device_bytes(loss, exclude=exclude,
                                  regions=lambda node: not compiled_by_the_user(node))

    def strict(self, ops_changed: bool) -> type[BaseException] | None:
        return None

    def recover(self) -> None:
        """Nothing to do: a compiled model needs no reset after an error."""

    def plan_token(self) -> object:
        return self._tokens.setdefault(self.backend.controller.steps, object())

    def check_step(self, kind: str, result: StepResult, ops_changed: bool) -> None:
        """Saved device bytes after the forward within the budget or the floor of the
        step plan of the step's shape (what no plan can go below), and the host pool
        idle after every step."""
        self.check_idle()
        (runs, steps), now = self._checked, (self.twin_graph_runs, self.backend.controller.steps)
        self._checked = now
        if kind != StepKind.TRAIN or result.saved_bytes is None:
            return
        if now[0] == runs:
            # Plain torch.compile ran no compiled graph in this step: Dynamo runs the model
            # eagerly. Measured 12-07 on torch 2.13 with plain compile: once a hook of a
            # layer inside the forward's loop over blocks has raised, Dynamo reports "graph
            # break in loop ... Skipping the frame and falling back to eager" and skips
            # that forward's code for good, every instance after (found by make fuzz).
            # The door then has no region to plan either, and holds no budget.
            assert now[1] == steps, "compile door: planned a step plain compile ran eagerly"
            return
        report = self.backend.step_report
        assert report is not None, "compile door: a training step made no step plan"
        budget = report.budget_bytes if self.budget is None else self.budget
        assert report.budget_bytes == budget, (report.budget_bytes, budget)
        cap = max(budget, report.floor_peak_bytes)
        assert result.saved_bytes <= cap, (
            f"compile door: {result.saved_bytes} B saved after the forward, above the budget "
            f"{budget} B and the step's floor {report.floor_peak_bytes} B "
            f"({self.backend.controller!r})")

    def check_idle(self) -> None:
        runtime = self.backend.runtime
        # What a user's next forward does first: finished copies let go, and a backward
        # pass that raised has the engine let go of its nodes.
        self.backend.collect()
        stats = runtime.pool.stats()
        if stats.buffers_in_use or stats.pinned_bytes_in_use:
            raise AssertionError(f"{stats}; {self._what_frees_them()}")
        assert stats.pageable_bytes_in_use == 0, stats
        assert runtime.transfers_pending == 0 and runtime.host_copies == 0

    def _what_frees_them(self) -> str:
        """Why host buffers are still in use after ``collect()``, for the failure message
        (make fuzz found it once on the attention block, 12-07, and the shrunk sequence
        passed alone): whether the recorder had invocations outstanding, and whether an
        empty backward pass on this thread, then the cycle collector, gives them back."""
        recorder = self.backend.controller.recorder
        found = [f"{recorder!r}, outstanding={recorder.outstanding}"]
        for name, action in (("an empty backward pass", release_failed_backward_pass),
                             ("gc.collect()", gc.collect)):
            action()
            self.backend.runtime.collect()
            left = self.backend.runtime.pool.stats().buffers_in_use
            found.append(f"after {name}: {left} buffer(s) in use")
        return "; ".join(found)


def copy_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
