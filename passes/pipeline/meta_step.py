"""MetaStep: one entry of a rank-local pipeline-parallel step order.

A rank executes its order top to bottom. Each entry is a :class:`MetaStep`: a kind, the
(global) stage index it works on, the micro-batch index, and — for composites only —
sub-steps that run as one unit.

Compact text form (``repr``), parsed back by :meth:`MetaStep.from_str`::

    leaf       {stage}{KIND}{micro}      e.g. ``1F3``, ``0SWAP_LAUNCH_OFFLOAD2``, ``0DW_WAIT_LOAD2``,
                                              ``0UNSHARD``
    composite  ({sub};{sub};...){KIND}   e.g. ``(0F3;3B1)OVERLAP_B_F``,
                                              ``(0SEND_F1;0RECV_B0)BATCH_SEND_RECV``

``KIND`` is torch.distributed.pipelining's short form where torch has one (``F``, ``B``,
``I``, ``W``, ``UNSHARD``, ``RESHARD``, ``SEND_F``, ...) and the enum name otherwise. A
missing stage or micro-batch prints as nothing (``0UNSHARD`` has no micro-batch).

Invariants (checked by :func:`validate_step` and by ``from_str``):

* a composite kind (``OVERLAP_B_F``, ``OVERLAP_F_B``, ``BATCH_SEND_RECV``) has at least one
  sub-step and no stage / micro-batch of its own;
* a leaf kind has no sub-steps; compute, P2P and swap leaves carry both a stage and a
  micro-batch; ``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD`` carry a stage only;
* ``OVERLAP_*`` holds compute leaves only; ``BATCH_SEND_RECV`` holds P2P leaves only.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from enum import Enum
from typing import NamedTuple

from hyper_offload.errors import StepFormatError


class StepKind(str, Enum):
    """What a :class:`MetaStep` does. The value is the token used in the compact form."""

    FWD = "F"
    BWD = "B"
    BWD_INPUT = "I"
    BWD_WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    FSDP_UNSHARD = "UNSHARD"
    FSDP_RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"
    OVERLAP_B_F = "OVERLAP_B_F"
    OVERLAP_F_B = "OVERLAP_F_B"
    BATCH_SEND_RECV = "BATCH_SEND_RECV"
    SWAP_LAUNCH_OFFLOAD = "SWAP_LAUNCH_OFFLOAD"
    SWAP_WAIT_OFFLOAD = "SWAP_WAIT_OFFLOAD"
    SWAP_LAUNCH_LOAD = "SWAP_LAUNCH_LOAD"
    SWAP_WAIT_LOAD = "SWAP_WAIT_LOAD"
    # The dW state (what BWD_WEIGHT reads) across the BWD_INPUT -> BWD_WEIGHT gap.
    DW_LAUNCH_OFFLOAD = "DW_LAUNCH_OFFLOAD"
    DW_WAIT_OFFLOAD = "DW_WAIT_OFFLOAD"
    DW_LAUNCH_LOAD = "DW_LAUNCH_LOAD"
    DW_WAIT_LOAD = "DW_WAIT_LOAD"

    def __repr__(self) -> str:
        return self.name


COMPUTE_KINDS = frozenset({StepKind.FWD, StepKind.BWD, StepKind.BWD_INPUT, StepKind.BWD_WEIGHT})
BACKWARD_KINDS = frozenset({StepKind.BWD, StepKind.BWD_INPUT, StepKind.BWD_WEIGHT})
OVERLAP_KINDS = frozenset({StepKind.OVERLAP_B_F, StepKind.OVERLAP_F_B})
COMPOSITE_KINDS = OVERLAP_KINDS | {StepKind.BATCH_SEND_RECV}
SEND_KINDS = frozenset({StepKind.SEND_F, StepKind.SEND_B})
RECV_KINDS = frozenset({StepKind.RECV_F, StepKind.RECV_B})
P2P_KINDS = SEND_KINDS | RECV_KINDS
FSDP_KINDS = frozenset({StepKind.FSDP_UNSHARD, StepKind.FSDP_RESHARD, StepKind.REDUCE_GRAD})


class SwapPhase(str, Enum):
    """Which window of a chunk a swap step covers.

    ``ACTIVATIONS``: the saved activations, from the FWD to the first backward consumer
    (BWD, or BWD_INPUT under dx/dw split). ``WEIGHT_STATE``: what BWD_WEIGHT reads (the
    retained saved activations and the gradients at the weight-path intermediates), from
    BWD_INPUT to BWD_WEIGHT.
    """

    ACTIVATIONS = "activations"
    WEIGHT_STATE = "weight_state"

    def __repr__(self) -> str:
        return self.value


#: The four swap steps of one chunk's activation window, in the only order they may appear.
SWAP_SEQUENCE = (
    StepKind.SWAP_LAUNCH_OFFLOAD,
    StepKind.SWAP_WAIT_OFFLOAD,
    StepKind.SWAP_LAUNCH_LOAD,
    StepKind.SWAP_WAIT_LOAD,
)
#: The four swap steps of one chunk's dW-state window, in the only order they may appear.
DW_SWAP_SEQUENCE = (
    StepKind.DW_LAUNCH_OFFLOAD,
    StepKind.DW_WAIT_OFFLOAD,
    StepKind.DW_LAUNCH_LOAD,
    StepKind.DW_WAIT_LOAD,
)
SWAP_SEQUENCES = {SwapPhase.ACTIVATIONS: SWAP_SEQUENCE, SwapPhase.WEIGHT_STATE: DW_SWAP_SEQUENCE}
SWAP_KINDS = frozenset(SWAP_SEQUENCE + DW_SWAP_SEQUENCE)
#: Phase of every swap kind, and its place (0..3) in the phase's sequence.
SWAP_PHASE_OF = {kind: phase for phase, seq in SWAP_SEQUENCES.items() for kind in seq}
SWAP_INDEX_OF = {kind: seq.index(kind) for seq in SWAP_SEQUENCES.values() for kind in seq}
# Leaves that name a stage but no micro-batch (they act on the stage's parameters).
_STAGE_ONLY_KINDS = FSDP_KINDS

# Longest tokens first so that "SEND_F" is never read as "SEND_" + "F".
_KIND_TOKENS = sorted((k.value for k in StepKind), key=len, reverse=True)
_LEAF_RE = re.compile(r"(\d*)(" + "|".join(re.escape(t) for t in _KIND_TOKENS) + r")(\d*)")
_WORD_RE = re.compile(r"[A-Z_]+")


class MetaStep(NamedTuple):
    """One step of a rank-local order; see the module docstring for the invariants.

    ``stage`` is the global stage index (``None`` for composites); ``micro`` the micro-batch
    index (``None`` where meaningless); ``sub_steps`` is empty for leaves.
    """

    kind: StepKind
    stage: int | None = None
    micro: int | None = None
    sub_steps: tuple[MetaStep, ...] = ()

    def __repr__(self) -> str:
        if self.sub_steps:
            return f"({';'.join(repr(s) for s in self.sub_steps)}){self.kind.value}"
        stage = "" if self.stage is None else str(self.stage)
        micro = "" if self.micro is None else str(self.micro)
        return f"{stage}{self.kind.value}{micro}"

    __str__ = __repr__

    @staticmethod
    def from_str(text: str) -> MetaStep:
        """Parse the compact form back; ``MetaStep.from_str(repr(s)) == s`` for every valid ``s``."""
        parser = _Parser(text.strip())
        step = parser.parse_step()
        if parser.pos != len(parser.text):
            raise StepFormatError(
                f"MetaStep {text!r}: unexpected text at position {parser.pos} "
                f"({parser.text[parser.pos:]!r}); expected one step like '1F3' or '(0F3;3B1)OVERLAP_B_F'"
            )
        validate_step(step)
        return step

    # -- predicates -----------------------------------------------------------------------
    @property
    def is_composite(self) -> bool:
        return bool(self.sub_steps)

    @property
    def is_compute(self) -> bool:
        """A compute leaf: FWD, BWD, BWD_INPUT or BWD_WEIGHT."""
        return self.kind in COMPUTE_KINDS

    @property
    def is_compute_slot(self) -> bool:
        """One compute slot of the order: a compute leaf or an OVERLAP composite (counts once)."""
        return self.kind in COMPUTE_KINDS or self.kind in OVERLAP_KINDS

    @property
    def is_swap(self) -> bool:
        return self.kind in SWAP_KINDS

    @property
    def is_p2p(self) -> bool:
        """A P2P leaf or a BATCH_SEND_RECV container."""
        return self.kind in P2P_KINDS or self.kind is StepKind.BATCH_SEND_RECV

    @property
    def is_fsdp(self) -> bool:
        return self.kind in FSDP_KINDS

    @property
    def is_comm(self) -> bool:
        """Communication: P2P (leaf or batch) or FSDP collectives."""
        return self.is_p2p or self.is_fsdp

    def leaves(self) -> Iterator[MetaStep]:
        """This step if it is a leaf, else the leaves of its sub-steps, depth first in order."""
        if not self.sub_steps:
            yield self
            return
        for sub in self.sub_steps:
            yield from sub.leaves()

    @property
    def chunk(self) -> tuple[int, int] | None:
        """``(stage, micro)`` for a leaf that has both, else ``None``."""
        if self.sub_steps or self.stage is None or self.micro is None:
            return None
        return (self.stage, self.micro)


def leaf(kind: StepKind | str, stage: int | None = None, micro: int | None = None) -> MetaStep:
    """Build a validated leaf step; ``kind`` may be a StepKind, its name or its token."""
    step = MetaStep(_kind_of(kind), stage, micro)
    validate_step(step)
    return step


def composite(kind: StepKind | str, *sub_steps: MetaStep) -> MetaStep:
    """Build a validated composite (OVERLAP_B_F, OVERLAP_F_B or BATCH_SEND_RECV)."""
    step = MetaStep(_kind_of(kind), None, None, tuple(sub_steps))
    validate_step(step)
    return step


def parse_order(lines: Sequence[str] | str) -> list[MetaStep]:
    """Parse a list of compact steps (or one whitespace-separated string) into an order."""
    items = lines.split() if isinstance(lines, str) else list(lines)
    return [MetaStep.from_str(item) for item in items]


def format_order(order: Sequence[MetaStep]) -> list[str]:
    """The compact text of each step; inverse of :func:`parse_order`."""
    return [repr(step) for step in order]


def validate_step(step: MetaStep) -> None:
    """Raise :class:`StepFormatError` if ``step`` breaks an invariant of this module."""
    if not isinstance(step.kind, StepKind):
        raise StepFormatError(f"MetaStep {step!r}: kind {step.kind!r} is not a StepKind")
    if step.kind in COMPOSITE_KINDS:
        _validate_composite(step)
        return
    if step.sub_steps:
        raise StepFormatError(
            f"MetaStep {step!r}: {step.kind.name} is a leaf kind and cannot hold sub-steps; "
            f"only {', '.join(sorted(k.name for k in COMPOSITE_KINDS))} are containers"
        )
    for name in ("stage", "micro"):
        value = getattr(step, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise StepFormatError(f"MetaStep {step!r}: {name} must be a non-negative int, got {value!r}")
    if step.stage is None:
        raise StepFormatError(f"MetaStep {step!r}: a {step.kind.name} leaf needs a stage index")
    if step.kind in _STAGE_ONLY_KINDS and step.micro is not None:
        raise StepFormatError(
            f"MetaStep {step!r}: {step.kind.name} acts on a stage's parameters and takes no micro-batch"
        )
    if step.kind not in _STAGE_ONLY_KINDS and step.micro is None:
        raise StepFormatError(f"MetaStep {step!r}: a {step.kind.name} leaf needs a micro-batch index")


def _validate_composite(step: MetaStep) -> None:
    if not step.sub_steps:
        raise StepFormatError(f"MetaStep {step!r}: composite {step.kind.name} needs at least one sub-step")
    if step.stage is not None or step.micro is not None:
        raise StepFormatError(
            f"MetaStep {step!r}: composite {step.kind.name} has no stage/micro of its own; "
            "they belong to its sub-steps"
        )
    allowed = COMPUTE_KINDS if step.kind in OVERLAP_KINDS else P2P_KINDS
    for sub in step.sub_steps:
        if sub.kind not in allowed:
            raise StepFormatError(
                f"MetaStep {step!r}: {step.kind.name} may hold only "
                f"{', '.join(sorted(k.name for k in allowed))}, not {sub.kind.name} ({sub!r})"
            )
        validate_step(sub)


def _kind_of(kind: StepKind | str) -> StepKind:
    if isinstance(kind, StepKind):
        return kind
    if kind in StepKind.__members__:
        return StepKind[kind]
    try:
        return StepKind(kind)
    except ValueError:
        raise StepFormatError(
            f"unknown step kind {kind!r}; expected one of {', '.join(StepKind.__members__)}"
        ) from None


class _Parser:
    """Recursive-descent parser for the compact form (composites may nest)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def parse_step(self) -> MetaStep:
        if self.text.startswith("(", self.pos):
            return self._parse_composite()
        match = _LEAF_RE.match(self.text, self.pos)
        if match is None or match.end() == self.pos:
            raise StepFormatError(
                f"MetaStep {self.text!r}: cannot read a step at position {self.pos}; "
                "expected '{stage}{KIND}{micro}' like '1F3' or '(...)KIND'"
            )
        self.pos = match.end()
        stage, token, micro = match.groups()
        return MetaStep(StepKind(token), int(stage) if stage else None, int(micro) if micro else None)

    def _parse_composite(self) -> MetaStep:
        self.pos += 1  # "("
        subs = [self.parse_step()]
        while self.text.startswith(";", self.pos):
            self.pos += 1
            subs.append(self.parse_step())
        if not self.text.startswith(")", self.pos):
            raise StepFormatError(f"MetaStep {self.text!r}: expected ';' or ')' at position {self.pos}")
        self.pos += 1
        match = _WORD_RE.match(self.text, self.pos)
        if match is None:
            raise StepFormatError(f"MetaStep {self.text!r}: composite without a KIND after ')'")
        # Take the longest composite token that prefixes the remaining text.
        for token in _KIND_TOKENS:
            if self.text.startswith(token, self.pos) and StepKind(token) in COMPOSITE_KINDS:
                self.pos += len(token)
                return MetaStep(StepKind(token), None, None, tuple(subs))
        raise StepFormatError(
            f"MetaStep {self.text!r}: {match.group()!r} is not a composite kind; expected one of "
            f"{', '.join(sorted(k.value for k in COMPOSITE_KINDS))}"
        )
