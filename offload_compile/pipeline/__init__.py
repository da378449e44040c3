"""The pipeline-parallel door: activation swap inside ``torch.distributed.pipelining``.

* :func:`swap_wrapper` / :func:`swap_tensor_wrapper` — mark the modules (or tensors) whose
  saved activations may leave the device between a chunk's forward and backward;
* :class:`PipelineSwapSchedule` — a torch-style schedule that runs the swap-rewritten
  rank orders of :mod:`hyper_offload.passes.pipeline` (:mod:`.schedule`), one ``step()``
  at a time (:mod:`.step_runner`), on the swap groups and session of
  :mod:`hyper_offload.runtime.pipeline`.

Planning orders without running them: ``hyper-offload pp-order`` and
:mod:`hyper_offload.passes.pipeline`.
"""

from __future__ import annotations

from .._lazy import lazy_getattr
from ..errors import SwapOutsideGroupWarning, UnsupportedScheduleError

# The executor imports torch.distributed.pipelining (seconds of start-up): load on use.
_LAZY = {
    "PipelineSwapSchedule": ".schedule",
    "StepObserver": ".step_runner",
    "swap_tensor_wrapper": ".schedule",
    "swap_wrapper": ".schedule",
}

__all__ = [
    "PipelineSwapSchedule",
    "StepObserver",
    "SwapOutsideGroupWarning",
    "UnsupportedScheduleError",
    "swap_tensor_wrapper",
    "swap_wrapper",
]


__getattr__ = lazy_getattr(__name__, _LAZY)
