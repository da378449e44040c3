"""The compile door on steps whose sizes change (issue 33): one plan for every size the
guards allow, checked against the budget at the largest (``passes.fx.sizes``).

* packed or bucketed sequence lengths, declared with ``torch._dynamo.mark_dynamic(ids, 1,
  max=64)``: a GPT sees lengths 48, 32, 64, 48, 64, 32;
* MoE routing in one graph (``capture_dynamic_output_shape_ops``): each expert's token
  count is data-dependent (``nonzero``), bounded by torch at the number of tokens.

Every step is ``torch.equal`` to plain ``torch.compile`` with the same dynamic settings,
keeps at most the budget (+256 KiB) of saved device bytes after the forward (counted from
the autograd graph, at the step's real sizes), and compiles no more graphs than plain.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hyper_offload
from hyper_offload.runtime.saved_bytes import autograd_saved_device_bytes
from hyper_offload.passes.fx.sizes import SizeBound

from ..hf_moe import moe_config

SLACK = 256 * 1024
LENGTHS = (48, 32, 64, 48, 64, 32)


class _Counting:
    """aot_eager that counts the graphs Dynamo hands it (plain compile's recompilations)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs += 1
        return aot_eager(gm, example_inputs)


def _train(model: nn.Module, forward: Callable[..., torch.Tensor],
           batches: list[tuple[torch.Tensor, ...]]) -> list[dict[str, Any]]:
    out = []
    for batch in batches:
        loss = forward(*batch)
        saved = autograd_saved_device_bytes(loss, exclude=[*model.parameters(), *batch])
        loss.backward()
        out.append({"loss": loss.detach(), "saved": saved,
                    "grads": [p.grad.clone() for p in model.parameters()]})
        model.zero_grad(set_to_none=True)
    return out


def _exact_within_budget(
    model_fn: Callable[[], nn.Module], batches: list[Any], call: Callable[..., torch.Tensor]
) -> hyper_offload.compiler.HyperOffloadBackend:
    """Plain compile, then ours at half the plain run's most saved bytes; asserts the
    issue's figures and returns our backend for its reports."""
    torch._dynamo.reset()
    plain_model, counting = model_fn(), _Counting()
    compiled = torch.compile(plain_model, backend=counting)
    plain = _train(plain_model, lambda *b: call(compiled, *b), batches)
    budget = int(0.5 * max(step["saved"] for step in plain))
    torch._dynamo.reset()
    model = model_fn()
    backend = hyper_offload.backend(inner_compiler="aot_eager",
                                    max_resident_activation_mb=budget / (1 << 20))
    compiled = torch.compile(model, backend=backend)
    steps = _train(model, lambda *b: call(compiled, *b), batches)
    for number, (got, want) in enumerate(zip(steps, plain), 1):
        assert torch.equal(got["loss"], want["loss"]), f"step {number}"
        assert all(torch.equal(a, b) for a, b in zip(got["grads"], want["grads"])), number
        assert got["saved"] <= budget + SLACK, f"step {number}: {got['saved']} B > {budget} B"
    assert len(backend.reports) == counting.graphs  # no recompilation beyond plain's
    assert sum(report.bytes_d2h for report in backend.reports) > 0  # the budget made it move
    return backend


def _gpt() -> nn.Module:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from gpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=64, seq_len=64, layers=2, dim=32, heads=2))


