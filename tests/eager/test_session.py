"""OffloadSession lifecycle: phases, nesting, mismatch, exceptions, reset, no leaks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.eager import OffloadSessionError, ReplayMismatchError, current_session
from hyper_offload.config import MIB
from hyper_offload.runtime import DeviceMemoryMeter

from .models import CASES, assert_same_state, make_pair, train_step

# Strict from the first replay (max_warmups=1): these tests pin the mismatch errors; the
# session's settling (re-warming by itself until two steps agree) has its own tests.
TIGHT = OffloadConfig(max_resident_activation_mb=16 * 1024 / MIB, max_warmups=1)


def _pool_idle(session: OffloadSession) -> None:
    stats = session.pool.stats()
    assert stats.pinned_bytes_in_use == 0 and stats.pageable_bytes_in_use == 0
    assert stats.buffers_in_use == 0
    assert len(session.manager) == 0 and session.manager.transfers_in_flight() == 0


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.extra:
            h = torch.tanh(h) * 2
        return self.b(h).pow(2).mean()


def test_phases_trace_schedule_and_stats() -> None:
    model, _, x = make_pair(CASES["mlp"], torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = OffloadSession(TIGHT)
    assert session.phase == "warmup" and session.trace is None and session.schedule is None
    with session as entered:
        assert entered is session and current_session() is session and session.active
        train_step(model, x, opt, 0)
    assert current_session() is None and not session.active
    assert session.phase == "replay" and session.steps == 1
    trace, schedule, report = session.trace, session.schedule, session.report
    # The trace ends with the step-end op (where retained storages are reloaded).
    assert trace.num_ops - 1 == schedule.num_ops - 1 == session.last_stats.ops > 0
    assert report.ok and trace.budget_bytes == TIGHT.budget_bytes
    assert len(session.op_guide) == trace.num_ops
    assert session.last_stats.phase == "warmup" and session.last_stats.evictions > 0
    with session:
        train_step(model, x, opt, 1)
    stats = session.last_stats
    assert stats.phase == "replay" and stats.transfers == report.num_transfers
    assert stats.pool is not None and stats.pool.buffers_in_use == 0
    session.reset()
    assert session.phase == "warmup" and session.trace is None


def test_sessions_do_not_nest() -> None:
    first, second = OffloadSession(TIGHT), OffloadSession(TIGHT)
    with first:
        with pytest.raises(OffloadSessionError, match="already active"):
            with first:
                pass
        with pytest.raises(OffloadSessionError, match="another session"):
            with second:
                pass
        with pytest.raises(OffloadSessionError, match="between steps"):
            first.reset()
    assert current_session() is None
    with second:  # both usable afterwards
        torch.ones(3).sum()


def test_config_is_validated() -> None:
    with pytest.raises(TypeError, match="rewarm_on_mismatch"):
        OffloadConfig(rewarm_on_mismatch="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="OffloadConfig"):
        OffloadSession({"max_resident_activation_mb": 1})  # type: ignore[arg-type]
    assert OffloadConfig().rewarm_on_mismatch is False


def _warm(model: nn.Module, x: torch.Tensor, session: OffloadSession) -> None:
    model.zero_grad(set_to_none=True)  # else step 2 accumulates (add_) where step 1 created
    with session:
        model(x).backward()


def test_branch_mismatch_names_op_and_leaf_counts() -> None:
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(64, 32)
    session = OffloadSession(TIGHT)
    _warm(model, x, session)
    model.extra = True
    with pytest.raises(ReplayMismatchError) as info:
        _warm(model, x, session)
    message = str(info.value)
    expected_index = next(
        i for i, op in enumerate(session.trace.ops) if "tanh" in op.name or i > 100
    ) if any("tanh" in op.name for op in session.trace.ops) else None
    assert expected_index is None  # warmup never ran tanh
    assert "replay op" in message and "aten.tanh.default" in message
    assert "output leaves" in message and "warmup recorded" in message
    _pool_idle(session)
    # Without a reset the session keeps raising; after reset() it warms up again.
    session.reset()
    _warm(model, x, session)
    _warm(model, x, session)
    assert session.phase == "replay"


def test_the_same_ops_with_other_sizes_replay_and_plan_again_for_larger_ones() -> None:
    """Issue 33: other sizes are no mismatch. Smaller ones run the plan as it is; a
    larger one evicts online and the plan is remade for it (no re-warm)."""
    torch.manual_seed(0)
    model = Branchy()
    session = OffloadSession(TIGHT)
    _warm(model, torch.randn(64, 32), session)
    _warm(model, torch.randn(32, 32), session)
    assert session.last_stats.phase == "replay" and session.replans == 0
    assert session.last_stats.evictions == 0
    planned = session.trace
    _warm(model, torch.randn(96, 32), session)
    assert session.last_stats.phase == "replay" and session.replans == 1
    assert session.last_stats.evictions > 0  # the larger step made room online
    assert [op.name for op in session.trace.ops] == [op.name for op in planned.ops]
    assert sum(session.trace.storage_sizes.values()) > sum(planned.storage_sizes.values())
    _warm(model, torch.randn(96, 32), session)
    assert session.replans == 1 and session.last_stats.evictions == 0  # planned for it
    assert session.rewarms == 0
    _pool_idle(session)


def test_shorter_step_is_reported() -> None:
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(64, 32)
    session = OffloadSession(TIGHT)
    _warm(model, x, session)
    with pytest.raises(ReplayMismatchError, match="ended after"):
        with session:
            model(x)  # forward only
    _pool_idle(session)


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("phase", ["warmup", "replay"])
def test_exception_cleans_up_and_propagates(where: str, phase: str) -> None:
    model, ref, x = make_pair(CASES["mlp"], torch.float32, input_shape=(128, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    session = OffloadSession(TIGHT)
    boom, armed = Boom("injected"), [False]

    def fail(*_: object) -> None:
        if armed[0]:
            raise boom

    # Registered before warmup: a full backward hook adds ops of its own to every step.
    layer = model.layers[2]
    handle = (
        layer.register_forward_hook(fail)
        if where == "forward"
        else layer.register_full_backward_hook(fail)
    )
    ref_layer = ref.layers[2]
    ref_handle = (
        ref_layer.register_forward_hook(fail)
        if where == "forward"
        else ref_layer.register_full_backward_hook(fail)
    )
    if phase == "replay":
        with session:
            train_step(model, x, opt, 0)
    armed[0] = True
    with pytest.raises(Boom) as info:
        with session:
            train_step(model, x, opt, 1)
    armed[0] = False
    assert info.value is boom  # propagated unchanged
    assert session.last_stats is not None and session.last_stats.bytes_d2h > 0
    _pool_idle(session)
    del handle, ref_handle
    # Usable again after reset(): warmup + replay give the plain results.
    session.reset()
    for step in range(3):
        with session:
            loss = train_step(model, x, opt, 10 + step)
        ref_loss = train_step(ref, x, ref_opt, 10 + step)
        assert torch.equal(loss, ref_loss)
        assert_same_state(model, ref, f"after {where} exception in {phase}, step {step}")
        opt.step()
        ref_opt.step()


def test_keeping_an_activation_its_warmup_saw_freed_keeps_its_bytes() -> None:
    """A forward hook keeps an activation the warmup saw die. The plan's drop of its
    bytes waits until nothing references it: the replay keeps them (on the host, so the
    device stays as planned) and pages them back at the end; the tensor is intact (it
    used to be a 0-byte storage and an ``OffloadSessionError``)."""
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(64, 32)
    session = OffloadSession(TIGHT)
    _warm(model, x, session)
    kept: list[torch.Tensor] = []
    handle = model.a.register_forward_hook(lambda m, i, o: kept.append(o))
    _warm(model, x, session)
    handle.remove()
    assert torch.equal(kept[0], model.a(x))
    assert session.last_stats.rescued >= 1 and session.last_stats.phase == "replay"
    _pool_idle(session)


def test_hundred_replay_steps_do_not_leak() -> None:
    model, _, x = make_pair(CASES["mlp"], torch.float32, input_shape=(64, 32))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    session = OffloadSession(TIGHT)
    with session:
        train_step(model, x, opt, 0)
    peaks, pools, curves = set(), set(), set()
    for step in range(100):
        meter = DeviceMemoryMeter("cpu")
        with meter:
            with session:
                train_step(model, x, opt, step)
        opt.step()
        stats = session.pool.stats()
        peaks.add(meter.peak_bytes)
        curves.add(tuple(meter.curve()))
        pools.add((stats.pinned_bytes_held, stats.pageable_bytes_in_use, stats.buffers_in_use))
        assert len(session.manager) == 0
    assert len(peaks) == 1 and len(curves) == 1, "meter figures drift across steps"
    assert len(pools) == 1, f"host pool grows across steps: {sorted(pools)}"
    assert session.steps == 101 and session.last_stats.demand_loads == 0


def _plain_grads(model: Branchy, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    ref = copy.deepcopy(model)
    loss = ref(x)
    loss.backward()
    return loss, [p.grad for p in ref.parameters()]


def test_rewarm_on_mismatch_replans_transparently() -> None:
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(64, 32)
    session = OffloadSession(
        OffloadConfig(max_resident_activation_mb=TIGHT.max_resident_activation_mb, rewarm_on_mismatch=True)
    )
    _warm(model, x, session)
    first_trace = session.trace
    for extra, rewarms in ((True, 1), (True, 1), (False, 2), (False, 2)):
        model.extra = extra
        expected_loss, expected_grads = _plain_grads(model, x)
        model.zero_grad(set_to_none=True)
        with session:
            loss = model(x)
            loss.backward()
        assert session.rewarms == rewarms, (extra, session.rewarms)
        assert torch.equal(loss, expected_loss)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected_grads))
        _pool_idle(session)
    assert session.phase == "replay" and session.trace.num_ops == first_trace.num_ops
    assert session.last_stats.phase == "replay" and session.last_stats.demand_loads == 0


def test_a_step_without_grad_leaves_the_plan_as_it_was() -> None:
    """Evaluation under ``no_grad`` inside the session runs untraced: no re-warm, no
    re-plan (it used to re-warm with ``rewarm_on_mismatch`` and replace the training
    step's plan by the forward's)."""
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(64, 32)
    session = OffloadSession(
        OffloadConfig(max_resident_activation_mb=TIGHT.max_resident_activation_mb, rewarm_on_mismatch=True)
    )
    _warm(model, x, session)
    plan, state = session._plan, session.state
    with torch.no_grad(), session:
        out = model(x)  # evaluation: forward only, under no_grad
    assert torch.equal(out, model(x))
    assert session.rewarms == 0 and session._plan is plan and session.state is state
    assert session.last_stats.phase == "pass"
    _warm(model, x, session)
    assert session.last_stats.phase == "replay" and session.rewarms == 0
    _pool_idle(session)


def test_backward_outside_the_session() -> None:
    """Forward inside, backward after the block: what the graph saved stays resident."""
    model, ref, x = make_pair(CASES["mlp"], torch.float32, input_shape=(128, 32))
    session = OffloadSession(TIGHT)
    for step in range(3):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        with session:
            loss = model(x)
        loss.backward()
        torch.manual_seed(step)
        ref_loss = ref(x)
        ref_loss.backward()
        assert torch.equal(loss, ref_loss)
        assert_same_state(model, ref, f"backward outside, step {step}")
    _pool_idle(session)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_optimizer_step_inside_the_session(optimizer: str) -> None:
    """The first opt.step() creates optimizer state (other ops than later steps): without
    re-warming, step 2 is reported as a mismatch; with it, step 2 re-plans once."""
    model, ref, x = make_pair(CASES["mlp"], torch.float32, input_shape=(128, 32))

    def make(params):  # type: ignore[no-untyped-def]
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.01, momentum=0.9)
        return torch.optim.Adam(params, lr=1e-3)

    strict_model = copy.deepcopy(model)
    strict_opt = make(strict_model.parameters())
    strict = OffloadSession(TIGHT)
    with strict:
        train_step(strict_model, x, strict_opt, 0)
        strict_opt.step()
    with pytest.raises(ReplayMismatchError):
        with strict:
            train_step(strict_model, x, strict_opt, 1)
            strict_opt.step()
    _pool_idle(strict)

    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    session = OffloadSession(
        OffloadConfig(max_resident_activation_mb=TIGHT.max_resident_activation_mb, rewarm_on_mismatch=True)
    )
    for step in range(4):
        with session:
            loss = train_step(model, x, opt, step)
            opt.step()
        ref_loss = train_step(ref, x, ref_opt, step)
        ref_opt.step()
        assert torch.equal(loss, ref_loss)
        assert_same_state(model, ref, f"{optimizer} inside the session, step {step}")
    assert session.rewarms == 1 and session.last_stats.phase == "replay"
    _pool_idle(session)


def test_a_warmup_executor_is_freed_without_a_garbage_collection() -> None:
    """The executor and its tracker form no reference cycle (the tracker holds the
    executor's free callback weakly): its manager and host buffers go by reference
    counting. A cycle kept them until a collection, which at interpreter exit ran after
    the process group was destroyed, and gloo aborted the process (measured: 6 of 8
    runs of ``examples/train_tp.py --spawn --door eager``, 0 of 8 without the cycle)."""
    import gc
    import weakref

    from hyper_offload.eager.warmup import WarmupExecutor
    from hyper_offload.passes import GreedyResidencyPlanner
    from hyper_offload.runtime import PinnedMemoryPool, ResidencyManager, TransferEngine

    gc.disable()
    try:
        manager = ResidencyManager(TransferEngine("cpu"), PinnedMemoryPool(1 << 20))
        executor = WarmupExecutor(manager, torch.device("cpu"), budget_bytes=0,
                                  planner=GreedyResidencyPlanner())
        freed = weakref.ref(executor)
        del executor
        assert freed() is None
    finally:
        gc.enable()
