"""The partitioner the backend hands the inner compiler: stock min-cut, then our lowering.

AOTAutograd calls a partitioner with the joint graph of one region; Inductor's supported
hook is ``torch._inductor.config.custom_partitioner_fn`` (a ``CustomPartitionerFn``).
:class:`OffloadPartitioner` runs torch's min-cut partition (searched with recompute where
the request says so, :mod:`.recompute.search`), plans it, and lowers the plan onto the
``hyper_offload::`` transfer ops (:func:`~.region_plan.lower_region`). Everything it needs
comes in one :class:`PartitionRequest`; what it made comes back as one
:class:`PartitionResult` (:attr:`OffloadPartitioner.result`). Nothing else is shared.

**The plan it leaves on disk: what a warm restart needs besides the compiled code.**
AOTAutograd's and Inductor's caches store a region's compiled forward and backward, with
the transfer ops the plan put in them, and serve them to a later process without running
the partitioner; the graphs then run as they are (the ops reach their runtime at run
time, see :mod:`hyper_offload.runtime.transfer_records`). What those caches do not keep
is our record of the plan (:class:`~.region_plan.PlannedRegion`: the trace, the schedule,
the checks, the region report), which ``HyperOffloadBackend.reports`` and
``regions[i].planned`` show. The partitioner stores it next to Inductor's cache
(:func:`store_plan`; the backend reads it back with :func:`load_plan`), under a key
computed from what Dynamo hands the backend, before anything is compiled:

* the Dynamo graph's code, and the metadata of its example inputs and of the graph
  module's own parameters and buffers (what AOTAutograd's key is computed from too);
* the options' cache key, a hash of the library's planning sources and torch's version
  (what our partitioner's ``uuid()`` puts in AOTAutograd's key).

Invariants: a stored plan is only ever *read* for a region whose compiled code came from
the cache (the partitioner did not run); a region the partitioner planned is stored,
replacing any older entry. A missing, unreadable or stale entry only costs the report:
the region still runs its cached, planned code. Files are written atomically (temporary
file, then rename), so concurrent processes never read a partial entry.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from hyper_offload import progress
from hyper_offload.passes import ResidencySchedule, ScheduleError
from hyper_offload.passes.fx.cost_model import DeviceThroughput
from hyper_offload.runtime.device import TransferBandwidth

from .options import BackendOptions
from .recompute.candidates import Scorer
from .recompute.search import search_region
from .region_plan import GraphPlan, PlannedRegion, lower_region, plan_with_schedule
from .region_report import log_region_report

__all__ = [
    "OffloadPartitioner", "PartitionRequest", "PartitionResult", "cache_key", "load_plan",
    "source_digest", "store_plan",
]


@dataclass(frozen=True)
class PartitionRequest:
    """What one compile of a region asks the partitioner for.

    ``floor``: plan the partition at its floor (the step scope); ``schedule``: lower it
    with this schedule made for the step and the budget it was checked under instead (the
    graphs traced again must be the ones ``expected_ops`` names: the floor's op nodes);
    ``scorer``: search partitions with recompute, each ranked on the whole step (a winner
    the scorer made a schedule for is lowered with it); ``plan_key``: where to store the
    plan for a cache that serves compiled code without running the partitioner."""

    region: int
    options: BackendOptions
    bandwidth: Callable[[fx.GraphModule], TransferBandwidth]
    throughput: DeviceThroughput | None
    planning_code: str
    activation_inputs: frozenset[str] = frozenset()
    floor: bool = False
    schedule: tuple[ResidencySchedule, int] | None = None
    expected_ops: tuple[str, ...] | None = None
    scorer: Scorer | None = None
    plan_key: str | None = None


class PartitionResult(NamedTuple):
    """What the partitioner made: the lowered graphs, their plan, the schedule they were
    lowered with (None: the partition's floor or the region scope's plan), the floor of
    the partition (step scope), and the plan handed to the lowering."""

    graphs: tuple[fx.GraphModule, fx.GraphModule]
    planned: PlannedRegion
    schedule: ResidencySchedule | None
    floor: GraphPlan | None
    attempted: GraphPlan


class OffloadPartitioner(CustomPartitionerFn):
    """Stock min-cut partition (searched with recompute), then :func:`lower_region`."""

    def __init__(self, request: PartitionRequest) -> None:
        self.request = request
        self.result: PartitionResult | None = None
        self.attempted: GraphPlan | None = None
        """The plan handed to the lowering, set before it runs (kept if it raises)."""

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        request, options = self.request, self.request.options
        num_fwd_outputs = kwargs["num_fwd_outputs"]

        def partition(joint: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule]:
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        started = time.perf_counter()
        progress.note(f"region {request.region}: partitioning and planning")
        choice = search_region(
            gm, partition, num_fwd_outputs=num_fwd_outputs, options=options,
            bandwidth=request.bandwidth, region=request.region, floor=request.floor,
            throughput=request.throughput, activation_inputs=request.activation_inputs,
            score=request.scorer,
        )
        schedule, plan = self._lowering(choice.plan)
        self.attempted = plan
        planned = lower_region(
            choice.fw, choice.bw, plan, num_fwd_outputs=num_fwd_outputs, options=options,
            region=request.region, recompute=choice.report,
            search_seconds=time.perf_counter() - started,
        )
        self.result = PartitionResult(
            (choice.fw, choice.bw), planned, schedule,
            choice.plan if request.floor else None, plan,
        )
        if request.plan_key is not None:  # an inner compiler with a cache (Inductor)
            store_plan(request.plan_key, planned)
        log_region_report(planned.report)
        return choice.fw, choice.bw

    def _lowering(self, floor: GraphPlan) -> tuple[ResidencySchedule | None, GraphPlan]:
        """The schedule this compile lowers with (None: the partition's ``floor``) and
        its plan: the one asked for, or the one the scorer made for the chosen partition,
        checked on this compile's trace. Raises ``ScheduleError`` when the graphs traced
        again are not those the step planned."""
        request = self.request
        asked = request.schedule
        if asked is None and request.scorer is not None:
            asked = getattr(request.scorer, "schedules", {}).get(id(floor))
        if asked is None:
            return None, floor
        if request.schedule is not None and request.expected_ops is not None and (
                request.expected_ops != floor.fx_trace.op_nodes):
            raise ScheduleError(
                f"hyper_offload region {request.region}: the graphs traced again differ from "
                "those the step plan was made for; the region keeps the lowering it runs"
            )
        schedule, budget = asked
        return schedule, plan_with_schedule(floor, schedule, budget, region=request.region)

    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadPartitioner:
        # Inductor deep-copies config values when it snapshots its config; the request
        # carries functions of the backend by reference on purpose.
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # Inductor pickles its config into cache keys: stand for this object by its uuid.
        return (str, (repr(self.uuid()),))

    def uuid(self) -> Any:
        return (self.request.planning_code, self.request.options.cache_key())


_SUBDIR = "hyper_offload_plans"


def source_digest(paths: Iterable[Path]) -> str:
    """SHA-256 of the given ``.py`` files and of every ``.py`` file under the given
    directories (names and contents): any edit to planning or lowering changes the key."""
    digest = hashlib.sha256()
    for root in paths:
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        for path in files:
            name = path.name if path == root else str(path.relative_to(root))
            digest.update(name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _value_meta(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return (f"T{tuple(value.shape)}{tuple(value.stride())}{value.dtype}{value.device.type}"
                f"{value.requires_grad}")
    return f"{type(value).__name__}:{value}"  # SymInts by symbol, plain numbers by value


def cache_key(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options_key: str, sources: str
) -> str:
    """The key of a region's stored plan (see the module docstring)."""
    parts = [gm.code, options_key, sources, torch.__version__]
    parts += [_value_meta(value) for value in example_inputs]
    parts += [f"{name}={_value_meta(t)}" for name, t in gm.named_parameters()]
    parts += [f"{name}={_value_meta(t)}" for name, t in gm.named_buffers()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _path(key: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / _SUBDIR / f"{key}.pickle"


def store_plan(key: str, planned: PlannedRegion) -> None:
    """Write ``planned`` under ``key``, atomically. A disk error is not the step's
    problem: the plan is then simply not served to the next process."""
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as handle:
            pickle.dump(planned, handle, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(handle.name, path)
    except OSError:
        return


def load_plan(key: str) -> PlannedRegion | None:
    """The plan stored under ``key``, or None when there is none (or it cannot be read:
    written by another version of a class, truncated by a full disk, ...)."""
    try:
        with _path(key).open("rb") as handle:
            planned = pickle.load(handle)  # our own cache directory, like Inductor's pickles
    except (OSError, pickle.UnpicklingError, AttributeError, EOFError, ImportError,
            TypeError, ValueError):
        return None
    return planned if isinstance(planned, PlannedRegion) else None
