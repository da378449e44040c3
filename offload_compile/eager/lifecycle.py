"""``StepLifecycle``: the eager door's step lifecycle, one state machine, one owner.

Everything an ``OffloadSession`` keeps from one step to the next (the plan, the counts,
whether it settled) and the state of the step in progress live here; the session only
asks this object what to run and reports what happened. The machine (states between
steps in capitals, states during a step in lower case; ``<began>``: back to the state
the step began in)::

     RESET (from COLD, SETTLING or SETTLED)
     +---------------------------------------------------------------------------+
     v                                                                           |
    COLD --ENTER--> warming --EXIT--> SETTLING --ENTER--> replaying --EXIT--> SETTLED
                     ^   |                                  |    ^               |
                     |   +--RAISED, tainted EXIT--> <began> |    +----ENTER------+
                     |                                      |
                     +-------------OPS_CHANGED--------------+--RAISED, tainted EXIT--> <began>

    COLD, SETTLING, SETTLED --ENTER_NO_GRAD--> passing --EXIT, RAISED--> <began>
    warming, replaying, passing --OP_RAISED--> the same state (the step is tainted)

* ``ENTER``: ``with session:`` with grad enabled. COLD warms up; SETTLING and SETTLED
  replay the plan. ``ENTER_NO_GRAD`` (under ``torch.no_grad()`` / ``inference_mode()``,
  e.g. evaluation of a model in ``eval()``): the step runs untraced and leaves the plan
  exactly as it was; it never re-plans.
* ``OPS_CHANGED``: a replayed step runs other ops than the plan (a branch, a layer added
  or frozen or unfrozen, a read of a storage after what its warmup recorded as its last
  use). A warmup takes the step over if a re-warm is allowed: while SETTLING, up to
  ``max_warmups`` warmups; always with ``rewarm_on_mismatch``. Otherwise the replay
  raises ``ReplayMismatchError`` (then ``RAISED``).
* ``OP_RAISED``: an op raised inside the step (a kernel error, ``KeyboardInterrupt``).
  The step is *tainted*: if the error leaves the block it is ``RAISED``; if the user
  catches it the step runs on, exactly (a replay hands it to a warmup, whose online
  eviction keeps the budget), and at ``EXIT`` it is discarded: it never becomes a plan.
* ``EXIT``: a warmup's trace becomes the plan (SETTLING); a replay that ran its plan's
  ops settles (SETTLED; a plan re-made for larger sizes replaces the old one).
* ``RAISED``: an exception left the block: back to the state the step began in, plan
  untouched; the session has returned every host buffer.

Invalid events (entering twice, ``reset()`` inside the block, an exit without an entry)
raise :class:`~hyper_offload.errors.OffloadSessionError` naming the state, the event and
the fix. Pure: no torch; the plan is an opaque object here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hyper_offload.errors import OffloadSessionError

__all__ = ["BETWEEN_STEPS", "StepEvent", "StepKind", "StepLifecycle", "StepState", "TRANSITIONS"]


class StepState(str, Enum):
    """Where the session is: between steps (upper case values) or inside one."""

    COLD = "COLD"
    """No plan: the next step with grad warms up."""
    SETTLING = "SETTLING"
    """A warmup's plan that no replay has confirmed yet: a step with other ops re-warms
    (up to ``max_warmups`` warmups, or always with ``rewarm_on_mismatch``)."""
    SETTLED = "SETTLED"
    """A replay ran its plan's ops: other ops raise unless ``rewarm_on_mismatch``."""
    WARMING = "warming"
    """A warmup step (the first, or one that took a replayed step over) is running."""
    REPLAYING = "replaying"
    """A replay step is running."""
    PASSING = "passing"
    """A step without grad is running, untraced."""

    def __repr__(self) -> str:
        return self.value


BETWEEN_STEPS = frozenset({StepState.COLD, StepState.SETTLING, StepState.SETTLED})


class StepEvent(str, Enum):
    """What happens to the session (module docstring)."""

    ENTER = "ENTER"
    ENTER_NO_GRAD = "ENTER_NO_GRAD"
    OPS_CHANGED = "OPS_CHANGED"
    OP_RAISED = "OP_RAISED"
    EXIT = "EXIT"
    RAISED = "RAISED"
    RESET = "RESET"

    def __repr__(self) -> str:
        return self.value


