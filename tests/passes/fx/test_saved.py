"""Saved views leave the device (issue 15): which storages move, why the others stay, and
that each kind of view comes back bit for bit, on small hand-built forward/backward
graphs (so the case under test is saved, whatever a partitioner would choose).

Each case is a forward ``fw(x, w) -> (loss, *saved)`` and a backward
``bw(*saved, tangent) -> grads``, traced with ``make_fx``; the backward's placeholders
take the names of the forward's saved outputs, as AOTAutograd's partition gives them. The
lowered pair is run with the real transfer ops and compared with the plain pair.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import hyper_offload.runtime.ops  # noqa: F401  (real kernels of the transfer ops)
from hyper_offload.passes import GreedyResidencyPlanner, check_schedule, plan_residency
from hyper_offload.errors import LoweringError
from hyper_offload.passes.fx.fx_trace import FxTrace
from hyper_offload.passes.fx.graph_trace import (
    REBUILT_VIEW_META,
    RELOADED_AS_META,
    build_fx_trace,
    is_rebuilt_view,
)
from hyper_offload.passes.fx.lowering import lower_schedule
from hyper_offload.passes.fx.lowering_check import check_lowering
from hyper_offload.runtime import PinnedMemoryPool, TransferRuntime
from hyper_offload.runtime.memory_meter import is_host_labelled
from hyper_offload.passes.plan.report import FloorPlanner
from hyper_offload.runtime.ops import COPY_D2H, COPY_H2D, WAIT_TRANSFER

_GEN = torch.Generator().manual_seed(0)
X, W = torch.randn(8, 16, generator=_GEN), torch.randn(16, 24, generator=_GEN)


def hand_graphs(
    fw_fn: Callable[..., tuple[torch.Tensor, ...]],
    bw_fn: Callable[..., tuple[torch.Tensor, ...]],
    *,
    tracing_mode: str = "fake",
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward and backward graphs of ``fw_fn(X, W)`` / ``bw_fn(*saved, tangent)``, the
    backward's saved placeholders renamed after the forward's saved outputs."""
    fw = make_fx(fw_fn, tracing_mode=tracing_mode)(X, W)
    outputs = fw.graph.find_nodes(op="output")[0].args[0]
    saved_values = [node.meta["val"] for node in outputs[1:]]
    examples = [_example(v) for v in saved_values]
    bw = make_fx(bw_fn, tracing_mode=tracing_mode)(*examples, torch.ones(()))
    # Rebuild the backward with its placeholders named first, so no node holds a name
    # the forward's saved outputs need.
    names = [node.name for node in outputs[1:]] + ["tangents_1"]
    graph, val_map = fx.Graph(), {}
    for node, name in zip(bw.graph.find_nodes(op="placeholder"), names):
        val_map[node] = graph.placeholder(name)
        val_map[node].meta = dict(node.meta)
    graph.output(graph.graph_copy(bw.graph, val_map))
    return fw, fx.GraphModule(bw, graph)


def _example(value: torch.Tensor) -> torch.Tensor:
    """A real tensor with ``value``'s properties (its conjugate and negative bits too:
    the backward is traced for what it will be given)."""
    if not all(isinstance(s, int) for s in (*value.shape, *value.stride())):
        return torch.randn(8, 24)
    example = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
    if value.is_neg():
        example = torch._neg_view(example)
    return example.conj() if value.is_conj() else example


def trace_of(fw: fx.GraphModule, bw: fx.GraphModule, budget: int = 0) -> FxTrace:
    fx_trace = build_fx_trace(fw, bw, num_fwd_outputs=1)
    return dataclasses.replace(fx_trace, trace=fx_trace.trace.with_budget(budget))


def run(fw: fx.GraphModule, bw: fx.GraphModule) -> tuple[torch.Tensor, list[torch.Tensor], list]:
    """Loss, gradients and the backward's saved inputs as it received them."""
    with TransferRuntime(pool=PinnedMemoryPool(1 << 24)):
        loss, *saved = fw(X, W)
        grads = bw(*saved, torch.ones(()))
    return loss, list(grads), saved


