"""The compile door's step lifecycle: one object, named states, one transition per event.

Under ``budget_scope="step"`` the backend's regions are lowered at their floor before
anything is known of the step; :class:`StepController` learns the step, plans it with the
step model (:func:`hyper_offload.passes.plan.step.plan_step`), puts the plan in force
(what each invocation keeps, :meth:`StepController.keep_for`) and asks for the lowerings
the plan wants. It owns everything that lasts across steps: the recorder, the meter, the
plans made, the plan in force, the lowerings asked for.

::

           training forward          step done, nothing to lower
    COLD ───────────────────▶ LEARNING ───────────────────────────▶ PLANNED ◀──┐
                                 │  │                                  │  │    │ step done:
           step done, the plan   │  │ ┌────────────────────────────────┘  │    │ its plan, a
           wants lowerings       │  ▼ ▼  step done, the plan wants         └────┘ cached plan,
                                 │ RELOWERING    lowerings                       or a new one
                                 │  │
                                 │  └── next training forward: lower, plan again ──▶ PLANNED
                                 │                   (or RELOWERING: the new partitions want more)
                                 ▼
                             RETILING ── next training forward: tile, lower, plan again ──▶ PLANNED
                     (from any step done: the plan's floor is     (or RELOWERING, as above)
                      over the budget at a region it may tile)

Events and what they do (every other pair leaves the state as it is):

* ``FORWARD`` with grad, beginning a step: COLD becomes LEARNING; in RELOWERING the
  lowerings asked for are made first (compiled with grad enabled, whatever mode the
  forward runs in), then the step is planned again on them.
* ``FORWARD_NO_GRAD`` (``no_grad``, ``inference_mode``, evaluation): nothing. The region
  runs the lowering in force keeping nothing; no plan is made, no lowering runs, the
  plan in force stays as it was.
* ``STEP_DONE`` (the last outstanding backward finished): the step is planned (or its
  plan, or a cached plan of its shape and sizes, adopted) and the state moves as drawn.
  The eager code between regions counts where a step of the shape was measured
  (:meth:`StepController.measuring`); otherwise the plan counts what regions hold.
* ``STEP_DONE`` where the plan made or in force (also one made in RELOWERING or
  RETILING) has its floor over the budget at an op of a region that sequence tiling may
  tile again (``tile_sequence="auto"``, each region once:
  :meth:`~.lowerings.RegionLowerings.retiling`): RETILING, the budget pinned to the plan's.
  At the next training forward the region is tiled for the floor the step needs there
  and compiled at that floor (:meth:`~.lowerings.RegionLowerings.retile`); the plans made
  on its old graph are dropped, with the lowerings they wanted (made for graphs no region
  runs any more), and the step is planned again, on the tiled graph, whose partition the
  recompute search may search. A tiling that changes nothing makes the lowerings wanted,
  as RELOWERING does.
* ``STEP_ABANDONED`` (a step's graphs died before their backward: it raised, was
  interrupted, or evaluated with grad enabled): seen at the next forward, never planned;
  its host buffers come back there (the runtime collects them); the state stays. A
  backward pass that raised leaves its queued nodes to torch's autograd engine, which
  keeps them (and so the step's graphs) until the thread's next backward pass: the
  forward has the engine drop them first (:meth:`StepController._release_failed_pass`,
  :meth:`~.recorder.StepRecorder.release_failed_pass`).
* A recompilation (Dynamo hands over another region: other sizes, other ops, a branch)
  is no event of its own: the step that runs it has another shape, planned when done.

Thread-safety: forwards run on the user's thread; ``STEP_DONE`` may arrive on autograd's
device thread, where it only records the plan; anything that compiles waits for the
next training forward on the user's thread.
"""

from __future__ import annotations

import logging
import threading
import contextlib
import gc
import dataclasses
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any, Protocol

import torch

from hyper_offload.passes.plan.step import BetweenRegions, Invocation, StepPlan, StepTimeline
from hyper_offload.passes.plan.step.model import SizeBucket, Slot

from .meter import EagerMeter
from .recorder import StepRecorder, release_failed_backward_pass

__all__ = ["StepController", "StepEventName", "StepState", "StepLowering"]

LOGGER = logging.getLogger("hyper_offload")


class StepState(str, Enum):
    """Where the compile door's step lifecycle is (module docstring)."""

    COLD = "cold"
    LEARNING = "learning"
    PLANNED = "planned"
    RELOWERING = "relowering"
    RETILING = "retiling"

    def __repr__(self) -> str:
        return self.value


class StepEventName(str, Enum):
    """What a training loop does that the lifecycle sees."""

    FORWARD = "forward"
    FORWARD_NO_GRAD = "forward without grad"
    STEP_DONE = "step done"
    STEP_ABANDONED = "step abandoned"

    def __repr__(self) -> str:
        return self.value


