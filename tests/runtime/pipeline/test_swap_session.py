"""PipelineSwapSession, SwapGroup and the wrappers in one process (no process group).

A one-rank GPipe order drives the session by hand: FWD leaves run a wrapped module in the
chunk's group, swap steps move real storages, backward consumes them.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from hyper_offload.pipeline import SwapOutsideGroupWarning, swap_tensor_wrapper, swap_wrapper
from hyper_offload.passes.pipeline import MetaStep, StepKind, build_rank_orders
from hyper_offload.passes.pipeline.meta_step import SwapPhase
from hyper_offload.runtime.pipeline import GroupState, PipelineSwapSession, SwapStateError
from hyper_offload.runtime.pipeline.session import current_group

MICRO = 5


def _order() -> list[MetaStep]:
    return build_rank_orders("gpipe", num_ranks=1, stages_per_rank=1, num_microbatches=MICRO, swap=True)[0]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _run(order: list[MetaStep], net: nn.Module, session: PipelineSwapSession | None, xs, *, before_bwd=None):
    """Execute a comm-free order by hand; returns the grads."""
    outs: dict[int, torch.Tensor] = {}
    for step in order:
        if step.kind is StepKind.FWD:
            x = xs[step.micro]
            if session is None:
                outs[step.micro] = net(x).square().mean()
                continue
            with session.forward_scope(step, [*net.parameters(), x]):
                loss = net(x).square().mean()
            session.protect(step.chunk, [loss])
            outs[step.micro] = loss
        elif step.kind is StepKind.BWD:
            if before_bwd is not None:
                before_bwd(step)
            outs.pop(step.micro).backward()
            if session is not None:
                session.after_compute(step)
        elif step.is_swap and session is not None:
            session.run_swap_step(step)
    return {n: p.grad.clone() for n, p in net.named_parameters()}


@pytest.fixture
def xs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(16, 8, generator=gen) for _ in range(MICRO)]


def test_swapped_step_is_bit_identical_and_frees_storages(xs) -> None:
    reference = _run(_order(), Net(), None, xs)
    net = swap_wrapper(Net())
    session = PipelineSwapSession(_order(), device="cpu")
    sizes: list[int] = []

    def check(step: MetaStep) -> None:
        if step.micro == 0:  # every chunk from 1 on is offloaded right now
            sizes.extend(session.group((0, m)).resident_bytes() for m in range(2, MICRO - 1))

    session.begin()
    grads = _run(_order(), net, session, xs, before_bwd=check)
    session.end()
    assert all(torch.equal(grads[k], reference[k]) for k in reference)
    assert sizes == [0, 0]
    assert session.live_groups() == [] and session.generation == 1
    assert set(session.group_bytes) == {(0, m) for m in range(MICRO)}


def test_group_names_generations_and_eligible_keys(xs) -> None:
    session = PipelineSwapSession(_order(), device="cpu")
    assert session.eligible == {(0, m) for m in range(MICRO)}
    net = swap_wrapper(Net())
    names = []
    for _ in range(2):
        session.begin()
        step = MetaStep(StepKind.FWD, 0, 3)
        with session.forward_scope(step, []) as group:
            assert current_group() is group
            net(xs[3])
        names.append(group.name)
        session.abort()
    assert names == ["pp_swap_run1_s0_m3", "pp_swap_run2_s0_m3"]
    assert current_group() is None


def test_parameters_inputs_and_aliases_never_swapped_twice(xs) -> None:
    session = PipelineSwapSession(_order(), device="cpu")
    net = Net()
    session.begin()
    x = xs[0]
    with session.forward_scope(MetaStep(StepKind.FWD, 0, 0), [x]) as group:
        assert not swap_tensor_wrapper(net.a.weight) is None
        h = net.a(x)
        swap_tensor_wrapper([h, h.view(-1), {"again": h[:2]}], tag="h")
        swap_tensor_wrapper(x)
    assert group.num_storages == 1 and group.nbytes == h.untyped_storage().nbytes()
    assert group.tags() == ["h"]
    session.abort()


def test_policy_fn_filters_and_protect_removes(xs) -> None:
    session = PipelineSwapSession(_order(), device="cpu")
    net = swap_wrapper(Net(), policy_fn=lambda t: t.shape[-1] == 32)
    session.begin()
    with session.forward_scope(MetaStep(StepKind.FWD, 0, 0), [*net.parameters(), xs[0]]) as group:
        out = net(xs[0])
        swap_tensor_wrapper(out, tag="out")
    # Saved: x (an input: protected; also filtered), a's weight (a parameter), relu's
    # output, which b saves as its input too (one storage). Only relu's output joins.
    relu_bytes = 16 * 32 * 4
    assert group.nbytes - out.untyped_storage().nbytes() == relu_bytes and group.num_storages == 2
    assert group.is_member(out)
    session.protect((0, 0), [out])  # the FWD output is never released
    assert not group.is_member(out) and group.num_storages == 1 and group.nbytes == relu_bytes
    session.abort()


def test_reading_a_swapped_activation_before_wait_load_raises(xs) -> None:
    session = PipelineSwapSession(_order(), device="cpu")
    net = swap_wrapper(Net())
    session.begin()
    step = MetaStep(StepKind.FWD, 0, 0)
    with session.forward_scope(step, [*net.parameters(), xs[0]]):
        loss = net(xs[0]).square().mean()
    session.protect((0, 0), [loss])
    for kind in (StepKind.SWAP_LAUNCH_OFFLOAD, StepKind.SWAP_WAIT_OFFLOAD):
        session.run_swap_step(MetaStep(kind, 0, 0))
    with pytest.raises(SwapStateError, match="pp_swap_run1_s0_m0.*OFFLOADED.*SWAP_WAIT_LOAD"):
        loss.backward(retain_graph=True)
    session.run_swap_step(MetaStep(StepKind.SWAP_LAUNCH_LOAD, 0, 0))
    with pytest.raises(SwapStateError, match="still loading"):
        loss.backward(retain_graph=True)
    with pytest.raises(SwapStateError, match="wait_offload needs state OFFLOADING, found LOADING"):
        session.run_swap_step(MetaStep(StepKind.SWAP_WAIT_OFFLOAD, 0, 0))
    session.run_swap_step(MetaStep(StepKind.SWAP_WAIT_LOAD, 0, 0))
    loss.backward()  # after WAIT_LOAD the same graph runs
    session.abort()


def test_abort_pages_offloaded_bytes_back_and_returns_host_buffers(xs) -> None:
    session = PipelineSwapSession(_order(), device="cpu")
    net = swap_wrapper(Net())
    session.begin()
    with session.forward_scope(MetaStep(StepKind.FWD, 0, 1), [*net.parameters(), xs[1]]) as group:
        loss = net(xs[1]).square().mean()
    session.protect((0, 1), [loss])
    session.run_swap_step(MetaStep(StepKind.SWAP_LAUNCH_OFFLOAD, 0, 1))
    session.run_swap_step(MetaStep(StepKind.SWAP_WAIT_OFFLOAD, 0, 1))
    assert group.resident_bytes() == 0
    assert session.abort() == []
    assert group.state is GroupState.CLOSED and session.live_groups() == []
    assert session.manager.pool.stats().pinned_bytes_in_use == 0
    loss.backward()  # bytes are back: the backward runs (and would crash if they were not)


def test_end_with_unconsumed_group_raises_and_cleans(xs) -> None:
    session = PipelineSwapSession(_order(), device="cpu")
    session.begin()
    with session.forward_scope(MetaStep(StepKind.FWD, 0, 0), []):
        pass
    with pytest.raises(SwapStateError, match="still open at the end"):
        session.end()
    assert session.live_groups() == []
    session.begin()  # a new generation starts cleanly


def test_no_window_chunks_get_no_group_and_wrappers_stay_silent(xs) -> None:
    order = build_rank_orders("gpipe", num_ranks=1, stages_per_rank=1, num_microbatches=2, swap=True)[0]
    session = PipelineSwapSession(order, device="cpu")
    assert session.eligible == frozenset()
    session.begin()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with session.forward_scope(MetaStep(StepKind.FWD, 0, 0), []) as group:
            assert group is None
            swap_tensor_wrapper(xs[0])
    session.end()


def test_swap_tensor_wrapper_outside_a_group_warns_once_and_returns_input(xs) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            assert swap_tensor_wrapper(xs[0], tag="t") is xs[0]
    assert [w.category for w in caught] == [SwapOutsideGroupWarning]


def test_wrapper_argument_errors() -> None:
    with pytest.raises(TypeError, match="group_swap must be a bool"):
        swap_wrapper(Net(), group_swap="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="policy_fn must be callable"):
        swap_wrapper(Net(), policy_fn=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nn.Module or a callable"):
        swap_wrapper(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tag must be a str"):
        swap_tensor_wrapper(torch.ones(1), tag=3)  # type: ignore[arg-type]


def test_forward_only_orders_cannot_swap() -> None:
    order = [MetaStep(StepKind.FWD, 0, 0), MetaStep(StepKind.SWAP_LAUNCH_OFFLOAD, 0, 0)]
    with pytest.raises(ValueError, match="forward-only orders cannot swap"):
        PipelineSwapSession(order, device="cpu")


def test_nested_scopes_restore_the_outer_group(xs) -> None:
    session = PipelineSwapSession(_order(), device="cpu")
    session.begin()
    with session.forward_scope(MetaStep(StepKind.FWD, 0, 0), []) as outer:
        with session.forward_scope(MetaStep(StepKind.FWD, 0, 1), []) as inner:
            assert current_group() is inner
        assert current_group() is outer
    session.abort()


def test_saved_outputs_die_with_the_backward_without_the_cyclic_gc() -> None:
    """sigmoid saves its *output*; holding it with its grad_fn in the pack hook would form a
    reference cycle, and the chunk's activations would outlive its backward (seen as a
    higher peak with dx/dw-split schedules on a GPT)."""
    import gc

    session = PipelineSwapSession(_order(), device="cpu")
    fn = swap_wrapper(lambda t: torch.sigmoid(t * 2).sum())
    x = torch.randn(64, 64, requires_grad=True)
    gc.disable()
    try:
        session.begin()
        with session.forward_scope(MetaStep(StepKind.FWD, 0, 0), [x]) as group:
            loss = fn(x)
        session.protect((0, 0), [loss])
        refs = [m.ref for m in group._members.values()]
        assert refs and all(r() is not None for r in refs)
        for kind in (StepKind.SWAP_LAUNCH_OFFLOAD, StepKind.SWAP_WAIT_OFFLOAD,
                     StepKind.SWAP_LAUNCH_LOAD, StepKind.SWAP_WAIT_LOAD):
            session.run_swap_step(MetaStep(kind, 0, 0))
        # Keep the graph through the backward, as dx/dw split does (BWD_INPUT retains it
        # for BWD_WEIGHT); dropping it afterwards must free the activations at once.
        loss.backward(retain_graph=True)
        session.after_compute(MetaStep(StepKind.BWD, 0, 0))
        del loss
        assert all(r() is None for r in refs), "a saved activation outlived its graph"
        session.abort()
    finally:
        gc.enable()


def test_wrapped_module_keeps_names_and_survives_deepcopy(xs) -> None:
    import copy

    from hyper_offload.pipeline.schedule import SwapWrapped

    net = Net()
    names = [n for n, _ in net.named_parameters()]
    wrapped = swap_wrapper(net)
    assert wrapped is net and isinstance(net, (SwapWrapped, Net))
    assert [n for n, _ in net.named_parameters()] == names
    clone = copy.deepcopy(net)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(2)
    assert not torch.equal(clone(xs[0]), net(xs[0]))  # the copy runs its own parameters
    session = PipelineSwapSession(_order(), device="cpu")
    session.begin()
    with session.forward_scope(MetaStep(StepKind.FWD, 0, 0), [*clone.parameters(), xs[0]]) as group:
        clone(xs[0])
    assert group.num_storages == 1  # relu's output (b's input): the copy still collects
    session.abort()


def test_the_dw_state_is_what_survives_bwd_input_plus_its_gradients_and_moves_whole() -> None:
    """After BWD_INPUT the group keeps the storages something else still holds (the
    retained graph), drops the ones only its bindings kept, adds the intermediate
    gradients, never the protected input gradient; DW_* steps move them and give the
    same bytes back; reading one while it is away raises."""
    from hyper_offload.runtime.pipeline import SwapGroup

    session = PipelineSwapSession(_order(), device="cpu")
    group = SwapGroup("dw_test", (0, 0), session.manager, iter(range(100)), device=torch.device("cpu"))
    retained = torch.arange(64, dtype=torch.float32)  # still referenced: the retained graph
    freed = torch.ones(256)  # referenced by nothing but the group after BWD_INPUT
    assert group.add(retained) and group.add(freed)
    del freed
    grad = torch.full((16,), 3.0)  # a gradient at a weight-path intermediate
    sent = torch.full((8,), 2.0)  # the input gradient being sent: protected
    group.hold_weight_state([grad, sent], protected=[sent])
    assert group.state is GroupState.HELD
    assert group.is_member(retained) and group.is_member(grad) and not group.is_member(sent)
    assert group.num_storages == 2 and group.resident_bytes() == (64 + 16) * 4
    expected = (retained.clone(), grad.clone())
    group.launch_offload(SwapPhase.WEIGHT_STATE)
    group.wait_offload(SwapPhase.WEIGHT_STATE)
    assert group.resident_bytes() == 0 and sent.untyped_storage().nbytes() == 8 * 4
    with pytest.raises(SwapStateError, match="DW_OFFLOADED"):
        group.check_readable(retained, "test")
    group.launch_load(SwapPhase.WEIGHT_STATE)
    group.wait_load(SwapPhase.WEIGHT_STATE)
    assert torch.equal(retained, expected[0]) and torch.equal(grad, expected[1])
    assert (group.d2h_copies, group.h2d_copies) == (2, 2)
    group.close()
    assert group.state is GroupState.CLOSED and session.manager.host_bytes() == 0
