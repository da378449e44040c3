"""What a consumer can observe of a tensor besides its bytes: :class:`TensorProperties`.

The round-trip rule of every door (docs/architecture.md, "Round trips"): whatever leaves
the device comes back as a tensor equal to the one that left in all of these, or stays on
the device. The compile door's lowering check compares a saved tensor with what its
backward readers get (fake values); ``verify`` compares a reload with what its copy read
(real tensors). Imports only torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["TensorProperties"]


class TensorProperties(NamedTuple):
    """What a consumer (a backward) can observe of a tensor besides its bytes: memory
    format is in the strides, aliasing between saved values in the storage they share.

    Sizes, strides and offset are ints, or for a symbolic one its sympy expression: a
    plan is pickled into Inductor's cache with its region, and a ``SymInt`` holds its
    whole shape environment."""

    dtype: torch.dtype
    size: tuple[Any, ...]
    stride: tuple[Any, ...]
    offset: Any
    conj: bool
    neg: bool

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorProperties:
        return cls(
            tensor.dtype, _expressions(tensor.shape), _expressions(tensor.stride()),
            _expression(tensor.storage_offset()), tensor.is_conj(), tensor.is_neg(),
        )

    def differences(self, other: TensorProperties) -> list[str]:
        """``"field mine != other's"`` for every field that differs."""
        return [
            f"{field} {mine} != {theirs}"
            for field, mine, theirs in zip(self._fields, self, other)
            if mine != theirs
        ]


def _expression(value: int | torch.SymInt) -> Any:
    return value.node.expr if isinstance(value, torch.SymInt) else int(value)


def _expressions(values: Sequence[int | torch.SymInt]) -> tuple[Any, ...]:
    return tuple(_expression(value) for value in values)