def _tokens(step: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    ids, labels = (torch.randint(0, 64, (2, length), generator=generator) for _ in range(2))
    for tensor in (ids, labels):  # what a data loader of packed lengths declares
        torch._dynamo.mark_dynamic(tensor, 1, min=2, max=64)
    return ids, labels


def test_sequence_lengths_declared_up_to_64_are_planned_once_at_64():
    batches = [_tokens(i, n) for i, n in enumerate(LENGTHS)]
    backend = _exact_within_budget(_gpt, batches, lambda compiled, x, y: compiled(x, y))
    sizes = [size for report in backend.reports for size in report.sizes]
    assert sizes and all(s.bound is SizeBound.RANGE and s.planned == 64 for s in sizes)
    assert all(s.hint == 48 for s in sizes)  # compiled at the first step's length
    assert len(backend.reports) == 1


class _RoutedMoE(nn.Module):
    """Top-1 routing over ``experts`` MLPs, one graph under
    ``capture_dynamic_output_shape_ops``: each expert's rows are ``nonzero`` of the router's
    choice, a data-dependent count torch bounds by the number of tokens."""

    def __init__(self, dim: int = 32, experts: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.routers = nn.ModuleList(nn.Linear(dim, experts) for _ in range(layers))
        self.experts = nn.ModuleList(
            nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                          for _ in range(experts))
            for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for router, experts in zip(self.routers, self.experts):
            weights = router(x).softmax(-1)
            choice = weights.argmax(-1)
            mixed = torch.zeros_like(x)
            for index, expert in enumerate(experts):
                rows = (choice == index).nonzero().squeeze(1)
                gate = weights.index_select(0, rows)[:, index:index + 1]
                mixed = mixed.index_add(0, rows, gate * expert(x.index_select(0, rows)))
            x = x + mixed
        return x.pow(2).mean()


def _moe() -> nn.Module:
    torch.manual_seed(0)
    return _RoutedMoE()


def test_moe_routing_in_one_graph_is_planned_at_torchs_bound_on_each_experts_rows():
    batches = [(torch.randn(64, 32, generator=torch.Generator().manual_seed(i)),)
               for i in range(6)]
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        backend = _exact_within_budget(_moe, batches, lambda compiled, x: compiled(x))
    (report,) = backend.reports
    routed = [s for s in report.sizes if s.hint is None]  # the data-dependent row counts
    assert len(routed) >= 8 and all(s.bound is SizeBound.RANGE and s.planned == 64
                                    for s in routed)


def _repeated(bound: int | None) -> Callable[..., torch.Tensor]:
    def repeated(x: torch.Tensor, repeats: torch.Tensor) -> torch.Tensor:
        y = torch.repeat_interleave(x, repeats)  # a length torch cannot bound
        if bound is not None:
            torch._check(y.size(0) <= bound)  # the fix the error names
        return (y * y).sum()

    return repeated


def test_a_data_dependent_size_with_no_bound_names_the_fix_and_the_fix_works():
    x, repeats = torch.full((4,), 2.0, requires_grad=True), torch.tensor([1, 2, 3, 4])
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch._dynamo.reset()
        backend = hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_mb=0)
        with pytest.raises(Exception, match=r"u0 is data-dependent and unbounded.*torch\._check"):
            torch.compile(_repeated(None), backend=backend, fullgraph=True)(x, repeats)
        torch._dynamo.reset()
        backend = hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_mb=0)
        loss = torch.compile(_repeated(64), backend=backend, fullgraph=True)(x, repeats)
    assert torch.equal(loss, _repeated(None)(x, repeats))
    (size,) = backend.reports[0].sizes
    assert size.bound is SizeBound.RANGE and size.planned == 64 and size.hint is None
    # moved: the int64 row index and y itself (float32), both planned at 64 rows
    assert backend.reports[0].bytes_d2h == 64 * (8 + 4)


@pytest.mark.parametrize("name", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.extended)])
def test_hf_moe_routing_with_new_tokens_every_step(name):
    """Hugging Face Qwen3-MoE and Mixtral as transformers builds them (``grouped_mm``
    experts): routing changes every step inside one graph of constant shapes."""
    transformers = pytest.importorskip("transformers")
    config = moe_config(name)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        return tuple(torch.randint(0, 128, (2, 32), generator=generator) for _ in range(2))

    backend = _exact_within_budget(
        model, [batch(i) for i in range(6)],
        lambda compiled, ids, labels: compiled(input_ids=ids, labels=labels).loss)
    assert len(backend.reports) == 1 and not backend.reports[0].sizes


def test_a_region_recompiled_with_automatic_dynamic_sizes_stays_symbolic_when_relowered():
    """Plain ``torch.compile`` defaults: the second length recompiles the GPT with
    symbolic sizes (automatic dynamic), which the third length runs. A budget under the
    floor makes the step re-lower that region with the recompute search; it must be
    lowered with the region's symbolic sizes again, not specialized to its example
    inputs (HF GPT-2 then failed with ``shape '[2, 32, 192]' is invalid for input of
    size 18432`` on the next step)."""
    batches = []
    for step, length in enumerate((48, 32, 40)):
        generator = torch.Generator().manual_seed(step)
        batches.append(tuple(torch.randint(0, 64, (2, length), generator=generator)
                             for _ in range(2)))
    torch._dynamo.reset()
    plain_model = _gpt()
    compiled = torch.compile(plain_model, backend="aot_eager")
    plain = _train(plain_model, compiled, batches)
    torch._dynamo.reset()
    model = _gpt()
    backend = hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_mb=0.05)
    compiled = torch.compile(model, backend=backend)
    steps = _train(model, compiled, batches)
    for number, (got, want) in enumerate(zip(steps, plain), 1):
        assert torch.equal(got["loss"], want["loss"]), f"step {number}"
        assert all(torch.equal(a, b) for a, b in zip(got["grads"], want["grads"])), number
    (symbolic,) = [r for r in backend.regions if r.unbounded_sizes]
    assert symbolic.relowered and symbolic.planned.report.recompute.recomputed  # it ran
    placeholders = symbolic.graphs[0].graph.find_nodes(op="placeholder")
    assert any(isinstance(p.meta["val"], torch.SymInt) for p in placeholders)


