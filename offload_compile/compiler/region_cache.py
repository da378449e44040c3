"""What a warm restart needs besides the compiled code: each region's plan, on disk.

AOTAutograd's and Inductor's caches store a region's compiled forward and backward, with
the transfer ops the plan put in them, and serve them to a later process without running
the partitioner; the graphs then run as they are (the ops reach their runtime at run
time, see :mod:`hyper_offload.runtime.transfer_scope`). What those caches do not keep
is our record of the plan (:class:`~.region_plan.PlannedRegion`: the trace, the schedule,
the checks, the region report), which ``HyperOffloadBackend.reports`` and
``regions[i].planned`` show. This module stores it next to Inductor's cache, under a key
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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from .region_plan import PlannedRegion

__all__ = ["cache_key", "load_plan", "source_digest", "store_plan"]

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
