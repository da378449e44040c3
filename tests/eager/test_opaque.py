"""Opaque regions: ``skip_offload`` functions and compiled callables as one virtual op."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.common import aot_autograd

from hyper_offload import OffloadConfig, OffloadSession, skip_offload
from hyper_offload.config import MIB
from hyper_offload.eager.opaque import is_compiled, opaque_name

_no_op = contextlib.nullcontext
TIGHT = OffloadConfig(max_resident_activation_mb=8 * 1024 / MIB)
CALLS: list[str] = []


@skip_offload
def inner(h: torch.Tensor) -> torch.Tensor:
    CALLS.append("inner")
    return torch.sigmoid(h) + h


@skip_offload
def block(x: torch.Tensor, w: torch.Tensor, *, scale: float = 2.0) -> torch.Tensor:
    CALLS.append("block")
    return inner(torch.tanh(x @ w)) * scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(32, 32)
        self.w = nn.Parameter(torch.randn(32, 32) * 0.1)
        self.l2 = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.l1(x))
        h = block(h, self.w)
        h = block(h, self.w, scale=0.5)  # the same function twice
        h.add_(1)  # in-place on a region output works as without the session
        return self.l2(h).pow(2).mean()


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    return loss


def _same_grads(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))


def test_region_is_one_virtual_op_forward_and_backward() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randn(64, 32)
    ref = copy.deepcopy(model)
    session = OffloadSession(TIGHT)
    for step in range(3):
        CALLS.clear()
        with session:
            loss = _step(model, x)
        assert CALLS == ["block", "inner", "block", "inner"]  # nested calls run inside
        assert torch.equal(loss, _step(ref, x)) and _same_grads(model, ref), f"step {step}"
        assert session.last_stats.bytes_d2h > 0
    names = [op.name for op in session.trace.ops]
    fwd, bwd = opaque_name(block.__wrapped__), opaque_name(block.__wrapped__) + ".backward"
    assert names.count(fwd) == 2 and names.count(bwd) == 2
    assert not any("tanh" in n or "sigmoid" in n for n in names), "region internals were traced"
    # The forward region reads its inputs and creates its output; the backward region
    # reads the output gradient and the region's tracked input.
    # It also holds what its own ops saved (tanh's and sigmoid's outputs: one virtual
    # storage, .region_saved) from its forward to its backward.
    first = session.trace.ops[names.index(fwd)]
    (held,) = [sid for sid in first.storages if sid in session.region_holds]
    assert len(first.outputs) == 1 and len(first.accesses) == 3
    back = session.trace.ops[names.index(bwd)]
    assert len(back.outputs) == 2  # gradients for x and w
    assert held in back.storages and session.region_holds[held] > 0


def test_outside_a_session_it_is_a_plain_call() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(4, 32, requires_grad=True), torch.randn(32, 32)
    CALLS.clear()
    out = block(x, w)
    assert torch.equal(out, (torch.sigmoid(torch.tanh(x @ w)) + torch.tanh(x @ w)) * 2.0)
    out.sum().backward()
    assert x.grad is not None and CALLS == ["block", "inner"]


def test_region_without_grad_inputs_and_non_tensor_outputs() -> None:
    @skip_offload
    def stats(x: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
        return x.mean(dim=0), 3, x.argmax(dim=1)

    lin = nn.Linear(8, 8)
    x = torch.randn(16, 8)
    session = OffloadSession(TIGHT)
    for _ in range(2):
        lin.zero_grad(set_to_none=True)
        with session:
            mean, three, idx = stats(lin(x))
            assert three == 3 and idx.dtype == torch.int64 and not idx.requires_grad
            mean.sum().backward()
        expected = torch.ones(8, 8) * x.mean(0).unsqueeze(0).T.expand(8, 8).T.mean(0)
        assert lin.weight.grad is not None and lin.weight.grad.shape == expected.shape


def _counting_backend(counts: dict[str, int]):  # type: ignore[no-untyped-def]
    def compiler(kind: str):  # type: ignore[no-untyped-def]
        def compile_graph(gm: torch.fx.GraphModule, _: object):  # type: ignore[no-untyped-def]
            def run(args: list[object]) -> object:
                counts[kind] += 1
                return gm(*args)

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        return compile_graph

    return aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))


class Host(nn.Module):
    def __init__(self, inner_block: nn.Module, *, opaque: bool) -> None:
        super().__init__()
        self.pre = nn.Linear(32, 32)
        self.block = inner_block
        self.post = nn.Linear(32, 1)
        self.run_block = skip_offload(inner_block) if opaque else inner_block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.run_block(F.gelu(self.pre(x)))).pow(2).mean()


def test_compiled_submodule_keeps_its_compiled_code() -> None:
    torch._dynamo.reset()
    counts = {"fw": 0, "bw": 0}
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    compiled = torch.compile(body, backend=_counting_backend(counts))
    assert is_compiled(compiled)
    torch.manual_seed(1)
    model = Host(compiled, opaque=True)
    torch.manual_seed(1)
    ref = Host(copy.deepcopy(body), opaque=False)  # plain eager
    x = torch.randn(64, 32)
    session = OffloadSession(TIGHT)
    for step in range(3):
        before = dict(counts)
        with session:
            loss = _step(model, x)
        # The compiled forward and backward really ran (once each) inside the session.
        assert counts["fw"] == before["fw"] + 1 and counts["bw"] == before["bw"] + 1, counts
        assert torch.equal(loss, _step(ref, x)) and _same_grads(model, ref), f"step {step}"
    assert sum("opaque:" in op.name for op in session.trace.ops) == 2


def test_compiled_module_is_detected_without_skip_offload() -> None:
    """A compiled submodule called plainly inside the session is detected and still runs
    its compiled forward and backward, as one virtual op each way."""
    torch._dynamo.reset()
    counts = {"fw": 0, "bw": 0}
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    torch.manual_seed(1)
    model = Host(torch.compile(body, backend=_counting_backend(counts)), opaque=False)
    torch.manual_seed(1)
    ref = Host(copy.deepcopy(body), opaque=False)
    x = torch.randn(64, 32)
    session = OffloadSession(TIGHT)
    for step in range(3):
        before = dict(counts)
        with pytest.warns(UserWarning, match="global hooks") if step == 0 else _no_op():
            with session:
                loss = _step(model, x)
        assert counts["fw"] == before["fw"] + 1 and counts["bw"] == before["bw"] + 1, counts
        assert torch.equal(loss, _step(ref, x)) and _same_grads(model, ref), f"step {step}"
    names = [op.name for op in session.trace.ops]
    assert sum(n.startswith("opaque:") for n in names) == 2, names
    assert session.last_stats.bytes_d2h > 0


def test_plain_dispatch_mode_bypasses_compiled_code() -> None:
    """The torch behaviour the hooks exist for (TORCH_NOTES): under a dispatch mode a
    compiled module runs its Python. If torch changes this, the hooks can go."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    torch._dynamo.reset()
    counts = {"fw": 0, "bw": 0}
    compiled = torch.compile(nn.Linear(32, 32), backend=_counting_backend(counts))
    with Passthrough():
        compiled(torch.randn(4, 32)).sum().backward()
    assert counts == {"fw": 0, "bw": 0}


