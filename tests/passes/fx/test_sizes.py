"""The size a plan assumes for a symbolic dimension (``passes.fx.sizes``): a guarded
bound when there is one, else the hint, else a clear error."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv, constrain_range

from hyper_offload.errors import DynamicShapeError
from hyper_offload.passes.fx.sizes import SizeBound, planned_value, planning_size, unbounded_sizes


def _backed(env: ShapeEnv, name: str, hint: int) -> torch.SymInt:
    source = ConstantSource(name)
    return env.create_symintnode(env.create_symbol(hint, source), hint=hint, source=source)


def test_plain_ints_pass_and_an_unbounded_size_is_planned_at_its_hint():
    env = ShapeEnv()
    s = _backed(env, "seq", 48)
    assert planning_size(7, "here") == 7
    assert planning_size(s, "here") == 48
    assert planning_size(s * 4 + 2, "here") == 48 * 4 + 2
    assert planned_value(s.node.expr, env, "here") == (48, SizeBound.HINT)


def test_a_declared_bound_is_the_planned_size_of_every_expression_of_it():
    env = ShapeEnv()
    s, t = _backed(env, "seq", 48), _backed(env, "batch", 3)
    constrain_range(s, min=2, max=64)
    assert planned_value(s.node.expr, env, "here") == (64, SizeBound.RANGE)
    assert planning_size(s * s + t, "here") == 64 * 64 + 3  # t has no bound: its hint
    assert planning_size(s // 2, "here") == 32


def test_a_data_dependent_size_needs_a_bound_and_the_error_names_the_fix():
    env = ShapeEnv()
    u = env.create_unbacked_symint()
    with pytest.raises(DynamicShapeError, match=r"here: size u0 is data-dependent.*torch\._check"):
        planning_size(u * 8, "here")
    torch._check(u <= 100)
    torch._check(u >= 0)
    assert planning_size(u * 8, "here") == 800


def test_unbounded_sizes_lists_only_graph_inputs_planned_at_their_hint():
    env = ShapeEnv()
    free, bounded = _backed(env, "free", 16), _backed(env, "bounded", 32)
    constrain_range(bounded, min=2, max=128)
    inputs = [torch.zeros(2), free, 5, bounded]
    assert unbounded_sizes(inputs) == {1: (str(free.node.expr), 16)}