def _small_moe() -> nn.Module:
    """One layer of two experts: the same routing, a quarter of the graph."""
    torch.manual_seed(0)
    return _RoutedMoE(experts=2, layers=1)


def _estimate_moe(scope: str, capture: bool) -> Any:
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=capture):
        return hyper_offload.estimate(_small_moe(), (x,), budget=0.1, inner_compiler="aot_eager",
                                      budget_scope=scope, recompute="off")


def _routed(reports: Any) -> list[Any]:
    return [s for report in reports for s in report.sizes if s.hint is None]


def test_estimate_plans_the_routed_moe_as_the_backend_does_at_torchs_bound():
    """Issue 45, case 4: ``estimate`` raised torch's bare DynamicOutputShapeException; now
    the step plan of the fake step is the backend's, each expert's rows at 64."""
    estimate = _estimate_moe("step", capture=True)
    routed = _routed(estimate.regions)
    assert len(routed) >= 2 and all(s.bound is SizeBound.RANGE and s.planned == 64
                                    for s in routed)
    torch._dynamo.reset()
    backend = hyper_offload.backend(inner_compiler="aot_eager", max_resident_activation_mb=0.1,
                                    recompute="off")
    compiled = torch.compile(_small_moe(), backend=backend)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), backend.measuring():
        compiled(x).backward()  # measured as the estimate measures its fake step
    (real,) = backend.reports
    assert [str(s) for s in real.sizes] == [str(s) for s in estimate.regions[0].sizes]
    # The same step plan (what each invocation keeps and moves); the bytes no plan moves
    # count at the bound in the estimate, at this step's row counts in the real run.
    step = backend.step_report
    assert [(i.keep, i.kept_bytes, i.moved_bytes) for i in estimate.step.invocations] == [
        (i.keep, i.kept_bytes, i.moved_bytes) for i in step.invocations]
    assert estimate.step.floor_peak_bytes == step.floor_peak_bytes
    assert estimate.step.moved_bytes > 0 and step.peak_without_offload_bytes > 0.1 * (1 << 20)


def test_estimate_of_the_routed_moe_in_eager_code_names_the_flag_or_plans_one_region():
    """Without capture_dynamic_output_shape_ops Dynamo runs the routing loop eagerly (no
    region at all): the step scope says so and names the fixes; the region scope (no
    Dynamo) plans the model as one region, the rows at torch's bound."""
    with pytest.raises(hyper_offload.ConfigurationError,
                       match="compiled no region.*capture_dynamic_output_shape_ops"):
        _estimate_moe("step", capture=False)
    region = _estimate_moe("region", capture=False).region
    assert all(s.planned == 64 for s in _routed([region])) and len(_routed([region])) >= 2


def test_the_steps_recompute_search_runs_on_the_routed_moe(caplog):
    """Issue 45, case 4: the step scope's re-lowering of a region with data-dependent sizes
    failed (DynamicOutputShapeException: it traced outside Dynamo's shape environment)."""
    # Two steps: the first asks for the search, the second runs what it chose.
    batches = [(torch.randn(64, 32, generator=torch.Generator().manual_seed(i)),)
               for i in range(2)]

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch._dynamo.reset()
        plain_model = _small_moe()
        plain = _train(plain_model, torch.compile(plain_model, backend=_Counting()), batches)
        torch._dynamo.reset()
        model = _small_moe()
        # A link this slow stalls every copy: the step asks for the recompute search.
        backend = hyper_offload.backend(inner_compiler="aot_eager", transfer_bandwidth_gbps=1e-3,
                                        max_resident_activation_mb=0.1)
        with caplog.at_level("INFO", logger="hyper_offload"):
            steps = _train(model, torch.compile(model, backend=backend), batches)
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "search failed" in m], messages
    assert any("searched on the step: recompute=auto" in m for m in messages)
    assert all(region.relowered for region in backend.regions)
    for number, (got, want) in enumerate(zip(steps, plain), 1):
        assert torch.equal(got["loss"], want["loss"]), f"step {number}"
        assert all(torch.equal(a, b) for a, b in zip(got["grads"], want["grads"])), number
