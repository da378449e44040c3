"""The eager door (``OffloadSession``) inside real training stacks, on 2 gloo ranks spawned
once for the module (issues 41 and 42).

Every case runs the stack plain and then inside one session at half of the plain run's
most saved device bytes on each rank (``eager_stacks_cases``), 3 steps with an optimizer
step between them. Asserted per rank and step: the loss and every gradient ``torch.equal``
to the plain run's, and, once the session replays, the saved device bytes within the
budget + 256 KiB and something moved.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ..runtime.pipeline.dist_harness import Cluster
from . import eager_stacks_cases as cases

pytestmark = [pytest.mark.slow,  # 2 gloo processes
              pytest.mark.skipif(not dist.is_available(), reason="torch.distributed missing")]

SLACK = 256 * 1024


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    workers = Cluster(2)
    try:
        yield workers
    finally:
        workers.close()


def assert_exact_within_budget(results: list[dict[str, Any]], where: str) -> None:
    """Every rank: exact at every step; within the budget and moving once replaying."""
    for rank, case in enumerate(results):
        budget = case["budget"]
        assert budget > 0
        replayed = 0
        for number, (plain, step) in enumerate(zip(case["plain"], case["steps"], strict=True)):
            at = f"{where}, rank {rank}, step {number}"
            if plain["loss"] is not None:
                assert torch.equal(step["loss"], plain["loss"]), at
            assert len(step["grads"]) == len(plain["grads"]) > 0, at
            for index, (got, want) in enumerate(zip(step["grads"], plain["grads"])):
                assert torch.equal(got, want), f"{at}: gradient {index} differs"
            if step["phase"] == "replay":
                replayed += 1
                assert step["saved"] <= budget + SLACK, (
                    f"{at}: {step['saved']} B saved for a budget of {budget} B")
                assert step["moved"] > 0, f"{at}: nothing moved"
        assert replayed >= 1, f"{where}, rank {rank}: never replayed"
        assert case["steps"][-1]["warmups"] <= 3 and case["steps"][-1]["settled"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_torch_pipelining_through_the_session_is_exact_at_every_step(cluster, schedule):
    """Issue 41 case 5: pipelining's P2P runs as ``c10d.send`` / ``recv_``, whose
    communication ends at a ``Work.wait()`` no op shows; the session pins what they touch
    until the end of the step (without the pin: gradients wrong from step 2). The
    schedule sets its stage up in its first step: the session re-warms once by itself."""
    results = cluster.run(cases.pipeline, (schedule, cases.STEPS, {}))
    assert_exact_within_budget(results, f"pipelining {schedule}")


def test_ddp_through_the_session_settles_and_is_exact(cluster):
    """DDP rebuilds its buckets on its second iteration only: two re-warms, then it
    replays; its buckets exist before the steps that replay, so nothing pins them."""
    results = cluster.run(cases.ddp, (5, {}, False))
    assert_exact_within_budget(results, "DDP")
    assert all(case["steps"][-1]["warmups"] == 3 for case in results)


def test_a_compiled_block_inside_ddp_and_the_session_is_counted(cluster):
    """The middle block is ``torch.compile``d: it runs its compiled code as one opaque op;
    what it saves is held, counted and planned around (never a silent feasible)."""
    results = cluster.run(cases.ddp, (5, {}, True))
    assert_exact_within_budget(results, "DDP with a compiled block")
    assert all(step["region_bytes"] > 0 for case in results for step in case["steps"])


def test_fsdp2_through_the_session_leaves_its_buffers_in_place(cluster):
    """FSDP2's all-gather and reduce-scatter buffers are made or filled by ``fsdp::`` ops:
    recorded at 0 bytes, never bound or moved; the activations are planned."""
    results = cluster.run(cases.fsdp2, (5, {}))
    assert_exact_within_budget(results, "FSDP2")
    assert all(case["foreign"] > 0 for case in results)


def test_the_swap_executor_inside_a_session_is_planned_by_it_or_refused_at_warmup(cluster):
    """``PipelineSwapSchedule(swap=True)`` swaps the chunks itself: the session refuses at
    the step's first op on every rank (no pool error, no rank left hanging: the same
    processes run the next case). With ``swap=False`` the session plans every activation
    of the rank, the chunks across micro-batches included, under its one budget."""
    for message in cluster.run(cases.swap_refused):
        assert message is not None and "PipelineSwapSchedule(swap=True)" in message
        assert "swap=False inside the session" in message and "op 0 " in message
    results = cluster.run(cases.pipeline, ("swap-executor", cases.STEPS, {}))
    assert_exact_within_budget(results, "PipelineSwapSchedule(swap=False)")