class StepKind(str, Enum):
    """What the session runs for a step (the answer to an ``ENTER``)."""

    WARMUP = "warmup"
    REPLAY = "replay"
    PASS = "pass"


_RESUME = "the state the step began in"

TRANSITIONS: dict[tuple[StepState, StepEvent], StepState | str] = {
    **{(s, StepEvent.ENTER_NO_GRAD): StepState.PASSING for s in BETWEEN_STEPS},
    **{(s, StepEvent.RESET): StepState.COLD for s in BETWEEN_STEPS},
    (StepState.COLD, StepEvent.ENTER): StepState.WARMING,
    (StepState.SETTLING, StepEvent.ENTER): StepState.REPLAYING,
    (StepState.SETTLED, StepEvent.ENTER): StepState.REPLAYING,
    (StepState.REPLAYING, StepEvent.OPS_CHANGED): StepState.WARMING,
    (StepState.REPLAYING, StepEvent.OP_RAISED): StepState.REPLAYING,
    (StepState.WARMING, StepEvent.OP_RAISED): StepState.WARMING,
    (StepState.PASSING, StepEvent.OP_RAISED): StepState.PASSING,
    (StepState.WARMING, StepEvent.EXIT): StepState.SETTLING,  # tainted: _RESUME
    (StepState.REPLAYING, StepEvent.EXIT): StepState.SETTLED,  # tainted: _RESUME
    (StepState.PASSING, StepEvent.EXIT): _RESUME,
    **{(s, StepEvent.RAISED): _RESUME
       for s in (StepState.WARMING, StepState.REPLAYING, StepState.PASSING)},
}
"""``(state, event) -> next state``; ``_RESUME``: back to the state the step began in.
A tainted step's ``EXIT`` also resumes (it never becomes a plan). Every pair not listed
is invalid."""


@dataclass
class StepRecord:
    """The step in progress: where it began, what runs it, and whether an op raised.
    The session fills in what it runs the step with (opaque here)."""

    began_in: StepState
    kind: StepKind
    tainted: str | None = None
    """Why the step cannot become a plan (the op that raised), if it cannot."""
    rewarm_reason: str | None = None
    """Why a replay handed this step to a warmup, if it did."""
    executor: Any = None
    """The executor running the step (a warmup after a take-over); None: no grad."""
    mode: Any = None
    """The dispatch mode forwarding the step's ops to ``executor``."""
    token: Any = None
    """The active-session token to restore when the step ends."""
    hooks: tuple[Any, ...] = field(default_factory=tuple)
    """Handles of hooks installed for the step (compiled modules), removed at its end."""
    started: float = 0.0
    """``time.perf_counter()`` when the step began."""