class StepLowering(Protocol):
    """What the controller asks of the backend: the step plan of a timeline on the
    regions as lowered now, and the lowerings that plan wants, made."""

    def plan(self, timeline: StepTimeline, budget: int | None, fraction: float | None
             ) -> tuple[StepPlan, bool]:
        """The plan of ``timeline`` and whether every region runs the lowering it wants."""
        ...

    def plan_in_force(self, timeline: StepTimeline, budget: int | None,
                      fraction: float | None) -> StepPlan:
        """Keeping slots on the lowerings in force (what runs until the wanted ones exist)."""
        ...

    def lowered_as(self, plan: StepPlan) -> bool:
        """Whether every region of ``plan``'s step runs the lowering it was made for."""
        ...

    def slots(self, region: int, sizes: SizeBucket = ()) -> tuple[tuple[Slot, ...], int]:
        """The slots the lowering in force of ``region`` copies out (may be kept), and the
        most bytes it holds at any of its ops, moving them all; at ``sizes`` (a call's,
        for a region with symbolic sizes; empty: the sizes its plan assumed)."""
        ...

    def apply(self, plan: StepPlan, timeline: StepTimeline) -> bool:
        """Make the lowerings ``plan`` wants (and the recompute search it asks for);
        whether any region changed."""
        ...

    def wants_search(self, plan: StepPlan) -> tuple[int, ...]:
        """Regions the recompute search should re-lower for ``plan``."""
        ...

    def recomputes(self, plan: StepPlan) -> bool:
        """Whether a region of ``plan``'s step runs a partition that recomputes more."""
        ...

    def retiling(self, plan: StepPlan) -> tuple[int, ...]:
        """Regions to tile again before the next step because ``plan``'s floor is over
        its budget at one of their ops (each region at most once); () for none."""
        ...

    def retile(self) -> bool:
        """Tile the regions :meth:`retiling` asked for; whether any region changed."""
        ...

    @property
    def failed_searches(self) -> list[int]:
        """Regions whose recompute search raised so far."""
        ...


