"""Pipeline-parallel activation swap at run time: swap groups, session, executor.

* :class:`SwapGroup` — one chunk's saved activations and their four swap steps, through
  the :class:`~hyper_offload.runtime.residency.ResidencyManager`;
* :class:`PipelineSwapSession` — run-scoped groups of one rank's order (one generation
  per ``step()``);
* :class:`FootprintRecorder` — measures each stage's footprint (the residency model's
  input) from one metered step;
* :mod:`.p2p` — P2P issue and wait for the executor.

The door that drives them is :mod:`hyper_offload.pipeline` (``swap_wrapper``,
``swap_tensor_wrapper`` and ``PipelineSwapSchedule``, the training-step driver that runs
the finalized orders on ``torch.distributed``); the saved-tensor hooks it installs are in
:mod:`.session`.
"""

from hyper_offload.errors import SwapStateError, UnsupportedScheduleError

from .footprint import FootprintRecorder
from .session import PipelineSwapSession
from .swap_group import GroupState, SwapGroup

__all__ = [
    "FootprintRecorder",
    "GroupState",
    "PipelineSwapSession",
    "SwapGroup",
    "SwapStateError",
    "UnsupportedScheduleError",
]