def _one(fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Callable, Callable]:
    """A case whose forward saves ``fn(x @ w)`` (a view of the mm output) and whose
    backward reads it."""

    def fw(x, w):
        y = x @ w
        saved = fn(y)
        return (_tail(y.sum()), saved)

    def bw(v, tangent):
        return (v.sin() * _tail(tangent),)

    return fw, bw


def _tail(t: torch.Tensor) -> torch.Tensor:
    """Ops after the forward's last use of the saved storage (and before the backward's
    first): the gap an offload needs."""
    return (t * 1e-3).tanh().cos()


VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "transpose": lambda y: y.t(),
    "permute": lambda y: y.view(2, 4, 24).permute(2, 0, 1),
    "select": lambda y: y[3],
    "slice_with_step": lambda y: y[:, 4:20:2],  # non-dense: gaps between elements
    "expand_0_stride": lambda y: y[:, :1].expand(8, 24),
    "detach": lambda y: y.detach(),
    "as_strided_overlapping": lambda y: y.as_strided((8, 8), (2, 1)),
    "view_of_view": lambda y: y.view(4, 2, 24).transpose(0, 2)[1:],
    "zero_size_view": lambda y: y[:, :0],
    "reshape": lambda y: y.reshape(2, 96),
}


def _assert_moved_and_exact(fw_fn: Callable, bw_fn: Callable, *, storages: int) -> FxTrace:
    want = run(*hand_graphs(fw_fn, bw_fn))
    fw, bw = hand_graphs(fw_fn, bw_fn)
    fx_trace = trace_of(fw, bw)
    assert len(fx_trace.movable()) == storages
    schedule = GreedyResidencyPlanner().plan(fx_trace.trace)
    assert check_schedule(fx_trace.trace, schedule).ok
    lower_schedule(fw, bw, fx_trace, schedule)
    assert check_lowering(fw, bw, fx_trace, num_fwd_outputs=1).ok
    assert len(fw.graph.find_nodes(op="call_function", target=COPY_D2H)) == storages
    assert len(bw.graph.find_nodes(op="call_function", target=COPY_H2D)) == storages
    got = run(fw, bw)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    return fx_trace


@pytest.mark.parametrize("kind", sorted(VIEWS))
def test_a_saved_view_moves_with_its_base_and_comes_back_bit_for_bit(kind: str) -> None:
    fw_fn, bw_fn = _one(VIEWS[kind])
    fx_trace = _assert_moved_and_exact(fw_fn, bw_fn, storages=1)
    (saved,) = [s for s in fx_trace.saved if s.storage is not None]
    assert saved.offloadable and saved.base == "mm", saved


def test_the_rebuilt_view_has_the_saved_layout_on_one_reloaded_storage() -> None:
    """q/k/v-style: three strided views of one storage move with one copy each way and
    come back as three views of one new storage, with the saved sizes, strides and
    offsets (a dense copy per view would move the bytes once too, but either change
    strides or allocate three storages of the whole extent on reload)."""

    def fw(x, w):
        qkv = x @ w
        q, k, v = (z.view(2, 4, 8).transpose(0, 1) for z in qkv.split(8, dim=1))
        return (_tail(qkv.sum()), q, k, v)

    def bw(q, k, v, tangent):
        return ((q * k + v) * _tail(tangent),)

    fx_trace = _assert_moved_and_exact(fw, bw, storages=1)
    (group,) = fx_trace.movable().values()
    assert len(group) == 3 and {s.base for s in group} == {"mm"}
    plain = run(*hand_graphs(fw, bw))[2]
    fw_graph, bw_graph = hand_graphs(fw, bw)
    lowered = trace_of(fw_graph, bw_graph)
    lower_schedule(fw_graph, bw_graph, lowered, GreedyResidencyPlanner().plan(lowered.trace))
    with TransferRuntime(pool=PinnedMemoryPool(1 << 24)):
        _, *saved = fw_graph(X, W)
        assert len({t.untyped_storage().data_ptr() for t in saved}) == 1  # one host copy
        recorder = _Recorder(bw_graph)
        recorder.run(*saved, torch.ones(()))
    rebuilt = {
        n.meta[REBUILT_VIEW_META]: recorder.values[n.name]
        for n in bw_graph.graph.nodes if is_rebuilt_view(n)
    }
    assert sorted(rebuilt) == sorted(s.name for s in group)
    layouts = [(t.shape, t.stride(), t.storage_offset()) for t in plain]
    assert [(t.shape, t.stride(), t.storage_offset()) for t in rebuilt.values()] == layouts
    assert len({t.untyped_storage().data_ptr() for t in rebuilt.values()}) == 1
    assert all(t.device.type == "cpu" and not is_host_labelled(t) for t in rebuilt.values())


