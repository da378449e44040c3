"""``OpGuide``: the per-op facts the eager replay path checks on its hot path.

Built once from a trace so replay never re-parses the trace: for each op, how many
tensor leaves it outputs and which storage each leaf binds to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hyper_offload.errors import ReplayMismatchError
from hyper_offload.passes.ir.trace import ActivationTrace, StorageId


@dataclass(frozen=True)
class OpGuideEntry:
    """Invariant: ``len(leaf_storages) == output_leaf_count``."""

    name: str
    output_leaf_count: int
    leaf_storages: tuple[StorageId, ...]

    def __repr__(self) -> str:
        return f"{self.name}->{list(self.leaf_storages)}"


@dataclass(frozen=True)
class OpGuide:
    entries: tuple[OpGuideEntry, ...]

    @classmethod
    def from_trace(cls, trace: ActivationTrace) -> OpGuide:
        return cls(
            tuple(
                OpGuideEntry(op.name, len(op.outputs), tuple(op.outputs)) for op in trace.ops
            )
        )

    def __len__(self) -> int:
        return len(self.entries)

    def storage_of_leaf(self, op_index: int, leaf_index: int) -> StorageId:
        return self.entries[op_index].leaf_storages[leaf_index]

    def check_op(self, op_index: int, name: str, leaf_count: int) -> OpGuideEntry:
        """Return the entry for ``op_index`` or raise if the replayed op differs."""
        if op_index < 0:  # a negative index would silently check the last ops
            raise ReplayMismatchError(
                f"replay op {op_index} ({name}): op indices start at 0; count replayed ops "
                "from the start of the step"
            )
        if op_index >= len(self.entries):
            raise ReplayMismatchError(
                f"replay op {op_index} ({name}): the warmup step recorded only "
                f"{len(self.entries)} ops; the model must run the same ops every step "
                "(wrap data-dependent control flow in @skip_offload)"
            )
        entry = self.entries[op_index]
        if entry.name != name or entry.output_leaf_count != leaf_count:
            raise ReplayMismatchError(
                f"replay op {op_index}: warmup recorded {entry.name} with "
                f"{entry.output_leaf_count} output tensors, replay ran {name} with {leaf_count}; "
                "the step's op sequence changed (wrap data-dependent control flow in "
                "@skip_offload, or start a new OffloadSession)"
            )
        return entry

    def leaf_storages(self) -> Sequence[tuple[StorageId, ...]]:
        return [e.leaf_storages for e in self.entries]


def mismatch_error(
    entries: Sequence[OpGuideEntry], index: int, func: Any, found_leaves: int
) -> ReplayMismatchError:
    """The error for replay op ``index`` running ``func`` with ``found_leaves`` output
    leaves where the warmup recorded ``entries`` (the model's ops)."""
    name = func if isinstance(func, str) else str(func)
    fix = ("wrap data-dependent code in @skip_offload, call session.reset() to re-warm, or "
           "set OffloadConfig(rewarm_on_mismatch=True)")
    if index >= len(entries):
        return ReplayMismatchError(
            f"replay op {index}: the warmup step recorded only {len(entries)} ops, but the "
            f"step ran {name} ({found_leaves} output leaves) as op {index}; the model must run "
            f"the same ops every step ({fix})"
        )
    entry = entries[index]
    return ReplayMismatchError(
        f"replay op {index}: warmup recorded {entry.name} with {entry.output_leaf_count} output "
        f"leaves, replay ran {name} with {found_leaves}; the step's op sequence changed "
        f"(another branch or shape). {fix[0].upper()}{fix[1:]}"
    )
