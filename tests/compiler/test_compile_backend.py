"""The backend end to end on tiny models: Inductor's output code keeps every transfer
op in place, Inductor's config and caches stay scoped to our compile, memory drops with
the budget, reports and logs, recompilation, dynamic shapes, exceptions, skip_offload."""

from __future__ import annotations

import gc
import logging
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import hyper_offload
from hyper_offload.runtime.saved_bytes import saved_device_bytes
from hyper_offload.passes.analysis.liveness import offload_candidates
from hyper_offload.passes.fx.sizes import SizeBound

from .compile_models import INNER_COMPILERS, deterministic, mlp, moved_storages, offload_backend  # noqa: F401 (autouse)

D = 32


def _step(compiled, x):
    loss = compiled(x).float().pow(2).sum()
    loss.backward()
    return loss


def _model(dtype=torch.float32, layers=3):
    torch.manual_seed(0)
    return mlp(layers=layers, d=D).to(dtype)


# ------------------------------------------------------------------ Inductor output code


def _call_lines(code: str) -> list[str]:
    return [line.strip() for line in code.splitlines() if line.startswith("        ")]


_KERNEL = re.compile(r"^(cpp_fused_\w+|extern_kernels\.\w+|aten\.\w+)")


def _check_forward_code(lines: list[str]) -> int:
    """Each copy_d2h follows the kernel that wrote its source with no kernel between."""
    count = 0
    for i, line in enumerate(lines):
        match = re.match(
            r"(\w+) = torch\.ops\.hyper_offload\.copy_d2h\.default\((\w+), \[[\d, ]*\], \d+\)", line
        )
        if not match:
            continue
        count += 1
        host, source = match.groups()
        kernels = [j for j in range(i) if _KERNEL.match(lines[j])]
        assert kernels and re.search(rf"\b{source}\b", lines[kernels[-1]]), (
            f"copy_d2h of {source} does not directly follow its producer:\n" + "\n".join(lines[: i + 1])
        )
        alias = next(re.match(rf"(\w+) = {host}$", l).group(1) for l in lines[i:] if re.match(rf"\w+ = {host}$", l))
        assert any(f"wait_transfer.default({alias}, {source})" in l for l in lines[i:])
    return count


def _check_backward_code(lines: list[str]) -> int:
    """copy_h2d, then its wait, then every reader of the waited value; release after."""
    count = 0
    for i, line in enumerate(lines):
        match = re.match(r"(\w+) = torch\.ops\.hyper_offload\.copy_h2d\.default\((\w+),", line)
        if not match:
            continue
        count += 1
        dev, host = match.groups()
        aliases = {dev} | {re.match(r"(\w+) =", l).group(1) for l in lines if re.fullmatch(rf"\w+ = {dev}", l)}
        wait = next(j for j in range(i, len(lines)) if "wait_transfer.default(" in lines[j]
                    and any(f"({a}, {host})" in lines[j] for a in aliases))
        waited = re.match(r"(\w+) =", lines[wait]).group(1)
        names = {waited} | {re.match(r"(\w+) =", l).group(1) for l in lines if re.fullmatch(rf"\w+ = {waited}", l)}
        readers = [j for j, l in enumerate(lines) if _KERNEL.match(l) and any(re.search(rf"\b{n}\b", l) for n in names)]
        release = next(j for j, l in enumerate(lines) if f"release_host.default({host}," in l)
        assert readers and i < wait < min(readers) and release > wait
        assert not any(re.search(rf"\b{host}\b", lines[j]) for j in readers)  # no reader sees the host copy
    return count


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_output_code_keeps_every_transfer_in_order(dtype):
    torch._dynamo.reset()
    model, x = _model(dtype), torch.randn(16, D, dtype=dtype)
    backend = offload_backend("inductor", "tight")
    compiled = torch.compile(model, backend=backend)
    _, codes = run_and_get_code(lambda: _step(compiled, x))
    offloaded = len(moved_storages(backend.regions[0].planned))
    assert offloaded >= 3  # storages moved (one copy each way per storage)
    fw = [c for c in codes if "copy_d2h" in c]
    bw = [c for c in codes if "copy_h2d" in c]
    assert len(fw) == 1 and len(bw) == 1
    assert _check_forward_code(_call_lines(fw[0])) == offloaded
    assert _check_backward_code(_call_lines(bw[0])) == offloaded


