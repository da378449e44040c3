"""Measure each stage's :class:`~hyper_offload.passes.pipeline.StageFootprint` from one step.

The residency model of the order pass (:mod:`hyper_offload.passes.pipeline.residency`)
predicts a rank's peak from what one micro-batch of each stage keeps alive, phase by
phase. :class:`FootprintRecorder` measures those levels on a real step: it is a
:class:`~hyper_offload.pipeline.step_runner.StepObserver` that reads a
:class:`~hyper_offload.runtime.DeviceMemoryMeter`
around every top-level step and the swap session's group sizes::

    recorder = FootprintRecorder(meter, schedule.session)
    schedule.observer = recorder
    with meter:
        schedule.step(x, target=y)
    footprints = recorder.footprints(schedule.last_sends)   # StageFootprints, one per local stage
    predicted_peak(order, footprints, releases=schedule.send_releases)  # compare with the meter

Per stage, over its micro-batches (medians, so one odd micro-batch does not decide):

* ``forward_bytes``: live bytes a plain FWD leaf adds; ``activations``: the chunk's swap
  group (``session.group_bytes``), the rest is ``forward_resident``;
* ``weight_bytes``: ``forward_bytes`` plus what a BWD_INPUT adds; ``weight_state``: the
  dW state the session moved (``session.weight_bytes``), the rest is ``weight_resident``;
* ``tail_bytes``: what is left after a full BWD; ``split_tail_bytes`` after BWD_INPUT and
  BWD_WEIGHT (they differ when a kept output holds nodes BWD_WEIGHT never visits);
* ``sent_output`` / ``sent_grad``: the bytes of its SEND_F / SEND_B (from the step's send
  log). A backward that ran after its output's send was released frees that output too;
  the recorder adds it back, so every level counts the sends as waited at the step end,
  the way the model defines them;
* ``grad_bytes``: what the stage's first BWD / BWD_WEIGHT adds beyond the others (the
  parameter gradients, allocated once per step when they start from ``None``);
* ``working[kind]``: the highest live bytes while a leaf of that kind ran, above the level
  it started from.

Plain top-level compute leaves are measured directly. Inside an OVERLAP composite only the
sum of its leaves is seen: a leaf kind never run alone is inferred from composites whose
other leaves are known (composite minus their medians). Its transient is not known (0).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from hyper_offload.errors import ConfigurationError
from hyper_offload.passes.pipeline.execution import P2PKey
from hyper_offload.passes.pipeline.meta_step import MetaStep, StepKind, SwapPhase
from hyper_offload.passes.pipeline.residency import (
    OUTPUT_FREEING_KINDS,
    WEIGHT_GRAD_KINDS,
    StageFootprint,
    StageFootprints,
)

from ..memory_meter import DeviceMemoryMeter
from .p2p import SentTensor
from .session import PipelineSwapSession

__all__ = ["FootprintRecorder"]


class _Sample(NamedTuple):
    """One compute slot as the meter saw it."""

    position: int
    leaves: tuple[MetaStep, ...]
    composite: bool  # an OVERLAP composite: only the sum of its leaves is seen
    delta: int
    working: int
    first_grads: frozenset[int]  # stages whose first weight-gradient leaf ran here


class FootprintRecorder:
    """Observer that measures stage footprints (see the module docstring).

    Use one recorder for one metered step; the meter must be active during that step."""

    def __init__(self, meter: DeviceMemoryMeter, session: PipelineSwapSession | None = None) -> None:
        self.meter = meter
        self.session = session
        self._before = 0
        self._first_sample = 0
        self._graded: set[int] = set()  # stages that ran a weight-gradient leaf already
        self._samples: list[_Sample] = []

    def before_step(self, position: int, step: MetaStep) -> None:
        self._before = self.meter.live_bytes
        self._first_sample = self.meter.sample_count

    def after_step(self, position: int, step: MetaStep) -> None:
        if not step.is_compute_slot:
            return
        leaves = tuple(step.leaves())
        first_grads = frozenset(
            leaf.stage for leaf in leaves  # type: ignore[misc]
            if leaf.kind in WEIGHT_GRAD_KINDS and leaf.stage not in self._graded
        )
        self._graded |= first_grads
        after = self.meter.live_bytes
        peak = self.meter.peak_since(self._first_sample)
        working = max(0, (peak if peak is not None else after) - self._before)
        composite = not step.is_compute or step.stage is None
        self._samples.append(_Sample(position, leaves, composite, after - self._before, working, first_grads))

    def footprints(self, sends: Mapping[P2PKey, SentTensor] | None = None) -> StageFootprints:
        """One :class:`StageFootprint` per stage seen (raises if nothing was recorded).

        ``sends``: the step's send log (``PipelineSwapSchedule.last_sends``); without it the
        sends count 0 bytes and no backward is corrected for an early release.
        """
        sends = sends if sends is not None else {}
        deltas: dict[tuple[int, StepKind], list[int]] = defaultdict(list)
        working: dict[tuple[int, StepKind], list[int]] = defaultdict(list)
        first_weight_grad: dict[int, int] = {}  # stage -> delta of its first BWD / BWD_WEIGHT
        composites: list[tuple[tuple[MetaStep, ...], int, frozenset[int]]] = []
        for sample in self._samples:
            delta = sample.delta + _released_outputs(sample, sends)
            if sample.composite:  # a leaf never run alone is inferred from composites below
                composites.append((sample.leaves, delta, sample.first_grads))
                continue
            step = sample.leaves[0]
            key = (step.stage, step.kind)
            if step.stage in sample.first_grads:
                first_weight_grad[step.stage] = delta  # type: ignore[index]
            deltas[key].append(delta)  # type: ignore[index]
            working[key].append(sample.working)  # type: ignore[index]
        known = {key: _median_of(values) for key, values in deltas.items()}
        inferred: dict[tuple[int, StepKind], list[int]] = defaultdict(list)
        for leaves, delta, first_grads in composites:
            unknown = [(leaf.stage, leaf.kind) for leaf in leaves if (leaf.stage, leaf.kind) not in known]
            if len(unknown) == 1 and not first_grads:
                rest = sum(known[(leaf.stage, leaf.kind)] for leaf in leaves if (leaf.stage, leaf.kind) in known)
                inferred[unknown[0]].append(delta - rest)  # type: ignore[index]
        known.update({key: _median_of(values) for key, values in inferred.items()})
        stages = sorted({stage for stage, _ in known})
        if not stages:
            raise ConfigurationError(
                "FootprintRecorder: no compute leaf was recorded; set it as the schedule's observer "
                "and run one step with its meter active"
            )
        grads = _grad_bytes(known, deltas, first_weight_grad, composites)
        return StageFootprints(per_stage={
            s: self._stage(s, known, working, grads.get(s, 0), sends) for s in stages
        })

    def _stage(
        self,
        stage: int,
        known: Mapping[tuple[int, StepKind], int],
        working: Mapping[tuple[int, StepKind], list[int]],
        grads: int,
        sends: Mapping[P2PKey, SentTensor],
    ) -> StageFootprint:
        def level(*kinds: StepKind) -> int | None:
            if any((stage, kind) not in known for kind in kinds):
                return None
            return max(0, sum(known[(stage, kind)] for kind in kinds))

        forward = level(StepKind.FWD) or 0
        groups = self.session.group_bytes if self.session is not None else {}
        weights = self.session.weight_bytes if self.session is not None else {}
        packed = self.session.packed_bytes if self.session is not None else {}
        activations = min(forward, _median_of(n for (s, _), n in groups.items() if s == stage))
        weight = level(StepKind.FWD, StepKind.BWD_INPUT) or 0
        weight_state = min(weight, _median_of(n for (s, _), n in weights.items() if s == stage))
        full_tail = level(StepKind.FWD, StepKind.BWD)
        split_tail = level(StepKind.FWD, StepKind.BWD_INPUT, StepKind.BWD_WEIGHT)
        packed_of = {
            window: _median_of(n for ((s, _), name), n in packed.items() if s == stage and name is window)
            for window in SwapPhase
        }
        tail = full_tail if full_tail is not None else (split_tail or 0)
        return StageFootprint(
            activations=activations,
            forward_resident=forward - activations,
            weight_state=weight_state,
            weight_resident=weight - weight_state,
            tail_bytes=tail,
            split_tail_bytes=None if split_tail in (None, tail) else split_tail,
            packed_activations=min(activations, packed_of[SwapPhase.ACTIVATIONS]),
            packed_weight_state=min(weight_state, packed_of[SwapPhase.WEIGHT_STATE]),
            sent_output=_sent_bytes(sends, StepKind.SEND_F, stage),
            sent_grad=_sent_bytes(sends, StepKind.SEND_B, stage),
            grad_bytes=grads,
            working={kind: _median_of(v) for (s, kind), v in working.items() if s == stage},
        )


def _grad_bytes(
    known: Mapping[tuple[int, StepKind], int],
    deltas: Mapping[tuple[int, StepKind], list[int]],
    first_weight_grad: Mapping[int, int],
    composites: Sequence[tuple[tuple[MetaStep, ...], int, frozenset[int]]],
) -> dict[int, int]:
    """Per stage: what its first weight-gradient leaf added beyond the usual."""
    grads = {}
    for stage, delta in first_weight_grad.items():
        kind = StepKind.BWD if (stage, StepKind.BWD) in deltas else StepKind.BWD_WEIGHT
        grads[stage] = max(0, delta - known.get((stage, kind), 0))
    for leaves, delta, first_grads in composites:
        if len(first_grads) == 1 and all((leaf.stage, leaf.kind) in known for leaf in leaves):
            stage = next(iter(first_grads))
            grads[stage] = max(0, delta - sum(known[(leaf.stage, leaf.kind)] for leaf in leaves))
    return grads


def _released_outputs(sample: _Sample, sends: Mapping[P2PKey, SentTensor]) -> int:
    """Bytes of outputs whose send was released before this slot's backward leaves freed them."""
    total = 0
    for leaf in sample.leaves:
        if leaf.kind in OUTPUT_FREEING_KINDS:
            sent = sends.get((StepKind.SEND_F, leaf.stage, leaf.micro))  # type: ignore[arg-type]
            if sent is not None and sent.released_after is not None and sent.released_after < sample.position:
                total += sent.nbytes
    return total


def _sent_bytes(sends: Mapping[P2PKey, SentTensor], kind: StepKind, stage: int) -> int:
    return _median_of(sent.nbytes for (k, s, _), sent in sends.items() if k is kind and s == stage)


def _median_of(values: Iterable[int]) -> int:
    values = list(values)
    return int(statistics.median(values)) if values else 0
