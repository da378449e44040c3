"""StepRecorder on a real compiled block: what a step is, learned from the calls.

One aot_eager compile of a 2-layer per-block stack, shared by every test (each test
starts a fresh recorder on the shared backend)."""

from __future__ import annotations

import pytest
import torch

import hyper_offload
from hyper_offload.compiler.step.recorder import StepRecorder
from hyper_offload.passes.plan.step import Invocation, StepEvent, StepEventKind, StepTimeline

from .step_models import Stack, batch

F, B = StepEventKind.FORWARD, StepEventKind.BACKWARD


@pytest.fixture(scope="module")
def compiled():
    torch._dynamo.reset()
    backend = hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_mb=1)
    torch.manual_seed(0)
    model = Stack(layers=2)
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer, backend=backend)
    x = batch().requires_grad_()  # every block's input has grad: one graph for both
    model(x).backward()
    return backend, model


@pytest.fixture
def steps(compiled) -> list[StepTimeline]:
    """Install a fresh recorder; the steps it finishes."""
    backend, _ = compiled
    finished: list[StepTimeline] = []
    backend.controller.recorder = StepRecorder(finished.append)
    backend.controller.plan = None
    return finished


def _events(*spec: tuple[StepEventKind, int, int]) -> tuple[StepEvent, ...]:
    return tuple(StepEvent(kind, Invocation(region, ordinal)) for kind, region, ordinal in spec)


def _x() -> torch.Tensor:
    return batch().requires_grad_()


def test_one_graph_for_two_layers_is_two_invocations_backward_in_reverse(compiled, steps):
    _, model = compiled
    model(_x()).backward()
    assert len(steps) == 1 and len(steps[0].regions) == 1
    (r,) = steps[0].regions
    assert steps[0].events == _events((F, r, 0), (F, r, 1), (B, r, 1), (B, r, 0))
    assert set(steps[0].retained_bytes) == {Invocation(r, 0), Invocation(r, 1)}
    # The second layer retains its input (the first layer's output); the first one's
    # leaf input is not counted (it belongs to the caller).
    assert steps[0].retained_bytes[Invocation(r, 0)] == 0
    assert steps[0].retained_bytes[Invocation(r, 1)] == _x().nbytes


def test_forwards_without_grad_are_not_part_of_a_step(compiled, steps):
    _, model = compiled
    with torch.no_grad():
        model(_x())
    assert backend_recorder_idle(compiled) and steps == []
    model(_x()).backward()
    assert len(steps) == 1 and len(steps[0].invocations) == 2


def test_gradient_accumulation_makes_one_step_per_micro_batch(compiled, steps):
    _, model = compiled
    for _ in range(3):
        model(_x()).backward()
    assert len(steps) == 3 and all(s.events == steps[0].events for s in steps)


def test_micro_batches_forwarded_before_their_backwards_are_one_step(compiled, steps):
    _, model = compiled
    first, second = model(_x()), model(_x())
    (first + second).backward()
    assert len(steps) == 1
    forwards = [e for e in steps[0].events if e.kind is F]
    assert [e.invocation.ordinal for e in forwards] == [0, 1, 2, 3]
    assert len(steps[0].events) == 8


def test_a_graph_that_dies_unrun_leaves_the_step(compiled, steps):
    backend, model = compiled
    abandoned = model(_x())  # e.g. an evaluation forward with grad enabled
    del abandoned
    model(_x()).backward()  # its ordinals continue: the abandoned step ended silently
    backend.controller.recorder.poll()
    assert len(steps) == 1
    (r,) = steps[0].regions
    assert steps[0].events == _events((F, r, 0), (F, r, 1), (B, r, 1), (B, r, 0))