class StepLifecycle:
    """The state machine of the module docstring, with the plan and the counts.

    ``max_warmups``, ``rewarm_on_mismatch``: ``OffloadConfig``'s. Invariants: ``plan`` is
    None exactly in COLD (and in steps that began there); ``step`` is None exactly between
    steps; ``state`` is SETTLED only after a replay ran its plan's ops.
    """

    def __init__(self, *, max_warmups: int, rewarm_on_mismatch: bool, verify: Any = None) -> None:
        self.max_warmups = max_warmups
        self.rewarm_on_mismatch = rewarm_on_mismatch
        self.verify = verify
        """Which steps check their transfers (``runtime.verify.VerifySteps``), if any."""
        self.last_stats: Any = None
        """The ``StepStats`` of the most recent step (also after a failed one)."""
        self.state = StepState.COLD
        self.plan: Any = None
        self.step: StepRecord | None = None
        self.steps = 0
        """Steps that ended without an exception since construction or ``reset()`` (steps
        without grad and discarded ones included)."""
        self.warmups = 0
        """Warmup steps whose trace became the plan (the first and each re-warm)."""
        self.rewarms = 0
        """Replayed steps handed to a warmup because their ops changed."""
        self.replans = 0
        """Plans re-made for larger sizes of the same ops (no re-trace)."""
        self.discarded = 0
        """Steps that never became a plan because an op raised inside them."""

    def __repr__(self) -> str:
        return (f"StepLifecycle({self.state.value}, steps={self.steps}, warmups={self.warmups}, "
                f"rewarms={self.rewarms})")

    # ------------------------------------------------------------------ queries

    @property
    def settled(self) -> bool:
        """Whether a replay ran its plan's ops (at the start of the step in progress)."""
        state = self.step.began_in if self.step is not None else self.state
        return state is StepState.SETTLED

    @property
    def rewarm_allowed(self) -> bool:
        """Whether a replayed step whose ops changed may re-warm (else it raises)."""
        if self.rewarm_on_mismatch:
            return True
        began = self.step.began_in if self.step is not None else self.state
        return began is StepState.SETTLING and self.warmups < self.max_warmups

    # ------------------------------------------------------------------ events

    def enter(self, grad_enabled: bool) -> StepKind:
        """``with session:`` began; returns what runs the step."""
        event = StepEvent.ENTER if grad_enabled else StepEvent.ENTER_NO_GRAD
        began = self.state
        target = self._move(event)
        kind = {StepState.WARMING: StepKind.WARMUP, StepState.REPLAYING: StepKind.REPLAY,
                StepState.PASSING: StepKind.PASS}[target]  # type: ignore[index]
        self.step = StepRecord(began, kind)
        return kind

    def ops_changed(self, reason: str) -> None:
        """A replayed step ran other ops; a warmup takes it over (the caller checked
        :attr:`rewarm_allowed`)."""
        self._move(StepEvent.OPS_CHANGED)
        assert self.step is not None
        self.step.rewarm_reason = reason
        self.rewarms += 1

    def op_raised(self, reason: str) -> None:
        """An op raised inside the step (whether or not the user catches it)."""
        self._move(StepEvent.OP_RAISED)
        assert self.step is not None
        if self.step.tainted is None:
            self.step.tainted = reason

    def exit(self, plan: Any = None, *, replanned: bool = False) -> StepRecord:
        """The block ended without an exception. ``plan``: what a warmup made, or a
        replay re-made for larger sizes (``replanned``); None: the plan stays. A tainted
        step's ``plan`` is dropped. Returns the finished step."""
        step = self._require_step(StepEvent.EXIT)
        if step.tainted is not None:
            self.state = step.began_in
            self.discarded += 1
            self.steps += 1
        else:
            warming = self.state is StepState.WARMING
            if warming and plan is None:
                raise OffloadSessionError(
                    "OffloadSession: a warmup step ended without a plan (state warming, event "
                    "EXIT); this is a bug in the session's bookkeeping, please report it")
            self._move(StepEvent.EXIT)
            if warming:
                self.warmups += 1
            if plan is not None:
                self.plan = plan
                self.replans += int(replanned)
            self.steps += 1
        self.step = None
        return step

    def raised(self) -> StepRecord:
        """An exception left the block: back to where the step began, plan untouched."""
        step = self._require_step(StepEvent.RAISED)
        self.state = step.began_in
        self.step = None
        return step

    def reset(self) -> None:
        """Drop the plan and the counts: the next step with grad warms up."""
        self._move(StepEvent.RESET)
        self.plan = None
        self.steps = self.warmups = self.rewarms = self.replans = self.discarded = 0

    # ------------------------------------------------------------------ internals

    def _require_step(self, event: StepEvent) -> StepRecord:
        if self.step is None or (self.state, event) not in TRANSITIONS:
            self._refuse(event)
        assert self.step is not None
        return self.step

    def _move(self, event: StepEvent) -> StepState:
        target = TRANSITIONS.get((self.state, event))
        if target is None:
            self._refuse(event)
        if target == _RESUME:
            assert self.step is not None
            target = self.step.began_in
        assert isinstance(target, StepState)
        self.state = target
        return target

    def _refuse(self, event: StepEvent) -> None:
        raise OffloadSessionError(
            f"OffloadSession: event {event.value} is not allowed in state {self.state.value} "
            f"(allowed there: {', '.join(e.value for s, e in TRANSITIONS if s is self.state)}). "
            + _FIXES.get(event, "This is a bug in the session's bookkeeping; please report it")
        )


_FIXES = {
    StepEvent.ENTER: "The session is already active and sessions do not nest: finish the "
                     "current `with session:` block first",
    StepEvent.ENTER_NO_GRAD: "The session is already active and sessions do not nest: finish "
                             "the current `with session:` block first",
    StepEvent.RESET: "Call session.reset() between steps, outside the session's own `with` "
                     "block",
    StepEvent.EXIT: "Leave the session only through the `with` block that entered it",
    StepEvent.RAISED: "Leave the session only through the `with` block that entered it",
}