@pytest.mark.slow
def test_plain_compile_in_the_same_process_is_unaffected():
    from torch._inductor import config as inductor_config

    torch._dynamo.reset()
    model, x = _model(), torch.randn(16, D)
    _step(torch.compile(model, backend=offload_backend("inductor", "tight")), x)
    assert inductor_config.custom_partitioner_fn is None  # scoped to our compile
    torch._dynamo.reset()
    model.zero_grad()
    _, codes = run_and_get_code(lambda: _step(torch.compile(model, backend="inductor"), x))
    assert codes and not any("hyper_offload" in c for c in codes)
    # with the budget >= peak nothing is inserted: Inductor compiles the plain graphs
    torch._dynamo.reset()
    _, fits = run_and_get_code(lambda: _step(torch.compile(model, backend=offload_backend("inductor", "fits")), x))

    def strip(code: str) -> str:
        return "\n".join(l for l in code.splitlines() if not l.startswith("# AOT ID"))

    assert [strip(c) for c in fits] == [strip(c) for c in codes]
    # and a second offload compile of the same graph re-plans (no cache hit skips us)
    torch._dynamo.reset()
    backend = offload_backend("inductor", "tight")
    _, codes = run_and_get_code(lambda: _step(torch.compile(model, backend=backend), x))
    assert len(backend.reports) == 1 and any("copy_d2h" in c for c in codes)


# ------------------------------------------------------------------ memory


@pytest.mark.parametrize("inner", INNER_COMPILERS)
def test_saved_device_bytes_drop_with_the_budget_and_match_the_plan(inner):
    x = torch.randn(32, D)
    measured = []
    for budget in ("fits", "half", "tight"):
        torch._dynamo.reset()
        model = _model(layers=4)
        backend = offload_backend(inner, budget)
        loss = torch.compile(model, backend=backend)(x).pow(2).sum()
        got = saved_device_bytes(loss, exclude=[*model.parameters(), x])
        region = backend.regions[0].planned
        offloaded = set(region.report.offloaded)
        sizes = region.fx_trace.trace.storage_sizes
        predicted = sum(
            sizes[sid] for sid in {
                s.storage for s in region.fx_trace.saved
                if s.storage is not None and s.name not in offloaded
            }
        )
        assert got == predicted  # the runtime keeps exactly what the plan keeps
        boundary = region.check.resident_bytes[region.fx_trace.num_fw_ops - 1]
        if region.report.feasible:
            assert boundary <= region.report.budget_bytes
        loss.backward()
        measured.append(got)
    assert measured[0] > measured[1] > measured[2]
    # as tight as feasible: every saved activation with an offloadable gap moved
    groups = region.fx_trace.movable()
    movable = {
        saved.name for c in offload_candidates(region.fx_trace.trace) for saved in groups[c.storage]
    }
    assert movable and set(region.report.offloaded) == movable


# ------------------------------------------------------------------ report and logging


def test_report_and_logging(caplog):
    torch._dynamo.reset()
    x = torch.randn(16, D)
    with caplog.at_level(logging.INFO, logger="hyper_offload"):
        backend = offload_backend("aot_eager", "tight")
        _step(torch.compile(_model(), backend=backend), x)
    report = backend.reports[0]
    infos = [r for r in caplog.records if r.levelno == logging.INFO and r.name == "hyper_offload"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "hyper_offload"]
    assert len(infos) == 1 and str(report) in infos[0].getMessage()
    assert not report.feasible and len(warnings) == 1  # budget 0: one clear warning
    worst = max(report.infeasible_ops, key=lambda o: o.excess_bytes)
    assert "infeasible" in warnings[0].getMessage() and worst.op in warnings[0].getMessage()
    assert f"{len(report.infeasible_ops)} op(s)" in warnings[0].getMessage()
    moved = moved_storages(backend.regions[0].planned)
    assert report.bytes_d2h == report.bytes_h2d > 0 and report.transfers == 2 * len(moved)
    assert report.predicted_peak_after < report.predicted_peak_before
    assert 0 <= report.exposed_transfer_s <= report.d2h_s + report.h2d_s
    assert report.fw_nodes > 0 and report.bw_nodes > 0 and report.saved_activation_bytes >= report.bytes_d2h
    summary = report.summary()
    assert summary["feasible"] is False and summary["offloaded"] == list(report.offloaded)
    caplog.clear()
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="hyper_offload"):
        fits = offload_backend("aot_eager", "fits")
        _step(torch.compile(_model(), backend=fits), x)
    assert fits.reports[0].feasible and fits.reports[0].transfers == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ------------------------------------------------------------------ recompilation, dynamic


