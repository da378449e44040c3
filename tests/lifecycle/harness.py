"""The door-independent half of the lifecycle property test (issue 49, item 3).

A *door* (``Door``: the eager ``OffloadSession``, the compile backend) runs a model's
training loop; a *twin* runs the same model, deep-copied, with plain PyTorch. The state
machine (:mod:`.machine`) drives both through the same random events and checks after
each one that the loss, every gradient and every parameter are ``torch.equal`` to the
twin's, and what the door promises about memory and cleanliness (the door's checks).

What a door must provide is the :class:`Door` protocol; everything here (the pair of
models, the inputs, the events applied to both, the numerics and leftover checks) works
for any door.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from .models import MODELS, WIDTH, Knobbed


class StepKind:
    """What a step does (names for the door's checks)."""

    TRAIN = "train"
    NO_GRAD = "no_grad"
    RAISES = "raises"


@dataclass(frozen=True)
class StepResult:
    """What the door's step returned: the loss (None if it raised) and the saved device
    bytes it measured after the forward (None: not measured)."""

    loss: torch.Tensor | None
    saved_bytes: int | None = None


class Door(Protocol):
    """How the harness runs one model through a door. Implementations: ``doors.py``."""

    name: str

    def attach(self, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """The callable that runs ``model``'s forward through the door (again after the
        harness replaces the model: a deep copy)."""
        ...

    def attach_twin(self, twin: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """The callable that runs the twin plainly, as the door's user would without the
        library (eager: the module; compile: plain ``torch.compile`` with the same inner
        compiler, whose numerics the door's must equal)."""
        ...

    op_error_taints: bool
    """Whether a step in which an op raised and the model caught the error is refused as
    the door's plan (eager: the session saw the op fail, its trace is incomplete). A door
    that never sees the failing op (compile: it runs in eager code between regions, or
    at trace time) plans the step as the step it is."""

    def step(self) -> AbstractContextManager[None]:
        """The context one step runs in (its forward and backward, grad or no grad)."""
        ...

    def saved_bytes(self, loss: torch.Tensor, exclude: list[torch.Tensor]) -> int | None:
        """Device bytes the step's graph saves for backward, measured after the forward
        (None: the door does not measure them)."""
        ...

    def strict(self, ops_changed: bool) -> type[BaseException] | None:
        """The error the next training step raises if its ops differ from the door's plan
        (``ops_changed``), else None."""
        ...

    def recover(self) -> None:
        """What a user does after that error (eager: ``session.reset()``)."""
        ...

    def plan_token(self) -> object:
        """Identifies the door's current plan (steps without grad and failed steps must
        leave it as it was)."""
        ...

    def check_step(self, kind: str, result: StepResult, ops_changed: bool) -> None:
        """The door's own promises after a step of ``kind`` (budget, host pool, ...)."""
        ...

    def check_idle(self) -> None:
        """Between steps: nothing in flight, nothing held (host pool in use 0, ...)."""
        ...


@dataclass
class Config:
    """One sequence's fixed choices."""

    model: str
    budget_fraction: float
    """Of the plain step's peak activation bytes (0: everything moves; >= 1: nothing
    has to)."""
    max_warmups: int = 3
    rewarm_on_mismatch: bool = False
    fraction_option: bool = False
    """Where the door takes its budget as a fraction of its own step's peak as well as in
    bytes (compile: ``max_resident_activation_fraction``), ask for it that way."""


@dataclass
class Knobs:
    """The state of the events that change a model's ops (identical on both models);
    the machine compares the ones a door sees with those its plan was made under."""

    branch: bool = False
    frozen: frozenset[str] = frozenset()
    layers: int = 0
    eval: bool = False


@dataclass
class Pair:
    """A model run through a door and its plain twin, with their optimizers."""

    model: Knobbed
    twin: Knobbed
    run: Callable[[torch.Tensor], torch.Tensor]
    twin_run: Callable[[torch.Tensor], torch.Tensor]
    batch: int = 8
    knobs: Knobs = field(default_factory=Knobs)
    step_count: int = 0

    @classmethod
    def build(cls, config: Config, door: Door, seed: int = 0) -> Pair:
        torch.manual_seed(seed)
        model = MODELS[config.model]()
        twin = copy.deepcopy(model)
        return cls(model, twin, door.attach(model), door.attach_twin(twin))

    def inputs(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(10_000 + self.step_count)
        return torch.randn(self.batch, WIDTH, generator=generator)

    def both(self) -> Iterator[Knobbed]:
        yield self.model
        yield self.twin

    def replace(self, door: Door, make: Callable[[Knobbed], Knobbed]) -> None:
        """Replace both models (a deep copy, a reload) and re-attach the door."""
        self.model, self.twin = make(self.model), make(self.twin)
        self.run, self.twin_run = door.attach(self.model), door.attach_twin(self.twin)


def seeded(step: int) -> None:
    """Both runs draw the same dropout masks: one seed per step."""
    torch.manual_seed(1_000 + step)


def assert_same(pair: Pair, loss: torch.Tensor | None, twin_loss: torch.Tensor | None,
                where: str) -> None:
    """Loss, every gradient and every parameter ``torch.equal`` to the twin's."""
    if loss is not None or twin_loss is not None:
        assert loss is not None and twin_loss is not None, where
        assert torch.equal(loss.detach(), twin_loss.detach()), f"{where}: loss differs"
    named = dict(pair.twin.named_parameters())
    for name, p in pair.model.named_parameters():
        q = named[name]
        assert (p.grad is None) == (q.grad is None), f"{where}: grad presence of {name}"
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), f"{where}: gradient of {name} differs"
        assert torch.equal(p, q), f"{where}: parameter {name} differs"


@dataclass
class Baseline:
    """What exists before a sequence: threads and global module hooks (none may be left
    behind)."""

    threads: frozenset[int]
    hooks: tuple[int, ...]

    @classmethod
    def now(cls) -> Baseline:
        return cls(frozenset(t.ident for t in threading.enumerate() if t.ident is not None),
                   _global_hooks())

    def check(self, where: str) -> None:
        assert _global_hooks() == self.hooks, f"{where}: global module hooks left behind"
        extra = [t for t in threading.enumerate()
                 if t.ident not in self.threads and t.is_alive() and not t.daemon]
        assert not extra, f"{where}: threads left behind: {extra}"


def _global_hooks() -> tuple[int, ...]:
    from torch.nn.modules import module as m

    return (len(m._global_forward_pre_hooks), len(m._global_forward_hooks),
            len(m._global_backward_hooks), len(m._global_backward_pre_hooks))


@contextmanager
def grad_mode(kind: str) -> Iterator[None]:
    """``"no_grad"``, ``"inference_mode"`` or ``"eval"`` (``model.eval()`` is set by the
    caller; grad is off in all three)."""
    with (torch.inference_mode() if kind == "inference_mode" else torch.no_grad()):
        yield


class Interrupt(Exception):
    """Raised from a forward hook by the harness: an error that leaves the step."""