class _Recorder(fx.Interpreter):
    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.values: dict[str, object] = {}

    def run_node(self, n: fx.Node) -> object:
        value = super().run_node(n)
        self.values[n.name] = value
        return value


def _kept(fw_fn: Callable, bw_fn: Callable, **kwargs: str) -> list:
    fw, bw = hand_graphs(fw_fn, bw_fn, **kwargs)
    fx_trace = trace_of(fw, bw)
    assert not fx_trace.movable()
    return [s for s in fx_trace.saved]


def _complex(y: torch.Tensor) -> torch.Tensor:
    """A complex activation of its own storage (a fresh op output, 8 x 12)."""
    return torch.polar(y[:, :12], y[:, 12:])


def _observe(v: torch.Tensor) -> torch.Tensor:
    """A backward read that sees every property of ``v``: its bytes through its dtype,
    layout and conjugate/negative bits (a conjugated reload changes the result)."""
    if v.is_complex():
        return torch.view_as_real((v * torch.complex(v.real.cos(), v.imag.sin())).resolve_conj()
                                  .resolve_neg()).sum()
    return v.float().sin().sum()


PROPERTY_VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # AOTAutograd saves aten._conj(freqs) for a complex multiply's backward (complex RoPE)
    "conj": lambda y: _complex(y).conj(),
    "neg_view": lambda y: torch._neg_view(_complex(y)),
    "conj_of_strided_view": lambda y: _complex(y).t()[1:, ::2].conj(),
    "conj_and_neg": lambda y: torch._neg_view(_complex(y).conj()),
    "int32_view": lambda y: y.view(torch.int32),
    "real_view_of_complex": lambda y: torch.view_as_real(_complex(y)),
    "real_part_of_complex": lambda y: _complex(y).real,  # dtype, stride 2, offset 0
    "imag_part_of_complex": lambda y: _complex(y).imag,  # ... and offset 1
    "complex_view_of_real": lambda y: torch.view_as_complex(y.view(8, 12, 2)),
    "bf16_pairs_as_fp32": lambda y: y.to(torch.bfloat16).view(torch.float32),
}


@pytest.mark.parametrize("kind", sorted(PROPERTY_VIEWS))
def test_a_saved_tensor_comes_back_equal_in_every_property(kind: str) -> None:
    """dtype (complex and reinterpreted), conjugate and negative bits, strides and
    offsets: the backward's readers get the saved tensor itself, and the gradient is the
    plain one bit for bit (a reload of the base alone conjugates complex gradients)."""

    def fw(x, w):
        y = x @ w
        saved = PROPERTY_VIEWS[kind](y)
        return (_tail(y.sum()), saved)

    def bw(v, tangent):
        return (_observe(v) * _tail(tangent),)

    fx_trace = _assert_moved_and_exact(fw, bw, storages=1)
    (saved,) = [s for s in fx_trace.saved if s.storage is not None]
    plain_fw, plain_bw = hand_graphs(fw, bw)
    (_, _, (plain,)) = run(plain_fw, plain_bw)
    assert saved.properties == (
        plain.dtype, tuple(plain.shape), plain.stride(), plain.storage_offset(),
        plain.is_conj(), plain.is_neg(),
    )