def test_recompilation_on_a_new_shape_replans():
    torch._dynamo.reset()
    model = _model()
    backend = offload_backend("aot_eager", "tight")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    a, b = torch.randn(16, D), torch.randn(8, D)
    _step(compiled, a)
    _step(compiled, b)
    assert len(backend.reports) == 2
    first, second = backend.reports
    assert second.bytes_d2h * 2 == first.bytes_d2h  # planned for the new shape


def test_an_unbounded_dynamic_size_is_planned_at_its_hint_and_a_larger_call_warns(caplog):
    """``dynamic=True`` with no declared bound: the plan assumes the size of the first
    compile (``SizeBound.HINT``, in the report); a smaller call is covered by that plan
    and says nothing, a larger one logs the one warning that names the fix."""
    torch._dynamo.reset()
    model = _model()
    backend = offload_backend("aot_eager", "tight")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    x16, x8, x32 = torch.randn(16, D), torch.randn(8, D), torch.randn(32, D)
    with caplog.at_level(logging.WARNING, logger="hyper_offload"):
        loss16 = _step(compiled, x16)
        grads16 = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        loss8 = _step(compiled, x8)
        assert not [r for r in caplog.records if "planned for" in r.getMessage()]
        _step(compiled, x32)
        _step(compiled, x32)
    assert len(backend.reports) == 1  # one dynamic graph, planned once
    (size,) = [s for s in backend.reports[0].sizes if s.hint == 16]
    assert size.bound is SizeBound.HINT and size.planned == 16
    assert ".size()[0]" in " ".join(size.sources)  # Dynamo's name for where it comes from
    assert f"{size.symbol} (" in str(backend.reports[0])
    larger = [r.getMessage() for r in caplog.records if "planned for" in r.getMessage()]
    assert len(larger) == 1 and "<= 16" in larger[0] and "=32" in larger[0]
    assert "mark_dynamic" in larger[0]
    torch._dynamo.reset()
    model.zero_grad()
    plain = torch.compile(model, backend="aot_eager", dynamic=True)
    assert torch.equal(_step(plain, x16), loss16)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads16))
    assert torch.equal(_step(plain, x8), loss8)


# ------------------------------------------------------------------ exceptions, state


