"""Symbolic sizes: the size a plan assumes for a symbolic dimension (``dynamic=True``, ``mark_dynamic``,
data-dependent output sizes under ``capture_dynamic_output_shape_ops``).

The compile path plans *one* schedule for every size a region's guards accept, so each
symbol is evaluated at the largest value it may take:

1. the upper bound of the symbol's value range in Dynamo's ``ShapeEnv`` when that is
   finite: what the user declared (``torch._dynamo.mark_dynamic(t, dim, min=2, max=N)``,
   ``torch._check(u0 <= N)``) or what torch derived (``nonzero`` of ``n`` elements has at
   most ``n`` rows). Dynamo guards that range, so a larger size recompiles and is
   planned again: the bound holds for every call of this compiled code;
2. otherwise, for a size Dynamo saw (backed), its hint: the size at the compile. Nothing
   bounds such a size; the plan assumes it and the backend warns when a call exceeds it;
3. otherwise (a data-dependent size with no bound) there is nothing to plan with:
   :class:`~hyper_offload.errors.DynamicShapeError` names the symbol and the fix.

Why the largest value is enough: a schedule fixes which storages are resident at each
op, and every storage's bytes are non-decreasing in each size (products and sums of
sizes), so resident bytes at every op are largest where every symbol is largest. A plan
that fits the budget there fits it at every size in range. (An expression that shrinks
as a size grows, e.g. padding up to a multiple, is evaluated at the same point and is
the one case this rule may misjudge; no model here has one.)

**Sizes decided at run time: the sizes each call really has** (:func:`size_inputs`,
:func:`bucket_of`, :func:`merged_sizes`). A region compiled with symbolic sizes
(``dynamic=True``, automatic dynamic, or ``mark_dynamic``) is lowered once, at its floor: every movable saved activation gets a
``copy_d2h`` that either moves it or keeps a device copy, decided per call by the
runtime. So one compiled graph serves every size, and only *which slots to keep* depends
on the sizes. The backend therefore plans a step for the sizes it ran at (each region's
trace with its symbolic storages evaluated there,
:meth:`~.fx_trace.FxTrace.at_sizes`) and keeps one plan per *size
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

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten
from torch.utils._sympy.numbers import int_oo

from hyper_offload.errors import DynamicShapeError

__all__ = [
    "Bucket",
    "SizeBound",
    "SymbolicSize",
    "bucket_of",
    "merged_sizes",
    "planned_value",
    "planning_size",
    "size_inputs",
    "symbolic_sizes",
    "unbounded_sizes",
]


class SizeBound(str, enum.Enum):
    """Where a symbol's planned value comes from (the module docstring's rules 1 and 2)."""

    RANGE = "RANGE"
    """The upper bound of its guarded range: the plan holds for every size."""
    HINT = "HINT"
    """No upper bound: the size at the compile; a larger size may exceed the budget."""


@dataclass(frozen=True)
class SymbolicSize:
    """One symbol of a region's graphs and the value its plan assumes.

    ``sources`` are Dynamo's names for where the size comes from (e.g.
    ``L['idx'].size()[1]``; empty for a data-dependent size); ``hint`` is the size at the
    compile (None for a data-dependent one)."""

    symbol: str
    sources: tuple[str, ...]
    planned: int
    bound: SizeBound
    hint: int | None

    def __str__(self) -> str:
        where = f" ({', '.join(self.sources)})" if self.sources else ""
        if self.bound is SizeBound.RANGE:
            return f"{self.symbol}{where} <= {self.planned}: planned at its bound"
        return (f"{self.symbol}{where} unbounded: planned at {self.planned}, its size at "
                "the compile")


def planned_value(symbol: sympy.Symbol, shape_env: Any, where: str) -> tuple[int, SizeBound]:
    """The value a plan assumes for ``symbol`` of ``shape_env`` and which rule gave it."""
    value_range = shape_env.var_to_range.get(symbol)
    upper = None if value_range is None else value_range.upper
    if upper is not None and upper not in (int_oo, sympy.oo):
        return int(upper), SizeBound.RANGE
    hint = shape_env.backed_var_to_val.get(symbol)
    if hint is not None:
        return int(hint), SizeBound.HINT
    raise DynamicShapeError(
        f"{where}: size {symbol} is data-dependent and unbounded, so no plan can be checked "
        "against the budget. Fix: bound it where it is made (torch._check(t.size(d) <= N) "
        "after the op that makes it, or the op's own bound, e.g. output_size=), or compile "
        "without capture_dynamic_output_shape_ops"
    )


def planning_size(value: Any, where: str) -> int:
    """``value`` as the int a plan assumes: plain ints pass; a ``SymInt`` is evaluated
    with every free symbol at its planned value (module docstring)."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    node = value.node
    expr = node.expr
    if not expr.free_symbols:
        return int(expr)
    values = {s: planned_value(s, node.shape_env, where)[0] for s in expr.free_symbols}
    return int(expr.xreplace(values))


def symbolic_sizes(*graphs: fx.GraphModule) -> tuple[SymbolicSize, ...]:
    """Every symbol in the placeholders' and nodes' fake values of ``graphs``, with the
    value the plan assumes for it, ordered by name."""
    found: dict[sympy.Symbol, Any] = {}
    for gm in graphs:
        for node in gm.graph.nodes:
            flat, _ = tree_flatten(node.meta.get("val"))
            for value in flat:
                for size in _sizes_of(value):
                    if isinstance(size, torch.SymInt):
                        for symbol in size.node.expr.free_symbols:
                            found.setdefault(symbol, size.node.shape_env)
    sizes = []
    for symbol, shape_env in sorted(found.items(), key=lambda item: str(item[0])):
        planned, bound = planned_value(symbol, shape_env, f"symbol {symbol}")
        hint = shape_env.backed_var_to_val.get(symbol)
        sources = tuple(s.name for s in shape_env.var_to_sources.get(symbol, ()))
        sizes.append(SymbolicSize(str(symbol), sources, planned, bound,
                                  None if hint is None else int(hint)))
    return tuple(sizes)


def _sizes_of(value: Any) -> tuple[Any, ...]:
    if isinstance(value, torch.Tensor):
        return (*value.shape, value.storage_offset())
    if isinstance(value, torch.SymInt):
        return (value,)
    return ()


def unbounded_sizes(values: Sequence[Any]) -> dict[int, tuple[str, int]]:
    """The entries of ``values`` (a region's graph inputs) that are sizes with no upper
    bound, whose plan assumes their hint: ``{index: (symbol, planned value)}``."""
    found = {}
    for index, value in enumerate(values):
        if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
            planned, bound = planned_value(value.node.expr, value.node.shape_env,
                                           f"graph input {index}")
            if bound is SizeBound.HINT:
                found[index] = (str(value.node.expr), planned)
    return found


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
