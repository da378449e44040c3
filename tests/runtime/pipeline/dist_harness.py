"""A small pool of gloo worker processes, spawned once and reused by a test module.

``Cluster(world_size)`` spawns ``world_size`` processes that join one gloo process group
(with a timeout, so a failing rank never hangs CI) and then serve tasks: ``run(fn, arg)``
sends ``fn`` (a module-level function, pickled by name) and ``arg`` to every rank, each
calls ``fn(ctx, arg)`` and the per-rank results come back as a list. A rank's exception
comes back as its formatted traceback and is raised in the test process.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

GLOO_TIMEOUT_S = 60
RESULT_TIMEOUT_S = 240


class WorkerContext:
    """What a task sees on its rank: rank, world size, and cached sub-groups."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._groups: dict[int, Any] = {}
        self.self_group: Any = None

    def group(self, size: int) -> Any:
        """The process group of ranks ``0..size-1`` (created on every rank at start-up)."""
        return self._groups[size]


def free_port() -> int:
    """A TCP port on localhost that is free now (the gloo rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, group_sizes: tuple[int, ...], tasks: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    ctx = WorkerContext(rank, world_size)
    for size in group_sizes:
        # new_group is collective over the world: every rank creates every sub-group.
        group = dist.new_group(list(range(size)), timeout=timedelta(seconds=GLOO_TIMEOUT_S))
        ctx._groups[size] = group if rank < size else None
    ctx._groups[world_size] = dist.group.WORLD
    # One single-rank group per rank (a 1-way data-parallel mesh for FSDP2 tests).
    ctx.self_group, _ = dist.new_subgroups(1, timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, arg = task
        try:
            results.put((rank, True, fn(ctx, arg)))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class Cluster:
    """``world_size`` gloo workers serving tasks until :meth:`close`."""

    def __init__(self, world_size: int, group_sizes: tuple[int, ...] = ()) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, port, tuple(s for s in group_sizes if s != world_size),
                      self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()

    def run(self, fn: Callable[[WorkerContext, Any], Any], arg: Any = None) -> list[Any]:
        """Run ``fn(ctx, arg)`` on every rank; returns results by rank, raises on failure."""
        for queue in self._tasks:
            queue.put((fn, arg))
        out: dict[int, Any] = {}
        failures: list[str] = []
        for _ in range(self.world_size):
            rank, ok, value = self._results.get(timeout=RESULT_TIMEOUT_S)
            if ok:
                out[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            raise AssertionError("worker task failed:\n" + "\n".join(failures))
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for queue in self._tasks:
            queue.put(None)
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
