"""Sizes decided at run time: the step plan of the sizes a step really has.

A region compiled with symbolic sizes (``dynamic=True``, automatic dynamic, or
``mark_dynamic``) is lowered once, at its floor: every movable saved activation gets a
``copy_d2h`` that either moves it or keeps a device copy, decided per call by the
runtime. So one compiled graph serves every size, and only *which slots to keep* depends
on the sizes. The backend therefore plans a step for the sizes it ran at (each region's
trace with its symbolic storages evaluated there,
:meth:`~hyper_offload.passes.fx.fx_trace.FxTrace.at_sizes`) and keeps one plan per *size
bucket*: the step's events and each invocation's sizes (its graph inputs that are sizes,
which Dynamo passes as ints). A later step with the same sizes reuses that plan; one with
sizes never seen runs at the floor (nothing kept: the least any plan keeps) and is planned
at its end.

Without this the plan made at the first step's sizes was applied to every later one: a
longer sequence kept the same slots, each larger, and went over the budget (HF Llama
under ``dynamic=True`` at 50%: 0.76 MiB held for a 0.475 MiB budget); and with
``mark_dynamic(..., max=N)`` every change of length planned the step again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sympy
import torch

__all__ = ["Bucket", "bucket_of", "merged_sizes", "size_inputs"]

Bucket = tuple[tuple[str, int], ...]
"""One call's sizes: ``(symbol, value)`` pairs, sorted by symbol (empty: static sizes)."""


def size_inputs(example_inputs: Sequence[Any]) -> dict[int, str]:
    """``{graph input index: symbol}`` for the inputs of a region that are a size (a
    ``SymInt`` that is one symbol, as Dynamo passes a dynamic dimension)."""
    found = {}
    for index, value in enumerate(example_inputs):
        if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
            found[index] = str(value.node.expr)
    return found


def bucket_of(inputs: Mapping[int, str], args: Sequence[Any]) -> Bucket:
    """The sizes of one call with ``args`` (``inputs``: :func:`size_inputs`)."""
    return tuple(sorted(
        (symbol, int(args[index])) for index, symbol in inputs.items()
        if index < len(args) and isinstance(args[index], int)
    ))


def merged_sizes(buckets: Iterable[Bucket]) -> dict[str, int]:
    """Each symbol at its largest value among ``buckets`` (a region invoked with several
    sizes in one step is planned at the largest: bytes only grow with sizes)."""
    values: dict[str, int] = {}
    for bucket in buckets:
        for symbol, value in bucket:
            values[symbol] = max(value, values.get(symbol, value))
    return values
