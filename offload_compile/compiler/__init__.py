"""The compile door: ``torch.compile(model, backend="hyper_offload")``.

* :mod:`.registry` — how backends are found: ``backend="hyper_offload"`` (one shared
  backend per option set, :func:`shared_backend`), :func:`backend` objects, and
  :func:`register_backend` names with :func:`step_report`;
* :mod:`.backend` — the Dynamo backend (:class:`HyperOffloadBackend`) and the callable
  each region's forward runs;
* :mod:`.options` — the ``options={...}`` the backend accepts;
* :mod:`.partitioner` / :mod:`.region` / :mod:`.region_plan` / :mod:`.region_report` —
  one region: partitioned, planned, lowered, reported (:class:`RegionReport`);
* :mod:`.step` — the step's lifecycle (:class:`~.step.controller.StepController`), how it
  is learnt (recorder, eager meter) and the lowerings its plans want; planning itself is
  the step model of :mod:`hyper_offload.passes.plan.step`; :mod:`.step_report` shows the
  plan in force (:class:`StepReport`);
* :mod:`.recompute` — keep, move or recompute: the search, the partitions it prices,
  what may be recomputed exactly, the spliced backward;
* :func:`saved_device_bytes`, :func:`autograd_saved_device_bytes` — the device bytes a
  compiled step keeps for backward, read from autograd's graph
  (:mod:`hyper_offload.runtime.saved_bytes`, which the eager door reads too);
* :mod:`.fake_capture` — the same graphs on fake tensors;
* :mod:`.estimate` — ``hyper_offload.estimate`` (does a step fit under a budget?) built on
  them: per region (:mod:`.estimate.fit`), under the step scope and per block
  (:mod:`.estimate.step_scope`), and what it returns (:mod:`.estimate.report`,
  :class:`EstimateReport`).
"""

from __future__ import annotations

from .._lazy import lazy_getattr

# Inductor's imports take seconds; nothing loads until a name is used.
_LAZY = {
    "HyperOffloadBackend": ".backend",
    "backend": ".registry",
    "shared_backend": ".registry",
    "NamedBackend": ".registry",
    "register_backend": ".registry",
    "step_report": ".registry",
    "StepReport": ".step_report",
    "RegionReport": ".region_report",
    "EstimateReport": ".estimate.report",
    "saved_device_bytes": "hyper_offload.runtime.saved_bytes",
    "autograd_saved_device_bytes": "hyper_offload.runtime.saved_bytes",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
