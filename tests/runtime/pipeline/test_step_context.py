"""Structure of the schedule → step-runner boundary.

The step runner gets a frozen :class:`StepContext` built by the schedule, never the
schedule itself, and imports nothing of the schedule's (so the two modules form no import
cycle, lazy and ``TYPE_CHECKING`` imports included). The run tests use one in-process
gloo rank (a ``HashStore``), so they need no worker processes.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import pytest
import torch

from tests.integration.import_graph import import_graph

_PIPELINE = "hyper_offload.pipeline"  # the door: its schedule and step runner
_MICRO = 4


def test_step_runner_imports_nothing_of_the_schedule() -> None:
    graph = import_graph()
    runner = graph[f"{_PIPELINE}.step_runner"]
    # The package itself counts: its _LAZY table loads the schedule on attribute access.
    assert f"{_PIPELINE}.schedule" not in runner and _PIPELINE not in runner, sorted(runner)
    assert f"{_PIPELINE}.step_runner" in graph[f"{_PIPELINE}.schedule"]


def test_step_observer_stays_importable_from_the_runner_and_the_package() -> None:
    from hyper_offload.pipeline import StepObserver as from_package
    from hyper_offload.pipeline.step_runner import StepObserver

    assert StepObserver is from_package


def _loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def _schedule(swap: bool) -> tuple[Any, torch.nn.Module]:
    from torch.distributed.pipelining import PipelineStage

    from hyper_offload.pipeline import PipelineSwapSchedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    return PipelineSwapSchedule([stage], _MICRO, schedule="gpipe", loss_fn=_loss_fn, swap=swap), model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)


def test_context_is_frozen_data_without_the_schedule(one_rank: None) -> None:
    sched, _ = _schedule(swap=True)
    try:
        context = sched._step_context()
        assert dataclasses.is_dataclass(context)
        with pytest.raises(dataclasses.FrozenInstanceError):
            context.rank = 1  # type: ignore[misc]
        with pytest.raises(TypeError):
            context.stages[1] = None  # type: ignore[index]
        assert all(getattr(context, f.name) is not sched for f in dataclasses.fields(context))
        assert sched not in gc.get_referents(context)
        assert context.order == tuple(sched.order) and context.session is sched.session
        assert context.losses is sched._internal_losses
        assert (context.rank, context.num_stages, context.n_microbatches) == (0, 1, _MICRO)
        assert dict(context.stages) == sched.stage_by_index
    finally:
        sched.close()


def test_one_rank_step_matches_the_plain_model_bit_for_bit(one_rank: None) -> None:
    x, y = _batch()
    results = []
    for swap in (False, True):
        sched, model = _schedule(swap)
        try:
            losses: list[torch.Tensor] = []
            sched.step(x, target=y, losses=losses)
        finally:
            sched.close()
        assert len(losses) == _MICRO and not sched._internal_losses
        results.append((torch.stack(losses), [p.grad.clone() for p in model.parameters()]))
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    expected = [_loss_fn(reference(xm), ym) for xm, ym in zip(x.chunk(_MICRO), y.chunk(_MICRO))]
    for loss in expected:
        (loss / _MICRO).backward()
    for got_losses, got_grads in results:
        assert torch.equal(got_losses, torch.stack(expected).detach())
        for got, want in zip(got_grads, reference.parameters()):
            assert torch.allclose(got, want.grad, rtol=0, atol=1e-7), (got - want.grad).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_a_kept_last_stage_output_drops_its_graph_after_its_backward(one_rank: None) -> None:
    """``Linear`` on a 3-D input returns a view, which torch cannot detach in place after
    the backward; kept for ``return_outputs`` it would hold the chunk's unfreed autograd
    nodes (and their saved tensors) until the step ends. The runner detaches it out of
    place: the returned output has no graph and the same values."""
    from torch.distributed.pipelining import PipelineStage

    from hyper_offload.pipeline import PipelineSwapSchedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    sched = PipelineSwapSchedule([stage], _MICRO, schedule="gpipe", loss_fn=_loss_fn)
    x = torch.randn(8, 3, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 3, 4, generator=torch.Generator().manual_seed(2))
    try:
        sched.step(x, target=y, losses=[])  # initialises the stage
        out = sched.step(x, target=y, losses=[])
    finally:
        sched.close()
    assert out.grad_fn is None and all(chunk.grad_fn is None for chunk in stage.output_chunks)
    with torch.no_grad():
        # per micro-batch, as the stage ran it (a matmul over the whole batch may round
        # differently: the kernel's blocking depends on the row count)
        assert torch.equal(out, torch.cat([model(chunk) for chunk in x.chunk(_MICRO)]))
