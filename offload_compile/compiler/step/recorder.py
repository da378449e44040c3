"""How the compile door learns a step: invocations of its regions, from the calls themselves.

Every *invocation* (one call of a region's forward with autograd recording) saves
activations that live until *its* backward, and all of them share the device.
:class:`StepRecorder` learns the step (:class:`~hyper_offload.passes.plan.step.StepTimeline`):

* each forward of a region with grad enabled whose outputs carry its
  ``CompiledFunctionBackward`` node is an invocation ``r<region>#<ordinal>`` (the
  ordinal counts that region's forwards in the step, so one compiled block run for N
  layers is N invocations); a forward under ``no_grad`` or with nothing to differentiate
  is not part of the step;
* a pre-hook on that node records when its backward starts, a post-hook when it is done;
* a step ends when no invocation is outstanding any more (each one's backward ran in a
  backward pass that ended without an error, or its graph died unrun: a step that
  raised, an evaluation forward with grad enabled). Then the recorder hands the timeline
  to its callback. A backward pass that raises (a hook, a later node, an interrupt)
  after some invocations' backwards ran fails the step: it ends with no timeline, as
  a forward that raised does (the engine runs the callback that confirms a pass only
  when the pass succeeds; a forward that finds no confirmation is after the failure).
  Plain training is forwards then backwards in reverse; gradient accumulation makes one
  step per micro-batch (their activations never coexist); a pipeline stage's
  micro-batches (several forwards before their backwards) are one step, so invocations
  may come in any order. A retained graph's second backward belongs to no step (its
  invocation was already done), nor does ``autograd.grad`` over part of a graph change
  anything (the invocations it does not reach end when their graph dies).

Invariants: a timeline holds each of its invocations' forward exactly once, and a
backward only after that invocation's forward; every invocation of a timeline that has a
backward event was *completed* (its post-hook ran, in a backward pass that then ended
without an error); a step whose backward pass failed yields no timeline. The recorder
never touches a tensor's values and keeps no strong reference to an autograd graph.
Hooks may run on autograd's device threads: every state change holds the recorder's lock.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes

from hyper_offload.passes.plan.step.model import (
    BetweenRegions,
    Invocation,
    SizeBucket,
    StepEvent,
    StepEventKind,
    StepTimeline,
)

__all__ = [
    "StepObserver", "StepRecorder", "compiled_backward_node", "release_failed_backward_pass",
]


class _Pending(NamedTuple):
    """An invocation whose backward has not completed: its node, weakly."""

    node: weakref.ref[Any]
    retained_bytes: int
    sizes: SizeBucket = ()


class StepObserver(Protocol):
    """What watches the step besides the recorder (:class:`~.meter.EagerMeter`):
    told of each event as it is recorded, of a region's backward running, and asked for
    the eager code's bytes when a step ends."""

    def event(self, event: StepEvent, *, done: bool = False) -> None: ...

    def region(self, args: Sequence[Any]) -> AbstractContextManager[Any]:
        """Around a region's forward: ``args`` are the region's from here, and so are
        the ops run inside."""
        ...

    def enter(self) -> None: ...

    def exit(self) -> None: ...

    def between(self, events: tuple[StepEvent, ...]) -> BetweenRegions | None: ...


