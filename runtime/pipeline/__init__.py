"""Pipeline-parallel activation swap at run time: swap groups, session, executor.

* :class:`SwapGroup` — one chunk's saved activations and their four swap steps, through
  the :class:`~hyper_offload.runtime.residency.ResidencyManager`;
* :class:`PipelineSwapSession` — run-scoped groups of one rank's order (one generation
  per ``step()``);
* :class:`FootprintRecorder` — measures each stage's footprint (the residency model's
  input) from one metered step;
* :class:`PipelineSwapSchedule` — a torch-style schedule executing the finalized orders of
  :mod:`hyper_offload.passes.pipeline` on ``torch.distributed`` (``PipelineStage`` for
  compute and P2P, FSDP2 for unshard / reshard / reduce-grad).

The user-facing door is :mod:`hyper_offload.pipeline` (``swap_wrapper``,
``swap_tensor_wrapper`` and this schedule); the saved-tensor hooks it installs are in
:mod:`.session`.
"""

from hyper_offload._lazy import lazy_getattr
from hyper_offload.errors import SwapStateError, UnsupportedScheduleError

from .footprint import FootprintRecorder
from .session import PipelineSwapSession
from .swap_group import GroupState, SwapGroup

__all__ = [
    "FootprintRecorder",
    "GroupState",
    "PipelineSwapSchedule",
    "PipelineSwapSession",
    "StepObserver",
    "SwapGroup",
    "SwapStateError",
    "UnsupportedScheduleError",
]

# The executor imports torch.distributed.pipelining (seconds of start-up); load it on use.
_LAZY = {
    "PipelineSwapSchedule": ".schedule",
    "StepObserver": ".step_runner",
}


__getattr__ = lazy_getattr(__name__, _LAZY)
