"""Measure each stage's :class:`~hyper_offload.passes.pipeline.StageFootprint` from one step.

The residency model of the order pass (:mod:`hyper_offload.passes.pipeline.residency`)
predicts a rank's peak from what one micro-batch of each stage keeps alive, phase by
phase. :class:`FootprintRecorder` measures those levels on a real step: it is a
:class:`~.step_runner.StepObserver` that reads a :class:`~hyper_offload.runtime.DeviceMemoryMeter`
around every top-level step and the swap session's group sizes::

    recorder = FootprintRecorder(meter, schedule.session)
    schedule.observer = recorder
    with meter:
        schedule.step(x, target=y)
    footprints = recorder.footprints()          # StageFootprints, one per local stage
    predicted_peak(order, footprints)            # bytes; compare with the meter's peak

Per stage, over its micro-batches (medians, so one odd micro-batch does not decide):

* ``forward_bytes``: live bytes a plain FWD leaf adds; ``activations``: the chunk's swap
  group (``session.group_bytes``), the rest is ``forward_resident``;
* ``weight_bytes``: ``forward_bytes`` plus what a BWD_INPUT adds; ``weight_state``: the
  dW state the session moved (``session.weight_bytes``), the rest is ``weight_resident``;
* ``tail_bytes``: what is left after a full BWD; ``split_tail_bytes`` after BWD_INPUT and
  BWD_WEIGHT (they differ when a kept output holds nodes BWD_WEIGHT never visits);
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
from collections.abc import Iterable

from hyper_offload.passes.pipeline.meta_step import MetaStep, StepKind, SwapPhase
from hyper_offload.passes.pipeline.residency import StageFootprint, StageFootprints

from ..memory_meter import DeviceMemoryMeter
from .session import PipelineSwapSession

__all__ = ["FootprintRecorder"]

_WEIGHT_GRAD_KINDS = (StepKind.BWD, StepKind.BWD_WEIGHT)


class FootprintRecorder:
    """Observer that measures stage footprints (see the module docstring).

    Use one recorder for one metered step; the meter must be active during that step."""

    def __init__(self, meter: DeviceMemoryMeter, session: PipelineSwapSession | None = None) -> None:
        self.meter = meter
        self.session = session
        self._before = 0
        self._first_sample = 0
        self._deltas: dict[tuple[int, StepKind], list[int]] = defaultdict(list)
        self._working: dict[tuple[int, StepKind], list[int]] = defaultdict(list)
        self._first_weight_grad: dict[int, int] = {}  # stage -> delta of its first BWD / BWD_WEIGHT
        self._graded: set[int] = set()  # stages that ran a weight-gradient leaf already
        # OVERLAP composites: (leaves, level change, stages whose first weight-gradient leaf ran there).
        self._composites: list[tuple[tuple[MetaStep, ...], int, frozenset[int]]] = []

    def before_step(self, position: int, step: MetaStep) -> None:
        self._before = self.meter.live_bytes
        self._first_sample = self.meter.sample_count

    def after_step(self, position: int, step: MetaStep) -> None:
        if not step.is_compute_slot:
            return
        first_grads = frozenset(
            leaf.stage for leaf in step.leaves()  # type: ignore[misc]
            if leaf.kind in _WEIGHT_GRAD_KINDS and leaf.stage not in self._graded
        )
        self._graded |= first_grads
        after = self.meter.live_bytes
        delta = after - self._before
        if not step.is_compute or step.stage is None:
            # An OVERLAP composite: only the sum of its leaves is seen (footprints() infers
            # a leaf never run alone from it).
            self._composites.append((tuple(step.leaves()), delta, first_grads))
            return
        peak = self.meter.peak_since(self._first_sample)
        key = (step.stage, step.kind)
        if step.stage in first_grads:
            self._first_weight_grad[step.stage] = delta
        self._deltas[key].append(delta)
        self._working[key].append(max(0, (peak if peak is not None else after) - self._before))

    def footprints(self) -> StageFootprints:
        """One :class:`StageFootprint` per stage seen (raises if nothing was recorded)."""
        known = {key: _median_of(values) for key, values in self._deltas.items()}
        inferred: dict[tuple[int, StepKind], list[int]] = defaultdict(list)
        for leaves, delta, first_grads in self._composites:
            unknown = [(leaf.stage, leaf.kind) for leaf in leaves if (leaf.stage, leaf.kind) not in known]
            if len(unknown) == 1 and not first_grads:
                rest = sum(known[(leaf.stage, leaf.kind)] for leaf in leaves if (leaf.stage, leaf.kind) in known)
                inferred[unknown[0]].append(delta - rest)  # type: ignore[index]
        known.update({key: _median_of(values) for key, values in inferred.items()})
        stages = sorted({stage for stage, _ in known})
        if not stages:
            raise ValueError(
                "FootprintRecorder: no compute leaf was recorded; set it as the schedule's observer "
                "and run one step with its meter active"
            )
        grads = self._grad_bytes(known)
        return StageFootprints(per_stage={s: self._stage(s, known, grads.get(s, 0)) for s in stages})

    def _grad_bytes(self, known: dict[tuple[int, StepKind], int]) -> dict[int, int]:
        """Per stage: what its first weight-gradient leaf added beyond the usual."""
        grads = {}
        for stage, delta in self._first_weight_grad.items():
            kind = StepKind.BWD if (stage, StepKind.BWD) in self._deltas else StepKind.BWD_WEIGHT
            grads[stage] = max(0, delta - known.get((stage, kind), 0))
        for leaves, delta, first_grads in self._composites:
            if len(first_grads) == 1 and all((leaf.stage, leaf.kind) in known for leaf in leaves):
                stage = next(iter(first_grads))
                grads[stage] = max(0, delta - sum(known[(leaf.stage, leaf.kind)] for leaf in leaves))
        return grads

    def _stage(self, stage: int, known: dict[tuple[int, StepKind], int], grads: int) -> StageFootprint:
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
            grad_bytes=grads,
            working={kind: _median_of(v) for (s, kind), v in self._working.items() if s == stage},
        )


def _median_of(values: Iterable[int]) -> int:
    values = list(values)
    return int(statistics.median(values)) if values else 0