class _FailsLate(torch.nn.Module):
    """An MLP whose forward indexes out of range after its activations were offloaded."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(layers=3, d=D)

    def forward(self, x, index):
        return self.body(x)[index].sum()


def test_exception_in_forward_leaves_nothing_in_flight():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _FailsLate()
    backend = offload_backend("aot_eager", "tight")
    compiled = torch.compile(model, backend=backend)
    x, good = torch.randn(16, D), torch.tensor([0, 3])
    compiled(x, good).backward()
    runtime = backend.runtime
    with pytest.raises(Exception, match="out of bounds|index"):
        compiled(x, torch.tensor([0, 99]))
    gc.collect()
    assert runtime.transfers_pending == 0
    assert runtime.pool.stats().buffers_in_use == 0  # every host copy given back
    model.zero_grad()
    loss = compiled(x, good)
    loss.backward()  # the runtime is usable again
    assert runtime.pool.stats().buffers_in_use == 0


_FAIL = {"on": False}


@torch.library.custom_op("hyper_offload_test::check", mutates_args=())
def _check(grad: torch.Tensor) -> torch.Tensor:
    # Opaque at compile time: raises at run time, inside the compiled backward.
    if _FAIL["on"]:
        raise RuntimeError("boom inside the compiled backward")
    return grad.clone()


@_check.register_fake
def _(grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


@torch.library.custom_op("hyper_offload_test::identity", mutates_args=())
def _identity(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_identity.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_identity.register_autograd(lambda ctx, grad: torch.ops.hyper_offload_test.check(grad))


class _FailsInBackward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = mlp(layers=2, d=D), mlp(layers=2, d=D)

    def forward(self, x):
        return self.b(torch.ops.hyper_offload_test.identity(self.a(x)))


def test_exception_inside_the_compiled_backward_leaves_nothing_in_flight():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _FailsInBackward()
    backend = offload_backend("aot_eager", "tight")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(16, D)
    runtime = None
    _FAIL["on"] = True
    try:
        with pytest.raises(RuntimeError, match="boom inside the compiled backward"):
            _step(compiled, x)
    finally:
        _FAIL["on"] = False
    runtime = backend.runtime
    assert len(backend.reports) == 1 and backend.reports[0].offloaded  # one region, offloading
    gc.collect()
    assert runtime.transfers_pending == 0
    assert runtime.pool.stats().buffers_in_use == 0  # the host copies of layers a went back
    model.zero_grad()
    _step(compiled, x)  # and the next step runs normally
    assert runtime.pool.stats().buffers_in_use == 0


def test_exception_in_backward_and_forward_without_backward_lose_no_host_buffer():
    torch._dynamo.reset()
    model = _model()
    backend = offload_backend("aot_eager", "tight")
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(16, D)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("boom in backward")

    out = compiled(x)
    runtime = backend.runtime
    assert runtime.pool.stats().buffers_in_use > 0  # the graph holds the host copies
    with pytest.raises(RuntimeError, match="boom"):
        Boom.apply(out).sum().backward()  # our region's backward never runs
    del out
    gc.collect()
    # Back as soon as the graph died, with no later forward of the region needed.
    assert runtime.transfers_pending == 0 and runtime.pool.stats().buffers_in_use == 0
    compiled(x)  # forward only, its result dropped at once: no backward at all
    assert runtime.pool.stats().buffers_in_use == 0


def test_two_compiled_models_have_their_own_runtime():
    torch._dynamo.reset()
    a, b = offload_backend("aot_eager", "tight"), offload_backend("aot_eager", "tight")
    ma, mb = _model(), _model(layers=2)
    x = torch.randn(16, D)
    la = torch.compile(ma, backend=a)(x).sum()
    lb = torch.compile(mb, backend=b)(x).sum()
    ra, rb = a.runtime, b.runtime
    assert ra is not rb
    assert ra.pool.stats().buffers_in_use == len(a.reports[0].offloaded)
    assert rb.pool.stats().buffers_in_use == len(b.reports[0].offloaded)
    (la + lb).backward()  # both backwards run inside one backward() call
    assert ra.pool.stats().buffers_in_use == rb.pool.stats().buffers_in_use == 0


# ------------------------------------------------------------------ skip_offload


class _WithSkipped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = mlp(layers=2, d=D), mlp(layers=2, d=D)

    @hyper_offload.skip_offload
    def middle(self, x):
        return torch.nn.functional.gelu(x) * 2

    def forward(self, x):
        return self.b(self.middle(self.a(x)))


def test_skip_offload_is_a_graph_break_and_each_region_is_planned_alone():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _WithSkipped(), torch.randn(16, D)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_count == 2 and explained.graph_break_count == 1
    torch._dynamo.reset()
    backend = offload_backend("aot_eager", "tight")
    loss = _step(torch.compile(model, backend=backend), x)
    grads = [p.grad.clone() for p in model.parameters()]
    assert len(backend.reports) == 2 and all(r.offloaded for r in backend.reports)
    names = {op for r in backend.regions for op in r.planned.fx_trace.op_nodes}
    assert not any("mul" in n for n in names if n.startswith("fw:"))  # middle ran eagerly
    torch._dynamo.reset()
    model.zero_grad()
    assert torch.equal(_step(torch.compile(model, backend="aot_eager"), x), loss)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


class _ReturnsWhatItSaves(torch.nn.Module):
    """``tanh`` saves its output for the backward, and that output is also the model's:
    a storage no plan can move (it outlives the step anyway)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(D, D)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return h, torch.nn.functional.gelu(h).sum()


def test_report_lists_saved_activations_that_cannot_move_and_why():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _ReturnsWhatItSaves(), torch.randn(16, D)
    backend = offload_backend("aot_eager", "tight")
    h, loss = torch.compile(model, backend=backend)(x)
    (loss + h.sum()).backward()
    report = backend.reports[0]
    kept = {name: k for k in report.kept for name in k.names}
    tanh_out = [k for k in report.kept if k.reason == "its storage is also a model output"]
    assert tanh_out and tanh_out[0].nbytes == h.numel() * h.element_size()
    assert report.kept_bytes == sum(k.nbytes for k in report.kept) > 0
    assert not set(kept) & set(report.offloaded)  # a kept tensor is never also moved
    assert f"{report.kept_bytes} B saved that cannot move" in str(report)
    assert report.summary()["kept"][0]["reason"] == report.kept[0].reason