class StepController:
    """The step lifecycle of one backend (module docstring).

    ``lowering``: the backend's side (:class:`StepLowering`); ``device`` and
    ``fake_mode``: what the eager meter counts (a fake mode for ``estimate``'s fake
    steps); ``fraction`` / ``budget_bytes``: the options' budget."""

    def __init__(
        self,
        lowering: StepLowering,
        *,
        device: Callable[[], torch.device],
        fake_mode: Any = None,
        budget_bytes: int | None,
        fraction: float | None,
        recompute: bool,
        on_step: Callable[[StepTimeline], None] = lambda timeline: None,
    ) -> None:
        self._lowering = lowering
        self._device = device
        self._fake_mode = fake_mode
        self._budget = budget_bytes if fraction is None else None
        self._fraction = fraction
        self._recompute = recompute
        self._on_step = on_step
        self._lock = threading.RLock()
        self.state = StepState.COLD
        self.recorder = StepRecorder(self._step_done)
        self.meter: EagerMeter | None = None
        self.plan: StepPlan | None = None
        """The plan in force (None before a step was planned)."""
        self.wanted: StepPlan | None = None
        """In RELOWERING: the plan whose lowerings the next training forward makes."""
        self._relower_timeline: StepTimeline | None = None
        self._plans: dict[tuple[Any, ...], StepPlan] = {}
        self._between: dict[tuple[Any, ...], BetweenRegions] = {}
        self.plain_peaks: dict[tuple[Any, ...], int] = {}
        """Per step shape: its peak without offload on torch's partitions."""
        self.replans = 0
        """Plans put in force so far."""
        self._kept_unplanned = 0
        """Bytes kept so far by the step in progress, while no plan holds it."""
        self.plans_made = 0
        self.transitions: list[tuple[StepState, StepEventName, StepState]] = []
        """Every state change, in order (for tests and debugging)."""

    def __repr__(self) -> str:
        return (f"StepController({self.state!r}, plans={self.plans_made}, "
                f"in force={self.plan!r})")

    @property
    def steps(self) -> int:
        return self.recorder.steps

    # ------------------------------------------------------------------ events

    def before_forward(self, grad: bool, region: int | None = None) -> None:
        """A forward of ``region`` is about to run (``grad``: autograd records it)."""
        if grad and region is not None:
            self._release_failed_pass(region)
        self.recorder.poll()  # a step whose graphs died ends here (STEP_ABANDONED)
        if not grad:
            self._move(self.state, StepEventName.FORWARD_NO_GRAD)
            return
        if self.recorder.current_forwards():
            return  # inside a step: nothing changes until it is done
        if self.state in (StepState.RELOWERING, StepState.RETILING):
            self._relower()
        elif self.state is StepState.COLD:
            self._move(StepState.LEARNING, StepEventName.FORWARD)

    def _release_failed_pass(self, region: int) -> None:
        """A backward pass that raised before any region's backward began leaves the
        recorder no trace of itself, and its nodes to the engine alone
        (:func:`~.recorder.release_failed_backward_pass`): the next step's forwards would
        join the step those nodes keep open. The invocation this forward begins tells:
        one the plan in force does not have, while invocations are outstanding (or any
        forward while no plan is in force) has the engine let go of a failed pass's
        nodes first. A step on its plan costs nothing; a step off it (another shape,
        micro-batches before their backwards) one empty backward pass per forward."""
        if not self.recorder.outstanding:
            return
        upcoming = self.recorder.begin_forward(region)
        if self.plan is None or upcoming not in self.plan.timeline.invocations:
            release_failed_backward_pass()

    def keep_for(self, invocation: Invocation, bucket: SizeBucket) -> frozenset[int]:
        """What a plan keeps for ``invocation`` (its sizes: ``bucket``): the plan in force,
        else the latest plan made, while this step's forwards so far are that plan's (same
        invocations, same sizes) and the regions run the lowerings it was made for; the
        floor (nothing kept) where no plan is. A plan found this way is put in force."""
        so_far = (*self.recorder.current_forwards(), invocation)
        sizes = {**self.recorder.current_sizes(), invocation: bucket}
        for plan in (self.plan, *reversed(self._plans.values())):
            if plan is None or plan.timeline.invocations[: len(so_far)] != so_far:
                continue
            if any(plan.timeline.sizes.get(i, ()) != sizes[i] for i in so_far):
                continue
            if not self._lowering.lowered_as(plan):
                continue
            if plan is not self.plan:  # a size bucket seen before: its plan, as made
                self._adopt(plan)
            return plan.keep_for(invocation)
        return self._keep_unplanned(invocation, bucket)

    def _keep_unplanned(self, invocation: Invocation, bucket: SizeBucket) -> frozenset[int]:
        """A step no plan was made for keeps what an absolute budget surely holds: room
        left once the invocations so far keep and retain their bytes and this one peaks as
        its lowering in force does, moving everything (a budget above the step's peak
        moves nothing from the first step on); with a fraction (of a peak not known yet)
        it runs at the floor, keeping nothing."""
        if self._budget is None:
            return frozenset()
        if len(self.recorder.current_forwards()) == 0:
            self._kept_unplanned = 0  # a step begins
        # At the call's own sizes: a region with symbolic sizes lowered for one bucket
        # holds its slots at the sizes it runs with (found by make fuzz: sized at the
        # plan's batch 4, slots kept at batch 12 held 2.3x the budget).
        slots, peak = self._lowering.slots(invocation.region, bucket)
        room = self._budget - self._kept_unplanned - self.recorder.current_retained() - peak
        kept = []
        for slot in sorted(slots, key=lambda s: -s.copy):
            if slot.nbytes <= room:
                kept.append(slot.storage)
                room -= slot.nbytes
                self._kept_unplanned += slot.nbytes
        return frozenset(kept)

    def _step_done(self, timeline: StepTimeline) -> None:
        """STEP_DONE (module docstring); may run on autograd's device thread."""
        with self._lock:
            self._on_step(timeline)
            timeline = self._with_between(timeline)
            plan = self.plan
            if (plan is not None and plan.timeline.plan_key == timeline.plan_key
                    and self.state is StepState.PLANNED):
                return self._move(self._after_plan(timeline), StepEventName.STEP_DONE)
            cached = self._plans.get(timeline.plan_key)
            if cached is not None and self._lowering.lowered_as(cached):
                self._adopt(cached)
                return self._move(self._after_plan(timeline), StepEventName.STEP_DONE)
            self._plan(timeline)
            self._move(self._after_plan(timeline), StepEventName.STEP_DONE)

    # ------------------------------------------------------------------ planning

    def _budget_args(self) -> tuple[int | None, float | None]:
        """The budget in bytes once resolved (a fraction resolves once, on the step's first
        plan on torch's partitions), else the options' fraction."""
        return (self._budget, None) if self._budget is not None else (None, self._fraction)

    def _plan(self, timeline: StepTimeline) -> None:
        """Plan ``timeline``; put in force what the lowerings in force can run, and ask
        for the lowerings (or the recompute search) the plan wants."""
        target = self._plans.get(timeline.plan_key)
        if target is None:
            target, lowered = self._lowering.plan(timeline, *self._budget_args())
            self.plans_made += 1
            self._plans[timeline.plan_key] = target
        else:
            lowered = self._lowering.lowered_as(target)
        search = self._lowering.wants_search(target) if self._recompute else ()
        if lowered and not search:
            self._adopt(target)
            return
        self._budget = target.budget_bytes
        self._adopt(target if lowered else
                    self._lowering.plan_in_force(timeline, target.budget_bytes, None))
        self.wanted, self._relower_timeline = target, timeline
        LOGGER.info("hyper_offload step plan %d asks for %s before the next step", self.replans,
                    f"re-lowering region(s) {', '.join(map(str, search))} with the recompute "
                    "search ranked on the step" if search else "lowering region(s) for the step")

    def _after_plan(self, timeline: StepTimeline) -> StepState:
        """Where a step done (or a relowering) that planned ``timeline`` goes: RETILING
        where the plan it wants (else the one in force) asks for a region to be tiled
        again, else RELOWERING where it wants lowerings, else PLANNED."""
        plan = self.wanted or self.plan
        if plan is not None and self._lowering.retiling(plan):
            self._budget = plan.budget_bytes  # the tiled step is planned under the same budget
            self._relower_timeline = timeline
            return StepState.RETILING
        return StepState.RELOWERING if self.wanted is not None else StepState.PLANNED

    def _relower(self) -> None:
        """RELOWERING or RETILING, at a training forward beginning a step: tile the regions
        asked for (RETILING), make the lowerings the plan wants, then plan the step again
        on them (PLANNED, or RELOWERING / RETILING again where the new partitions want
        lowerings or tiling of their own)."""
        wanted, timeline = self.wanted, self._relower_timeline
        self.wanted = self._relower_timeline = None
        assert timeline is not None and (wanted is not None or self.state is StepState.RETILING)
        failed = len(self._lowering.failed_searches)
        if self.state is StepState.RETILING and self._lowering.retile():
            self._plans.clear()  # made on graphs no region runs any more
            wanted = None  # its lowerings too: the step is planned again on the tiled graphs
        if wanted is not None and self._lowering.apply(wanted, timeline):
            self._plans.clear()  # made on partitions no region runs any more
        self._plan(timeline)
        self._move(self._after_plan(timeline), StepEventName.FORWARD)
        if len(self._lowering.failed_searches) > failed and self.plan is not None:
            plan = self.plan
            LOGGER.warning(
                "hyper_offload step plan %d, after the recompute search failed for region(s) "
                "%s: they keep their floor partition; the plan keeps %.2f MiB on the device "
                "and moves %.2f MiB, predicted peak %.2f MiB for the budget of %.2f MiB "
                "(floor %.2f MiB): %s", self.replans,
                ", ".join(map(str, self._lowering.failed_searches[failed:])),
                plan.kept_bytes / 2**20, plan.moved_bytes / 2**20, plan.peak_bytes / 2**20,
                plan.budget_bytes / 2**20, plan.floor_peak_bytes / 2**20,
                "the budget holds" if plan.fits else
                "over the budget where the floor is (only recompute or a larger budget helps)")

    def _adopt(self, plan: StepPlan) -> None:
        """Put ``plan`` in force; the plan already in force is no new plan (a search that
        kept every partition leaves the step's plan as it was: counted and logged once)."""
        from ..step_report import log_step_plan

        if plan is self.plan:
            return
        self.plan = plan
        self.replans += 1
        if not self._lowering.recomputes(plan):  # torch's partitions: the plain peak
            self.plain_peaks.setdefault(plan.timeline.shape_key, plan.peak_without_offload_bytes)
        log_step_plan(plan, self.replans, plan.predicted_stall_s)

    # ------------------------------------------------------------------ eager meter

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Measure the eager code between regions in the steps run inside (module
        docstring of :mod:`.meter`): the meter is pushed here, outside compiled code."""
        if self.meter is None:
            self.meter = EagerMeter(self._device(), self._fake_mode)
        meter = self.meter
        # Cyclic garbage (an output object and its tensors in a reference cycle) dies when
        # the collector happens to run, which depends on everything allocated before: with
        # the collector paused, what a measured step holds is what its references hold,
        # the same in the estimate's fake steps and in a real step.
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        meter.start()
        self.recorder.observer = meter
        try:
            yield
        finally:
            self.recorder.observer = None
            meter.stop()
            if collecting:
                gc.enable()

    def _with_between(self, timeline: StepTimeline) -> StepTimeline:
        """``timeline`` with the eager bytes measured for its shape (this step's, or an
        earlier step's of the same shape)."""
        if timeline.between is not None:
            self._between[timeline.shape_key] = timeline.between
            return timeline
        between = self._between.get(timeline.shape_key)
        return timeline if between is None else dataclasses.replace(timeline, between=between)

    def _move(self, to: StepState, event: StepEventName) -> None:
        if to is not self.state:
            self.transitions.append((self.state, event, to))
            self.state = to