def test_a_retained_graphs_second_backward_belongs_to_no_step():
    from torch._functorch import config as functorch_config

    torch._dynamo.reset()
    # AOTAutograd donates buffers to a backward unless told not to; a retained graph
    # needs them (torch's own rule, see its error message).
    with functorch_config.patch(donated_buffer=False):
        backend = hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_mb=1)
        torch.manual_seed(0)
        model = Stack(layers=1)
        model.layers[0] = torch.compile(model.layers[0], backend=backend)
        x = _x()
        loss = model(x)
        loss.backward(retain_graph=True)
        first = x.grad.clone()
        loss.backward()
    assert backend.controller.recorder.steps == 1  # the second backward ended no step
    assert torch.equal(x.grad, 2 * first)  # and ran on what the first left in place


def test_autograd_grad_over_part_of_the_graph_ends_when_the_graph_dies(compiled, steps):
    backend, model = compiled
    x = _x()
    hidden = model.layers[0](x)
    out = model.layers[1](hidden).sum()
    torch.autograd.grad(out, hidden)  # reaches the second layer's backward only
    assert steps == []
    del out, hidden
    backend.controller.recorder.poll()
    # Only the second layer's invocation ran its backward; the first one's left.
    assert len(steps) == 1 and [i.ordinal for i in steps[0].invocations] == [1]


def backend_recorder_idle(compiled) -> bool:
    backend, _ = compiled
    return backend.controller.recorder.current_forwards() == ()


class _HookError(Exception):
    pass


def _fail(_: torch.Tensor) -> None:
    raise _HookError


@pytest.mark.parametrize("where", ["after_every_region", "between_regions"])
def test_a_backward_that_raises_ends_no_step(compiled, steps, where):
    """A backward pass that raises after some (or all) invocations' backwards ran is a
    failed step: it yields no timeline (a partial one would become a plan); the next
    clean step is learnt whole."""
    backend, model = compiled
    x = _x()
    if where == "after_every_region":  # the input's gradient hook: after layer 0's backward
        x.register_hook(_fail)
        loss = model(x)
    else:  # the layers' boundary: after layer 1's backward, before layer 0's
        hidden = model.layers[0](x)
        hidden.register_hook(_fail)
        loss = model.head(model.layers[1](hidden)).pow(2).mean()
    with pytest.raises(_HookError):
        loss.backward()
    del loss, x
    if where == "between_regions":
        del hidden
    backend.controller.recorder.poll()
    assert steps == []
    model(_x()).backward()
    assert len(steps) == 1
    (r,) = steps[0].regions
    assert steps[0].events == _events((F, r, 0), (F, r, 1), (B, r, 1), (B, r, 0))


def test_a_forward_during_which_the_last_steps_graph_dies_is_recorded_in_the_new_step(
    compiled, steps,
):
    """A failed step's graph can die in the middle of the next forward: held by a
    reference cycle, it goes when the collector runs, which any allocation may trigger.
    The forward began numbered after that step's invocations and ends in a new step: it
    is recorded as the new step's, never dropped (found by make fuzz, 12-07: an
    untracked invocation's host copies stayed in use after a backward that raised, since
    the recorder saw nothing outstanding to release)."""
    backend, model = compiled
    recorder = backend.controller.recorder
    abandoned = [model(_x())]  # the failed step's graph, still alive: (r, 0) and (r, 1)
    began, calls = recorder.begin_forward, []

    def graph_dies_once_begun(region: int) -> Invocation:
        upcoming = began(region)
        calls.append(upcoming)
        if len(calls) == 2:  # the invocation's own (the first: the controller's look ahead)
            abandoned.clear()  # what a collection of the cycle does, mid-forward
        return upcoming

    recorder.begin_forward = graph_dies_once_begun  # type: ignore[method-assign]
    try:
        hidden = model.layers[0](_x())
    finally:
        del recorder.begin_forward
    assert [i.ordinal for i in calls] == [2, 2] and not abandoned
    model.head(model.layers[1](hidden)).pow(2).mean().backward()
    recorder.poll()
    assert len(steps) == 1 and len(steps[0].regions) == 1
    (r,) = steps[0].regions
    assert steps[0].events == _events((F, r, 0), (F, r, 1), (B, r, 1), (B, r, 0))