class StepRecorder:
    """Learns steps from invocations of compiled regions (module docstring).

    ``on_step`` receives each finished step that ran at least one backward, on the thread
    that finished it (a backward hook's, or the caller of :meth:`begin_forward`).
    ``observer`` (:class:`~.meter.EagerMeter`, while a step is being learnt) measures the
    eager code between regions: each timeline then carries it (``StepTimeline.between``)."""

    def __init__(
        self, on_step: Callable[[StepTimeline], None], observer: StepObserver | None = None
    ) -> None:
        self._on_step = on_step
        self.observer = observer
        self._lock = threading.RLock()
        self._events: list[StepEvent] = []
        self._ordinals: dict[int, int] = {}
        self._pending: dict[Invocation, _Pending] = {}
        self._done: dict[Invocation, _Pending] = {}
        # Of _done: those whose backward pass has not ended yet (confirmed by the
        # engine's callback at the end of a pass without error; never, if it raised).
        self._unconfirmed: set[Invocation] = set()
        self._dead: list[Invocation] = []  # appended by weakref callbacks, lock-free
        self._ready: list[StepTimeline] = []  # ended inside _reap; delivered by poll()
        self._backward_began = False
        """A backward of this step's invocations began (reset when the step ends)."""
        self.steps = 0
        """Steps finished so far (with at least one backward)."""

    def __repr__(self) -> str:
        with self._lock:
            return (f"StepRecorder(steps={self.steps}, events={len(self._events)}, "
                    f"outstanding={len(self._pending)})")

    def current_forwards(self) -> tuple[Invocation, ...]:
        """The invocations of the step in progress, in forward order."""
        with self._lock:
            return tuple(e.invocation for e in self._events if e.kind is StepEventKind.FORWARD)

    @property
    def outstanding(self) -> bool:
        """Whether an invocation of the step in progress awaits its backward."""
        with self._lock:
            return bool(self._pending)

    def current_retained(self) -> int:
        """Bytes the invocations of the step in progress retain (measured)."""
        with self._lock:
            return sum(p.retained_bytes for p in (*self._pending.values(), *self._done.values()))

    def current_sizes(self) -> dict[Invocation, SizeBucket]:
        """The sizes each invocation of the step in progress ran with."""
        with self._lock:
            found = {**self._done, **self._pending}
            return {e.invocation: found[e.invocation].sizes for e in self._events
                    if e.kind is StepEventKind.FORWARD and e.invocation in found}

    def begin_forward(self, region: int) -> Invocation:
        """The invocation a forward of ``region`` about to run will be, if it records."""
        with self._lock:
            self._reap()
            return Invocation(region, self._ordinals.get(region, 0))

    def end_forward(
        self, invocation: Invocation, outputs: Any, retained_bytes: Callable[[Any], int],
        sizes: SizeBucket = (),
    ) -> bool:
        """Record ``invocation`` if ``outputs`` carry a compiled backward node; hook it.
        ``retained_bytes(node)`` measures what the node holds, ``sizes`` are the call's
        (see :class:`StepTimeline`). Returns whether the forward is part of the step."""
        node = compiled_backward_node(outputs)
        if node is None:
            return False
        held = retained_bytes(node)
        dead = self._dead
        with self._lock:
            self._reap()
            expected = self._ordinals.get(invocation.region, 0)
            if expected > invocation.ordinal:
                return False  # another thread recorded this ordinal first: not tracked
            # Fewer than when it began: the step it began in ended while it ran (that
            # step's graphs died, e.g. a failed step's, freed by a collection of the
            # cycle that held them). It is the new step's, numbered there: dropped, it
            # would hold host copies no release knows of (found by make fuzz, 12-07).
            invocation = Invocation(invocation.region, expected)
            # The hooks hold the node weakly: a hook holding it strongly would make a cycle
            # (node -> hook -> node) that keeps an abandoned graph alive until a collection.
            ref = weakref.ref(node, lambda _: dead.append(invocation))
            self._ordinals[invocation.region] = invocation.ordinal + 1
            event = StepEvent(StepEventKind.FORWARD, invocation)
            self._events.append(event)
            self._pending[invocation] = _Pending(ref, held, tuple(sizes))
            if self.observer is not None:
                self.observer.event(event)
                self.observer.event(event, done=True)
        node.register_prehook(lambda grads: self._backward_started(invocation, ref))
        node.register_hook(lambda grad_inputs, grad_outputs: self._backward_done(invocation, ref))
        return True

    def _is_current(self, invocation: Invocation, ref: weakref.ref[Any]) -> bool:
        pending = self._pending.get(invocation)
        return pending is not None and pending.node is ref

    def _backward_started(self, invocation: Invocation, ref: weakref.ref[Any]) -> None:
        with self._lock:
            if self._is_current(invocation, ref):
                event = StepEvent(StepEventKind.BACKWARD, invocation)
                self._events.append(event)
                self._backward_began = True
                if self.observer is not None:
                    self.observer.event(event)
                    self.observer.enter()

    def _backward_done(self, invocation: Invocation, ref: weakref.ref[Any]) -> None:
        with self._lock:
            if not self._is_current(invocation, ref):
                return  # a retained graph's second backward: its step is over
            if self.observer is not None:
                self.observer.exit()
                self.observer.event(StepEvent(StepEventKind.BACKWARD, invocation), done=True)
            self._done[invocation] = self._pending.pop(invocation)
            self._unconfirmed.add(invocation)
        # Runs when this backward pass ends, only if nothing in it raised.
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._backward_pass_ended(invocation))

    def _backward_pass_ended(self, invocation: Invocation) -> None:
        with self._lock:
            self._unconfirmed.discard(invocation)
            finished = self._finish_if_idle()
        if finished is not None:
            self._on_step(finished)

    def _reap(self) -> None:
        """Forget invocations whose graph died before its backward completed. Called
        with the lock held; a step left with nothing outstanding ends here (its callback
        runs later, from :meth:`poll`)."""
        while self._dead:
            invocation = self._dead.pop()
            pending = self._pending.get(invocation)
            if pending is not None and pending.node() is None:
                del self._pending[invocation]
                self._events = [e for e in self._events if e.invocation != invocation]
        if not self._pending and self._unconfirmed and torch._C._current_graph_task_id() < 0:
            # Nothing outstanding, no backward pass running, yet a pass never confirmed
            # what it ran: it raised. The step failed.
            self._events, self._done, self._ordinals, self._unconfirmed = [], {}, {}, set()
            self._backward_began = False
        elif not self._pending and (self._events or self._ordinals):
            finished = self._finish_if_idle()
            if finished is not None:
                self._ready.append(finished)

    def _finish_if_idle(self) -> StepTimeline | None:
        """End the step if nothing is outstanding; the timeline if it ran a backward."""
        if self._pending or self._unconfirmed:
            return None
        events = tuple(e for e in self._events if e.invocation in self._done)
        timeline = StepTimeline(
            events, {i: p.retained_bytes for i, p in self._done.items()},
            {i: p.sizes for i, p in self._done.items() if p.sizes},
            self.observer.between(events) if self.observer is not None else None,
        ) if events else None
        self._events, self._done, self._ordinals = [], {}, {}
        self._backward_began = False
        if timeline is not None:
            self.steps += 1
        return timeline

    def release_failed_pass(self, *, after_a_backward_only: bool = True) -> bool:
        """Where invocations are outstanding while no pass runs and (``after_a_backward_only``)
        a backward pass began on this step, the pass may have raised, leaving their nodes
        to the autograd engine alone (:func:`release_failed_backward_pass`): let it drop
        them, so that their graphs die and the step fails as a step whose graphs died
        does. Returns whether it ran. Called before every region's forward, with the
        evidence (a pass that raised before any region's backward leaves none: the step
        controller's check, or the backend's ``collect()``, which asks for none). A
        retained graph's nodes, or those of micro-batches still to run backward, are held
        by the user's tensors: nothing changes for them."""
        with self._lock:
            suspect = bool(self._pending) and (self._backward_began or not after_a_backward_only)
        return suspect and release_failed_backward_pass()

    def poll(self) -> None:
        """Deliver steps that ended because a graph died (the forward path calls this)."""
        with self._lock:
            self._reap()
            ready, self._ready = self._ready, []
        for timeline in ready:
            self._on_step(timeline)