def test_a_reload_that_drops_the_conjugate_bit_is_a_lowering_error() -> None:
    """check_lowering judges the lowered graphs independently of the lowering: a rebuild
    without its ``_conj`` (the bug complex RoPE met) is refused at compile time."""

    def fw(x, w):
        y = x @ w
        saved = _complex(y).conj()
        return (_tail(y.sum()), saved)

    def bw(v, tangent):
        return (_observe(v) * _tail(tangent),)

    fw_graph, bw_graph = hand_graphs(fw, bw)
    fx_trace = trace_of(fw_graph, bw_graph)
    lower_schedule(fw_graph, bw_graph, fx_trace, GreedyResidencyPlanner().plan(fx_trace.trace))
    (conj,) = [n for n in bw_graph.graph.find_nodes(
        op="call_function", target=torch.ops.aten._conj.default) if is_rebuilt_view(n)]
    conj.replace_all_uses_with(conj.args[0])  # plant the bug: the bit is not set again
    for key in (REBUILT_VIEW_META, RELOADED_AS_META):
        conj.args[0].meta[key] = conj.meta[key]
    bw_graph.graph.erase_node(conj)
    with pytest.raises(LoweringError, match=r"saved _conj.*conj True != False"):
        check_lowering(fw_graph, bw_graph, fx_trace, num_fwd_outputs=1)


def test_a_view_whose_elements_do_not_tile_its_storage_is_kept_and_says_why() -> None:
    """Two of three float32 read as one float64: a flat reinterpretation of the 12-byte
    storage does not exist, so the storage stays (never reloads as another tensor)."""

    def fw(x, w):
        y = (x @ w)[0, :3].clone()
        return (_tail(y.sum()), y[:2].view(torch.float64))

    def bw(v, tangent):
        return (v.float().sin() * _tail(tangent),)

    (saved,) = [s for s in _kept(fw, bw) if s.storage is not None]
    assert "views its storage as torch.float64" in saved.reason
    assert "do not tile" in saved.reason


def test_a_base_that_does_not_cover_its_storage_densely_is_kept() -> None:
    """An op whose result has gaps (here a copy into a strided buffer): one copy of it
    would not restore the storage byte for byte."""

    def fw(x, w):
        y = torch.empty_strided((8, 24), (32, 1)).copy_(x @ w)
        return (_tail(y.sum()), y)

    def bw(v, tangent):
        return (v.sin() * _tail(tangent),)

    saved = [s for s in _kept(fw, bw) if s.storage is not None]
    assert saved and all("does not cover the storage densely" in s.reason for s in saved)


def test_a_storage_that_a_model_output_aliases_is_kept() -> None:
    def fw(x, w):
        y = x @ w
        return (y, y.t())

    def bw(v, tangent):
        return (v.transpose(0, 1) * tangent,)

    (saved,) = _kept(fw, bw)
    assert saved.reason == "its storage is also a model output"


def test_a_view_of_a_parameter_is_not_an_activation() -> None:
    def fw(x, w):
        return (_tail((x @ w).sum()), w.t())

    def bw(v, tangent):
        return (v.sin() * _tail(tangent),)

    (saved,) = _kept(fw, bw)
    assert saved.storage is None and "parameter or input" in saved.reason


def test_a_view_with_symbolic_strides_is_kept_under_dynamic_shapes() -> None:
    """The backward would need the view's symbolic sizes as graph values to rebuild it;
    a view laid out like its base (no rebuild) still moves."""

    def fw(x, w):
        y = x @ w
        return (_tail(y.sum()), y.t(), (y * 2))

    def bw(v, u, tangent):
        return (v.sin().sum() * u.cos().sum() * _tail(tangent),)

    fw_graph, bw_graph = hand_graphs(fw, bw, tracing_mode="symbolic")
    fx_trace = trace_of(fw_graph, bw_graph)
    view, fresh = [s for s in fx_trace.saved if s.storage is not None]
    assert not view.offloadable and "symbolic sizes or strides" in view.reason, view
    assert fresh.offloadable and fresh.base == fresh.name  # its own base: nothing to rebuild


