"""Run a worker on ``WORLD`` gloo ranks once and read back what each rank saved.

The data-parallel and tensor-parallel tests (``test_compile_data_parallel.py``,
``test_step_budget_distributed.py``, ``test_tensor_parallel.py``) spawn one job whose ``worker(rank, world, port,
out_dir)`` saves ``rank<r>.pt`` (case name -> results, or ``{"error": traceback}``).

A case that raises on one rank ends that rank's job (after saving): the other ranks may
be waiting in one of the case's collectives, which would hold them until the gloo
timeout (10 minutes; CI once failed that way, 12-07, with only "timed out" to show), while
``spawn`` terminates them at once and re-raises the rank's traceback here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from ..runtime.pipeline.dist_harness import free_port

WORLD = 2


def spawn_ranks(
    worker: Callable[..., None], out_dir: Path, world: int = WORLD, *extra: Any
) -> list[dict[str, Any]]:
    """Per rank, what ``worker(rank, world, port, out_dir, *extra)`` saved. ``join=True``
    re-raises a rank's failure here; the workers' gloo timeout bounds a hung rank."""
    mp.spawn(worker, args=(world, free_port(), str(out_dir), *extra), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def rank_case(results: list[dict[str, Any]], name: str, rank: int) -> dict[str, Any]:
    """Case ``name`` on ``rank``; fails the test with the rank's traceback if it raised."""
    case = results[rank][name]
    if "error" in case:
        pytest.fail(f"rank {rank}, case {name} raised:\n{case['error']}")
    return case
