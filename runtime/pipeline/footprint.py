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
* ``tail_bytes``: what is left after the last backward leaf (BWD, or BWD_WEIGHT);
* ``grad_bytes``: what the stage's first BWD / BWD_WEIGHT adds beyond the others (the
  parameter gradients, allocated once per step when they start from ``None``);
* ``working[kind]``: the highest live bytes while a leaf of that kind ran, above the level
  it started from.

Only plain top-level compute leaves are measured: inside an OVERLAP composite two leaves'
bytes cannot be told apart. A stage or kind never seen plain is reported as 0 (say so if
you predict an order that has it).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable

from hyper_offload.passes.pipeline.meta_step import MetaStep, StepKind
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

    def before_step(self, position: int, step: MetaStep) -> None:
        self._before = self.meter.live_bytes
        self._first_sample = self.meter.sample_count

    def after_step(self, position: int, step: MetaStep) -> None:
        if not step.is_compute_slot:
            return
        first_grads = {
            leaf.stage for leaf in step.leaves() if leaf.kind in _WEIGHT_GRAD_KINDS and leaf.stage not in self._graded
        }
        self._graded |= first_grads  # type: ignore[arg-type]
        if not step.is_compute or step.stage is None:
            return  # an OVERLAP composite: its leaves' bytes cannot be told apart
        after = self.meter.live_bytes
        peak = self.meter.peak_since(self._first_sample)
        key = (step.stage, step.kind)
        if step.stage in first_grads:
            self._first_weight_grad[step.stage] = after - self._before
        self._deltas[key].append(after - self._before)
        self._working[key].append(max(0, (peak if peak is not None else after) - self._before))

    def footprints(self) -> StageFootprints:
        """One :class:`StageFootprint` per stage seen (raises if nothing was recorded)."""
        stages = sorted({stage for stage, _ in self._deltas})
        if not stages:
            raise ValueError(
                "FootprintRecorder: no compute leaf was recorded; set it as the schedule's observer "
                "and run one step with its meter active"
            )
        return StageFootprints(per_stage={s: self._stage(s) for s in stages})

    def _stage(self, stage: int) -> StageFootprint:
        forward = max(0, self._median((stage, StepKind.FWD)))
        groups = self.session.group_bytes if self.session is not None else {}
        weights = self.session.weight_bytes if self.session is not None else {}
        activations = min(forward, _median_of(n for (s, _), n in groups.items() if s == stage))
        split = (stage, StepKind.BWD_INPUT) in self._deltas
        weight = max(0, forward + self._median((stage, StepKind.BWD_INPUT))) if split else 0
        weight_state = min(weight, _median_of(n for (s, _), n in weights.items() if s == stage))
        last = (StepKind.BWD_WEIGHT, weight) if split else (StepKind.BWD, forward)
        tail = max(0, last[1] + self._median((stage, last[0])))
        working = {kind: _median_of(v) for (s, kind), v in self._working.items() if s == stage}
        packed = self.session.packed_bytes if self.session is not None else {}
        packed_of = {
            window: _median_of(n for ((s, _), name), n in packed.items() if s == stage and name == window)
            for window in ("activations", "weight_state")
        }
        first = self._first_weight_grad.get(stage)
        grads = 0 if first is None else max(0, first - self._median((stage, last[0])))
        return StageFootprint(
            grad_bytes=grads,
            packed_activations=min(activations, packed_of["activations"]),
            packed_weight_state=min(weight_state, packed_of["weight_state"]),
            activations=activations,
            forward_resident=forward - activations,
            weight_state=weight_state,
            weight_resident=weight - weight_state,
            tail_bytes=tail,
            working=working,
        )

    def _median(self, key: tuple[int, StepKind]) -> int:
        return _median_of(self._deltas.get(key, ()))


def _median_of(values: Iterable[int]) -> int:
    values = list(values)
    return int(statistics.median(values)) if values else 0
