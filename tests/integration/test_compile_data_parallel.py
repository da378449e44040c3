"""The ``hyper_offload`` compile backend inside DDP and FSDP2, 2 gloo ranks on CPU.

One spawned job (``dp_compile_worker.worker``) runs every case on both ranks: DDP and
FSDP2 (``fully_shard`` per layer and on the root), each under aot_eager and Inductor
(``torch.use_deterministic_algorithms(True)``), one step compiled with plain
``torch.compile`` and the same inner compiler, and one with the offload backend at a
budget of 0 MiB. The tests here assert on what the ranks sent back:

* loss and every gradient (FSDP2: each rank's gradient shard) ``torch.equal``;
* the budget really offloads, and every compiled region was planned (DDPOptimizer
  splits the DDP graph at bucket boundaries: several regions);
* FSDP2's unsharded parameters are never offloaded. In torch 2.13 FSDP2's hooks are
  ``torch._dynamo.disable``d, so the all-gather never enters a graph: Dynamo breaks the
  graph at every ``fully_shard`` module and the unsharded parameters enter each region
  as graph inputs, which the trace never makes offloadable (they are saved for the
  backward and kept). The tests pin both halves of that.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from . import dp_compile_worker as worker_module
from .ranks import WORLD, rank_case, spawn_ranks

pytestmark = [pytest.mark.slow,  # four gloo processes compiling under DDP / FSDP2
              pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")]

CASES = [f"{kind}-{inner}" for kind, inner in worker_module.CASES]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Per rank: case name -> what the worker saved (see ``dp_compile_worker``)."""
    return spawn_ranks(worker_module.worker, tmp_path_factory.mktemp("dp_compile"))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("rank", range(WORLD))
def test_loss_and_gradients_equal_the_run_without_offload(results, name, rank):
    case = rank_case(results, name, rank)
    (want_loss, want_grads), (loss, grads) = case["reference"], case["offload"]
    assert torch.equal(loss, want_loss)
    layers = worker_module.LAYERS[name.split("-")[0]]
    assert len(grads) == len(want_grads) == 6 * layers + 2  # LN, 2 Linear per layer; head
    for index, (got, want) in enumerate(zip(grads, want_grads)):
        assert torch.equal(got, want), f"gradient {index} differs"


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("ddp")])
def test_ddp_gradients_are_reduced_across_ranks(results, name):
    # Each rank had its own data: equal gradients on both ranks mean DDP's all-reduce
    # ran through the compiled, offloading backward.
    ranks = [rank_case(results, name, r)["offload"] for r in range(WORLD)]
    assert not torch.equal(ranks[0][0], ranks[1][0])  # different local losses
    for a, b in zip(ranks[0][1], ranks[1][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("rank", range(WORLD))
def test_every_region_is_planned_and_the_budget_really_offloads(results, name, rank):
    case = rank_case(results, name, rank)
    regions = case["regions"]
    assert len(regions) == case["num_regions"]  # no region escaped the partitioner
    if name.startswith("ddp"):
        assert len(regions) >= 2 * worker_module.LAYERS["ddp"]  # DDPOptimizer's bucket splits
    else:
        # a region per fully_shard layer, one of them shared by two layers
        assert 1 <= len(regions) < worker_module.LAYERS["fsdp"]
    for region in regions:
        report = region["report"]
        # The step scope plans each region's floor under its own peak (the 0 MiB budget
        # is the step's): every movable saved activation moves, no op is over that bound.
        assert report["budget_bytes"] >= report["predicted_peak_after"] > 0
        assert report["infeasible_ops"] == []
        assert report["bytes_d2h"] == report["bytes_h2d"]
        assert len(region["offloaded_sources"]) == len(report["offloaded"])
    assert sum(len(r["report"]["offloaded"]) for r in regions) > 0
    assert sum(r["report"]["transfers"] for r in regions) > 0


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("fsdp")])
@pytest.mark.parametrize("rank", range(WORLD))
def test_fsdp_unsharded_parameters_are_graph_inputs_and_never_offloaded(results, name, rank):
    case = rank_case(results, name, rank)
    for region in case["regions"]:
        placeholders = set(region["fw_placeholders"])
        # torch 2.13: FSDP2's all-gather runs in dynamo-disabled hooks, never in a graph.
        assert region["fw_collectives"] == ()
        # The unsharded weights (a Layer's LayerNorm weight and two Linear weights at
        # least) are saved for the backward as graph inputs, and kept resident.
        kept = set(region["saved_inputs"])
        assert kept <= placeholders
        assert len(kept) >= 3
        assert not kept & set(region["offloadable"])
        assert not kept & set(region["report"]["offloaded"])
        # Whatever was offloaded was created by a compute op of the forward graph.
        for source in region["offloaded_sources"]:
            assert source.startswith("fw:") and source[3:] not in placeholders
