"""``LifecycleMachine``: a ``hypothesis.stateful`` state machine that drives one door and a
plain twin through the same random training-loop events and checks both after each.

Events (rules): a training step (zero_grad to None, to zeros, or not at all: gradient
accumulation; an optimizer step or not), a forward without grad (``no_grad``,
``inference_mode``, ``model.eval()`` under ``no_grad``), a step that raises (in the
forward or in the backward; the user skips the batch), a step whose op raises and the
model catches it, sizes that change, ops that change (a branch, a parameter frozen or
unfrozen, a layer added, train/eval on a model with dropout), ``state_dict`` saved and
loaded, ``copy.deepcopy`` of the model, the door's reset.

After every event: the loss, every gradient and every parameter equal the twin's
(``torch.equal``); the door's own checks (:meth:`Door.check_step`, :meth:`Door.check_idle`);
no thread or global hook left behind. Steps without grad and failed steps leave the
door's plan as it was; a training step whose ops differ from the plan's runs (the door
re-plans) unless the door says it is strict then (:meth:`Door.strict`), in which case
it raises that error and the harness recovers as a user would.
"""

from __future__ import annotations

import copy
import io
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn

from .harness import (
    Baseline,
    Config,
    Door,
    Interrupt,
    Knobs,
    Pair,
    StepKind,
    StepResult,
    assert_same,
    grad_mode,
    seeded,
)

EVENTS: Counter[str] = Counter()
"""Events run so far in this process, by rule (reported by ``make fuzz``)."""

DoorFactory = Callable[[Config], Door]


