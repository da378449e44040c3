"""The eager step lifecycle as a table (:mod:`hyper_offload.eager.lifecycle`): one test
per transition, one per refused pair, and the rules the table encodes. Structure only:
no model, no torch op; the plan is an opaque object."""

from __future__ import annotations

import itertools

import pytest

from hyper_offload.eager.lifecycle import (
    BETWEEN_STEPS,
    TRANSITIONS,
    StepEvent,
    StepKind,
    StepLifecycle,
    StepState,
)
from hyper_offload.errors import OffloadSessionError

S, E = StepState, StepEvent
PLAN, OTHER_PLAN = object(), object()


def _lifecycle(**kwargs: object) -> StepLifecycle:
    return StepLifecycle(**{"max_warmups": 3, "rewarm_on_mismatch": False, **kwargs})


def _drive(state: StepState, life: StepLifecycle | None = None) -> StepLifecycle:
    """A lifecycle brought to ``state`` by valid events only."""
    life = life or _lifecycle()
    path = {
        S.COLD: [],
        S.SETTLING: [("enter", True), ("exit", PLAN)],
        S.SETTLED: [("enter", True), ("exit", PLAN), ("enter", True), ("exit", None)],
        S.WARMING: [("enter", True)],
        S.REPLAYING: [("enter", True), ("exit", PLAN), ("enter", True)],
        S.PASSING: [("enter", True), ("exit", PLAN), ("enter", False)],
    }[state]
    for name, argument in path:
        getattr(life, name)(argument)
    assert life.state is state
    return life


def _fire(life: StepLifecycle, event: StepEvent) -> None:
    {
        E.ENTER: lambda: life.enter(True),
        E.ENTER_NO_GRAD: lambda: life.enter(False),
        E.OPS_CHANGED: lambda: life.ops_changed("op 3 differs"),
        E.OP_RAISED: lambda: life.op_raised("op 3 raised"),
        E.EXIT: lambda: life.exit(PLAN if life.state is S.WARMING else None),
        E.RAISED: lambda: life.raised(),
        E.RESET: life.reset,
    }[event]()


@pytest.mark.parametrize("state, event", sorted(TRANSITIONS), ids=lambda v: v.value)
def test_each_transition(state: StepState, event: StepEvent) -> None:
    life = _drive(state)
    began = life.step.began_in if life.step is not None else state
    _fire(life, event)
    target = TRANSITIONS[state, event]
    expected = target if isinstance(target, StepState) else began
    assert life.state is expected
    assert (life.plan is None) is (expected is S.COLD or (
        expected in (S.WARMING, S.PASSING) and began is S.COLD))
    assert (life.step is None) is (expected in BETWEEN_STEPS)


INVALID = [(s, e) for s, e in itertools.product(StepState, StepEvent) if (s, e) not in TRANSITIONS]


@pytest.mark.parametrize("state, event", INVALID, ids=lambda v: v.value)
def test_each_invalid_pair_is_refused_naming_state_event_and_fix(state, event) -> None:
    life = _drive(state)
    before = (life.state, life.plan, life.step)
    with pytest.raises(OffloadSessionError) as info:
        _fire(life, event)
    message = str(info.value)
    assert f"event {event.value} is not allowed in state {state.value}" in message
    fix = {E.ENTER: "finish the current", E.ENTER_NO_GRAD: "finish the current",
           E.RESET: "between steps", E.EXIT: "through the `with` block",
           E.RAISED: "through the `with` block"}.get(event, "please report it")
    assert "allowed there:" in message and fix in message
    assert (life.state, life.plan, life.step) == before  # nothing changed


def test_the_table_covers_every_state_and_event() -> None:
    assert {s for s, _ in TRANSITIONS} == set(StepState)
    assert {e for _, e in TRANSITIONS} == set(StepEvent)
    assert all(isinstance(s, str) and isinstance(e, str) for s, e in TRANSITIONS)


# ----------------------------------------------------------------- rules


def test_a_warmup_exit_makes_the_plan_and_a_replay_exit_settles() -> None:
    life = _lifecycle()
    assert life.enter(True) is StepKind.WARMUP
    life.exit(PLAN)
    assert (life.state, life.plan, life.warmups, life.steps) == (S.SETTLING, PLAN, 1, 1)
    assert life.enter(True) is StepKind.REPLAY and not life.settled
    life.exit(None)
    assert (life.state, life.plan, life.settled) == (S.SETTLED, PLAN, True)


def test_a_replay_remade_for_larger_sizes_replaces_the_plan() -> None:
    life = _drive(S.REPLAYING)
    life.exit(OTHER_PLAN, replanned=True)
    assert (life.plan, life.replans, life.state) == (OTHER_PLAN, 1, S.SETTLED)


@pytest.mark.parametrize("start", sorted(BETWEEN_STEPS))
def test_a_step_without_grad_never_replans(start: StepState) -> None:
    life = _drive(start)
    plan, counts = life.plan, (life.warmups, life.rewarms, life.replans, life.discarded)
    assert life.enter(False) is StepKind.PASS
    life.exit()
    assert (life.state, life.plan) == (start, plan)
    assert (life.warmups, life.rewarms, life.replans, life.discarded) == counts


@pytest.mark.parametrize("start", [S.WARMING, S.REPLAYING, S.PASSING])
@pytest.mark.parametrize("how", ["raised", "tainted"])
def test_a_failed_or_tainted_step_never_becomes_a_plan(start: StepState, how: str) -> None:
    life = _drive(start)
    began, plan = life.step.began_in, life.plan
    if how == "raised":
        life.raised()
    else:
        life.op_raised("op 7 (aten.mm) raised RuntimeError")
        record = life.exit(OTHER_PLAN)
        assert record.tainted is not None
    assert (life.state, life.plan) == (began, plan)
    assert life.step is None


def test_ops_changed_re_warms_within_max_warmups_then_refuses() -> None:
    life = _lifecycle(max_warmups=2)
    life.enter(True)
    life.exit(PLAN)
    life.enter(True)
    assert life.rewarm_allowed  # settling, 1 warmup of 2
    life.ops_changed("branch")
    assert life.state is S.WARMING and life.step.rewarm_reason == "branch"
    life.exit(OTHER_PLAN)
    assert (life.plan, life.warmups, life.rewarms, life.state) == (OTHER_PLAN, 2, 1, S.SETTLING)
    life.enter(True)
    assert not life.rewarm_allowed  # 2 warmups of 2: strict, the replay raises


def test_settled_is_strict_unless_rewarm_on_mismatch() -> None:
    assert not _drive(S.SETTLED).rewarm_allowed
    life = _drive(S.SETTLED, _lifecycle(rewarm_on_mismatch=True))
    life.enter(True)
    assert life.rewarm_allowed and life.settled  # settled as the step began
    life.ops_changed("layer unfrozen")
    life.exit(OTHER_PLAN)
    assert life.state is S.SETTLING and not life.settled


def test_reset_drops_plan_and_counts() -> None:
    life = _drive(S.SETTLED)
    life.reset()
    assert (life.state, life.plan, life.steps, life.warmups) == (S.COLD, None, 0, 0)