def release_failed_backward_pass() -> bool:
    """Let torch's autograd engine drop the nodes a backward pass that raised left to it.

    Measured (torch 2.13, CPU; ``tests/compiler/test_failed_step.py``): when a node of
    a backward pass raises (a hook, an interrupt), the nodes already queued to run next
    stay referenced by the engine on the thread that ran the pass, with every node they
    reach and all those nodes save, until that thread runs its next backward pass, which
    drops them. Plain training keeps those saved activations on the device until then;
    with offload they are host copies, and the step they belong to never ends. A
    one-node backward pass on this thread (no dispatch mode sees it; nothing of the
    user's graph runs) makes the engine drop them now. Returns False where it must not
    run: inside a backward pass (whose own nodes are queued), under compiled autograd
    (the pass would be compiled)."""
    from torch._dynamo import compiled_autograd

    if torch._C._current_graph_task_id() >= 0 or compiled_autograd.compiled_autograd_enabled:
        return False
    with _disable_current_modes(), torch.inference_mode(False), torch.enable_grad():
        leaf = torch.zeros((), requires_grad=True)
        torch.autograd.grad(leaf * 1.0, leaf)
    return True


def compiled_backward_node(outputs: Any) -> Any | None:
    """The ``CompiledFunctionBackward`` node of a compiled region's ``outputs`` (directly
    on an output, or one view away), or None when nothing will be differentiated."""
    for tensor in _tensors(outputs):
        node = tensor.grad_fn
        if node is None:
            continue
        if _is_compiled_node(node):
            return node
        for parent, _ in node.next_functions:
            if parent is not None and _is_compiled_node(parent):
                return parent
    return None


def _is_compiled_node(node: Any) -> bool:
    return type(node).__name__ == "CompiledFunctionBackward"


def _tensors(outputs: Any) -> Iterable[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        yield outputs
    elif isinstance(outputs, (list, tuple)):
        for item in outputs:
            yield from _tensors(item)
    elif isinstance(outputs, dict):
        for item in outputs.values():
            yield from _tensors(item)