class LifecycleMachine(RuleBasedStateMachine):
    """Subclassed per door and model by :func:`machine_for`."""

    door_factory: DoorFactory
    model_name: str
    on_sequence: Callable[[str, str, Counter[str]], None] | None = None
    """Told of every sequence as it ends (door, model, the events it ran): ``make fuzz``'s
    running record, which an interrupted run keeps."""

    def __init__(self) -> None:
        super().__init__()
        self._events_before = EVENTS.copy()
        self.baseline = Baseline.now()
        self.door: Door
        self.pair: Pair
        self.plan_knobs: tuple[object, ...] | None = None  # knobs the door's plan was made under
        EVENTS["sequences"] += 1

    @initialize(budget=st.sampled_from([0.0, 0.3, 0.6, 4.0]), max_warmups=st.sampled_from([1, 2, 3]),
                rewarm=st.booleans(), fraction_option=st.booleans())
    def setup(self, budget: float, max_warmups: int, rewarm: bool, fraction_option: bool) -> None:
        config = Config(self.model_name, budget, max_warmups, rewarm, fraction_option)
        self.door = type(self).door_factory(config)
        self.pair = Pair.build(config, self.door)

    # ------------------------------------------------------------------ training steps

    def _signature(self) -> tuple[object, ...]:
        """The knobs that change the ops the door sees, then those that may: a parameter
        inside a compiled block (frozen, the block's backward may stop reading its input,
        or not: the door sees one opaque op)."""
        knobs, prefix = self.pair.knobs, type(self.pair.model).OPAQUE_PREFIX
        inside = frozenset(n for n in knobs.frozen if n.startswith(prefix))
        return (knobs.branch, knobs.frozen - inside, knobs.layers, knobs.eval, inside)

    def _ops_changed(self) -> tuple[bool, bool]:
        """(whether the ops differ from the plan's for sure, whether they may)."""
        if self.plan_knobs is None:
            return False, False
        now = self._signature()
        return now[:-1] != self.plan_knobs[:-1], now != self.plan_knobs

    def _zero(self, how: str) -> None:
        for model in self.pair.both():
            if how != "keep":
                model.zero_grad(set_to_none=how == "to_none")

    def _door_step(self, x: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        pair, door = self.pair, self.door
        params = list(pair.model.parameters())
        with door.step():
            seeded(pair.step_count)
            loss = pair.run(x)
            saved = door.saved_bytes(loss, [*params, x])
            loss.backward()
        return loss, saved

    def _train(self, how_zero: str, optimizer: bool, event: str) -> None:
        """One training step of both models. If the door is strict and the step's ops
        differ from its plan, the step raises the door's error: the harness restores the
        gradients, recovers the door as a user would and runs the step again (a probe's
        caught op error may hand the step over before the difference shows: then it
        simply runs)."""
        pair, door = self.pair, self.door
        self._zero(how_zero)
        changed, maybe = self._ops_changed()
        expected = door.strict(maybe)
        x = pair.inputs()
        grads = {n: None if p.grad is None else p.grad.clone()
                 for n, p in pair.model.named_parameters()} if expected else {}
        before = door.plan_token()
        try:
            loss, saved = self._door_step(x)
        except BaseException as error:
            if expected is None or not isinstance(error, expected):
                raise
            for n, p in pair.model.named_parameters():
                p.grad = grads[n]
            door.recover()
            self.plan_knobs, changed = None, False
            EVENTS["strict_mismatch"] += 1
            before = door.plan_token()
            loss, saved = self._door_step(x)
        else:
            assert expected is None or not changed or pair.model.probe, (
                f"{door.name}: a strict door ran a step whose ops differ from its plan")
        seeded(pair.step_count)
        twin_loss = pair.twin_run(x)
        twin_loss.backward()
        where = f"{self.model_name} step {pair.step_count} ({event})"
        assert_same(pair, loss, twin_loss, where)
        door.check_step(StepKind.TRAIN, StepResult(loss, saved), changed)
        if door.plan_token() is not before and not pair.model.probe:
            self.plan_knobs = self._signature()
        if optimizer:
            for model in pair.both():
                with torch.no_grad():
                    for p in model.parameters():
                        if p.grad is not None:
                            p.add_(p.grad, alpha=-0.05)
        pair.step_count += 1

    @rule(how_zero=st.sampled_from(["to_none", "zeros", "keep"]), optimizer=st.booleans())
    def train_step(self, how_zero: str, optimizer: bool) -> None:
        EVENTS[f"train_step[{how_zero}]"] += 1
        self._train(how_zero, optimizer, f"train, zero_grad {how_zero}")

    @rule()
    def step_with_a_caught_op_error(self) -> None:
        """The model probes an op that raises and catches it, then computes on: the step
        is exact and, in a door that sees the op fail (:attr:`Door.op_error_taints`),
        never becomes the door's plan."""
        EVENTS["caught_op_error"] += 1
        before = self.door.plan_token()
        for model in self.pair.both():
            model.probe = True
        try:
            self._train("to_none", False, "caught op error")
        finally:
            for model in self.pair.both():
                model.probe = False
        if self.door.op_error_taints:
            assert self.door.plan_token() is before, "a step whose op raised became the plan"

    @rule(kind=st.sampled_from(["no_grad", "inference_mode", "eval"]))
    def forward_without_grad(self, kind: str) -> None:
        EVENTS[f"no_grad[{kind}]"] += 1
        pair, door = self.pair, self.door
        before = door.plan_token()
        x = pair.inputs()
        training = [m.training for m in pair.both()]
        if kind == "eval":
            for model in pair.both():
                model.eval()
        try:
            with grad_mode(kind):
                with door.step():
                    seeded(pair.step_count)
                    out = pair.run(x)
                seeded(pair.step_count)
                twin_out = pair.twin_run(x)
        finally:
            for model, mode in zip(pair.both(), training):
                model.train(mode)
        assert torch.equal(out, twin_out), f"{self.model_name}: no-grad output differs"
        assert door.plan_token() is before, "a step without grad changed the plan"
        door.check_step(StepKind.NO_GRAD, StepResult(None), False)
        pair.step_count += 1

    @rule(where=st.sampled_from(["forward", "backward"]),
          error=st.sampled_from([Interrupt, KeyboardInterrupt]))
    def step_that_raises(self, where: str, error: type[BaseException]) -> None:
        """An error leaves the step (the user catches it outside and skips the batch:
        ``zero_grad(set_to_none=True)`` on both)."""
        EVENTS[f"raises[{where}]"] += 1
        pair, door = self.pair, self.door
        before = door.plan_token()
        module = _a_middle_module(pair.model)

        # Run eagerly under torch.compile (a graph break, the error raised at run time):
        # Dynamo would trace a hook that raises, and then run the whole frame eagerly
        # from that call on, for every copy of the model: no compiled step left to test.
        @torch.compiler.disable
        def fail(*_: object) -> None:
            raise error

        # A forward hook, or a parameter's gradient hook (mid-backward): neither changes
        # the step's ops (a module's full backward hook would: it wraps its tensors).
        trained = next(p for p in pair.model.parameters() if p.requires_grad)
        handle = (module.register_forward_hook(fail) if where == "forward"
                  else trained.register_hook(fail))
        x = pair.inputs()
        try:
            with pytest.raises(error):
                with door.step():
                    seeded(pair.step_count)
                    pair.run(x).backward()
        finally:
            handle.remove()
        assert door.plan_token() is before, "a failed step changed the plan"
        door.check_step(StepKind.RAISES, StepResult(None), False)
        self._zero("to_none")
        pair.step_count += 1

    # ------------------------------------------------------------------ other events
    # Each is followed by a training step of both models (the change exercised at once).

    @rule(batch=st.sampled_from([4, 8, 12]))
    def change_sizes(self, batch: int) -> None:
        EVENTS["change_sizes"] += 1
        self.pair.batch = batch
        self._train("to_none", False, "change_sizes")

    @rule()
    def toggle_branch(self) -> None:
        EVENTS["toggle_branch"] += 1
        self.pair.knobs.branch = not self.pair.knobs.branch
        for model in self.pair.both():
            model.branch = self.pair.knobs.branch
        self._train("to_none", False, "toggle_branch")

    @rule(index=st.integers(0, 2))
    def toggle_frozen(self, index: int) -> None:
        EVENTS["toggle_frozen"] += 1
        name = _freezable(self.pair.model)[index]
        knobs = self.pair.knobs
        knobs.frozen = knobs.frozen ^ {name}
        for model in self.pair.both():
            model.get_parameter(name).requires_grad_(name not in knobs.frozen)
        self._train("to_none", False, "toggle_frozen")

    @precondition(lambda self: self.pair.knobs.layers < 2)
    @rule()
    def add_layer(self) -> None:
        EVENTS["add_layer"] += 1
        knobs = self.pair.knobs
        knobs.layers += 1
        for model in self.pair.both():
            model.grow(seed=knobs.layers)
        self._train("to_none", False, "add_layer")

    @rule()
    def toggle_train_eval(self) -> None:
        EVENTS["toggle_train_eval"] += 1
        knobs = self.pair.knobs
        if type(self.pair.model).EVAL_CHANGES_OPS:
            knobs.eval = not knobs.eval
        for model in self.pair.both():
            model.train(model.training is False)
        self._train("to_none", False, "toggle_train_eval")

    @rule()
    def state_dict_roundtrip(self) -> None:
        EVENTS["state_dict"] += 1
        for model in self.pair.both():
            buffer = io.BytesIO()
            torch.save(model.state_dict(), buffer)
            buffer.seek(0)
            model.load_state_dict(torch.load(buffer))
        self._train("to_none", False, "state_dict_roundtrip")

    @rule()
    def deepcopy_models(self) -> None:
        EVENTS["deepcopy"] += 1
        self.pair.replace(self.door, copy.deepcopy)
        self._train("keep", False, "deepcopy")  # the copies carry the gradients

    @rule()
    def reset(self) -> None:
        EVENTS["reset"] += 1
        self.door.recover()
        self.plan_knobs = None

    # ------------------------------------------------------------------ after every event

    def teardown(self) -> None:
        if type(self).on_sequence is not None and hasattr(self, "door"):
            type(self).on_sequence(self.door.name, self.model_name, EVENTS - self._events_before)

    @invariant()
    def nothing_left_behind(self) -> None:
        if hasattr(self, "door"):
            self.door.check_idle()
        self.baseline.check("after an event")


def _a_middle_module(model: nn.Module) -> nn.Module:
    children = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return children[len(children) // 2]


def _freezable(model: nn.Module) -> list[str]:
    names = [n for n, _ in model.named_parameters() if not n.startswith("extra.")]
    return [names[0], names[len(names) // 2], names[-2]]


def machine_for(door_factory: DoorFactory, model: str) -> type[LifecycleMachine]:
    """The state machine of ``door_factory``'s door on model ``model``."""
    return type(f"{model.title()}Machine", (LifecycleMachine,),
                {"door_factory": staticmethod(door_factory), "model_name": model})