@pytest.mark.parametrize("reentrant", [False, True], ids=["checkpoint", "reentrant-checkpoint"])
@pytest.mark.parametrize("budget_kib", [4, 1 << 20])
def test_custom_function_and_checkpoint_inside_session(budget_kib: int, reentrant: bool) -> None:
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            (x,) = ctx.saved_tensors
            return 2 * x * g

    torch.manual_seed(0)
    lin = nn.Linear(32, 32)
    ref = copy.deepcopy(lin)
    x = torch.randn(64, 32)

    def run(m: nn.Module) -> torch.Tensor:
        m.zero_grad(set_to_none=True)
        h = Square.apply(m(x))
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(t) * t, h, use_reentrant=reentrant)
        loss = Square.apply(h).mean()
        loss.backward()
        return loss

    session = OffloadSession(OffloadConfig(max_resident_activation_mb=budget_kib / 1024))
    for _ in range(3):
        with session:
            loss = run(lin)
        assert torch.equal(loss, run(ref)) and torch.equal(lin.weight.grad, ref.weight.grad)


def test_region_reading_an_offloaded_activation_through_a_closure() -> None:
    """A read the trace cannot see (a closure inside a region) of a storage the plan has
    offloaded: the guard pages it back instead of reading 0 bytes, and the schedule's
    later prefetch of it is skipped. Numbers stay exact."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
    ref_layers = copy.deepcopy(layers)
    x = torch.randn(256, 32)

    def run(mods: nn.ModuleList) -> torch.Tensor:
        mods.zero_grad(set_to_none=True)
        first = torch.tanh(mods[0](x))
        h = first
        for layer in mods[1:]:
            h = torch.tanh(layer(h))

        @skip_offload
        def peek(t: torch.Tensor) -> torch.Tensor:
            return t + first.detach().mean()  # `first` is not an argument

        loss = peek(h).pow(2).mean()
        loss.backward()
        return loss

    session = OffloadSession(OffloadConfig(max_resident_activation_mb=64 * 1024 / MIB))
    for step in range(3):
        with session:
            loss = run(layers)
        assert torch.equal(loss, run(ref_layers)) and _same_grads(layers, ref_layers), step
    stats = session.last_stats
    assert stats.phase == "replay" and stats.demand_loads > 0, stats  # the path ran
