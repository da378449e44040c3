"""The compile door: ``torch.compile(model, backend="hyper_offload")``.

* :mod:`.dynamo_backend` — the Dynamo backend (:class:`HyperOffloadBackend`, :func:`backend`);
* :mod:`.options` — the ``options={...}`` the backend accepts;
* :mod:`.backend_registry` — one backend per option set for ``backend="hyper_offload"``
  (:func:`shared_backend` finds it);
* :mod:`.named_backends` — :func:`register_backend`: those options under a name of
  torch's backend registry, and :func:`step_report` by that name;
* :mod:`.region_plan` / :mod:`.region_report` — plan one compiled region's graphs and
  report it (:class:`RegionReport`);
* :mod:`.step_model` / :mod:`.step_plan` / :mod:`.step_timeline` / :mod:`.step_report` —
  one budget for the whole step (``budget_scope="step"``): learn the step's invocations,
  choose what each keeps, price it on the timeline model, report it (:class:`StepReport`);
* :mod:`.saved_bytes` — the device bytes a compiled step keeps for backward, read from
  autograd's graph (:func:`saved_device_bytes`);
* :mod:`.fake_capture` / :mod:`.fit_estimate` — the same graphs on fake tensors, and
  :func:`estimate` (does a step fit under a budget?) built on them.
"""

from __future__ import annotations

from .._lazy import lazy_getattr

# Inductor's imports take seconds; nothing loads until a name is used.
_LAZY = {
    "HyperOffloadBackend": ".dynamo_backend",
    "backend": ".dynamo_backend",
    "shared_backend": ".dynamo_backend",
    "NamedBackend": ".named_backends",
    "register_backend": ".named_backends",
    "step_report": ".named_backends",
    "StepReport": ".step_report",
    "RegionReport": ".region_report",
    "EstimateReport": ".fit_estimate",
    "estimate": ".fit_estimate",
    "saved_device_bytes": ".saved_bytes",
    "autograd_saved_device_bytes": ".saved_bytes",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