def _logits_graphs(saved_view: str) -> tuple[fx.GraphModule, fx.GraphModule]:
    """HF's causal LM head after Inductor's decompositions: ``logits = view(mm, (2, 4,
    24))`` is a model output, the loss reads its flattened view, and the backward takes
    ``saved_view``: the logits node itself (returned twice: model output and saved) or
    the flattened view (another node on the logits' storage)."""

    def fw(x, w):
        logits = (x @ w).view(2, 4, 24)
        flat = logits.view(-1, 24)
        loss = _tail(torch.logsumexp(flat, 1).sum())
        return (loss, logits, logits if saved_view == "logits" else flat)

    def bw(v, tangent, logits_tangent):
        return ((v.reshape(-1, 24).softmax(1) * _tail(tangent) + logits_tangent.view(-1, 24)),)

    fw_graph = make_fx(fw, tracing_mode="fake")(X, W)
    outputs = fw_graph.graph.find_nodes(op="output")[0].args[0]
    (saved,) = outputs[2:]
    bw_graph = make_fx(bw, tracing_mode="fake")(
        _example(saved.meta["val"]), torch.ones(()), torch.ones(2, 4, 24))
    graph, val_map = fx.Graph(), {}
    for node, name in zip(bw_graph.graph.find_nodes(op="placeholder"),
                          (saved.name, "tangents_1", "tangents_2")):
        val_map[node] = graph.placeholder(name)
        val_map[node].meta = dict(node.meta)
    graph.output(graph.graph_copy(bw_graph.graph, val_map))
    return fw_graph, fx.GraphModule(bw_graph, graph)


def _run_logits(fw: fx.GraphModule, bw: fx.GraphModule) -> tuple[torch.Tensor, ...]:
    with TransferRuntime(pool=PinnedMemoryPool(1 << 24)):
        loss, logits, saved = fw(X, W)
        (grad,) = bw(saved, torch.ones(()), torch.full((2, 4, 24), 0.5))
    return loss, logits, grad


@pytest.mark.parametrize("saved_view", ["logits", "flat"])
def test_a_saved_model_output_moves_and_the_caller_still_gets_the_model_output(
    saved_view: str,
) -> None:
    """The step scope moves a saved tensor that is also a model output
    (``outputs_move``). Where AOTAutograd returns one node as both (HF GPT-2's logits
    under Inductor's decompositions), only the saved position may read the host copy:
    the lowering gave it to the model output too, and the logits came back as the host
    copy of their (32, 64) base, so the backward's tangent could not be made."""
    want = _run_logits(*_logits_graphs(saved_view))
    fw, bw = _logits_graphs(saved_view)
    plain_outputs = [n.name for n in fw.graph.find_nodes(op="output")[0].args[0]]
    fx_trace = build_fx_trace(fw, bw, num_fwd_outputs=2, outputs_move=True)
    (group,) = fx_trace.movable().values()
    assert [s.name for s in group] == [plain_outputs[2]] and group[0].base == "mm"
    planner = FloorPlanner(fx_trace.num_fw_ops, frozenset(fx_trace.movable()))
    schedule = plan_residency(fx_trace.trace, planner, earliest_prefetch_op=fx_trace.num_fw_ops,
                              release_waits_for_d2h=True,
                              latest_release_op=fx_trace.num_fw_ops - 1).schedule
    lower_schedule(fw, bw, fx_trace, schedule)
    assert check_lowering(fw, bw, fx_trace, num_fwd_outputs=2).ok
    outputs = fw.graph.find_nodes(op="output")[0].args[0]
    assert [n.name for n in outputs[:2]] == plain_outputs[:2]  # the model's, untouched
    assert outputs[2].target is WAIT_TRANSFER and outputs[2].args[0].target is COPY_D2H
    got = _run_logits(fw, bw)
    assert got[1].shape == (2, 4, 24) and got[1].stride() == want[1].stride()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_model_output_that_reads_a_host_copy_is_a_lowering_error() -> None:
    """check_lowering judges the model outputs without the lowering: the trace cannot
    (a transfer op aliases its source), so the bug above passed every check."""
    fw, bw = _logits_graphs("logits")
    fx_trace = build_fx_trace(fw, bw, num_fwd_outputs=2, outputs_move=True)
    planner = FloorPlanner(fx_trace.num_fw_ops, frozenset(fx_trace.movable()))
    lower_schedule(fw, bw, fx_trace, planner.plan(fx_trace.trace))
    output = fw.graph.find_nodes(op="output")[0]
    loss, _, wait = output.args[0]
    output.args = ((loss, wait, wait),)  # plant the bug: the caller gets the host copy
    with pytest.raises(LoweringError, match=r"model output 1 of the lowered forward is fw:wait"):
        check_lowering(fw, bw, fx_trace, num_fwd_outputs=2)
