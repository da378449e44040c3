"""Pipeline-parallel activation swap at run time: swap groups, session, executor.

* :class:`SwapGroup` — one chunk's saved activations and their four swap steps, through
  the :class:`~hyper_offload.runtime.residency.ResidencyManager`;
* :class:`PipelineSwapSession` — run-scoped groups of one rank's order (one generation
  per ``step()``);
* :class:`PipelineSwapSchedule` — a torch-style schedule executing the finalized orders of
  :mod:`hyper_offload.passes.pipeline` on ``torch.distributed`` (``PipelineStage`` for
  compute and P2P, FSDP2 for unshard / reshard / reduce-grad).

The user-facing wrappers (``swap_wrapper``, ``swap_tensor_wrapper``) live in
:mod:`hyper_offload` and use :mod:`.hooks`.
"""

from .hooks import NO_WINDOW, SavedRef, current_group, group_scope, in_pipeline_forward, saved_tensor_hooks
from .session import PipelineSwapSession
from .swap_group import GroupState, SwapGroup, SwapStateError, group_name

__all__ = [
    "NO_WINDOW",
    "GroupState",
    "PipelineSwapSchedule",
    "PipelineSwapSession",
    "SavedRef",
    "StepObserver",
    "SwapGroup",
    "SwapStateError",
    "UnsupportedScheduleError",
    "current_group",
    "group_name",
    "group_scope",
    "in_pipeline_forward",
    "saved_tensor_hooks",
]

# The executor imports torch.distributed.pipelining (seconds of start-up); load it on use.
_LAZY = {
    "PipelineSwapSchedule": "schedule",
    "UnsupportedScheduleError": "schedule",
    "StepObserver": "step_runner",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
