"""hyper-offload: budget-aware activation offloading for PyTorch training."""

from __future__ import annotations

from typing import Any

from .config import OffloadConfig

__version__ = "0.1.0"

# The front doors import torch; the CLI and the pure passes must not pay for it, so
# these names are loaded on first access.
_LAZY = {
    "HyperOffloadBackend": "compile_backend",
    "backend": "compile_backend",
    "RegionReport": "region_report",
    "skip_offload": "skip",
    "OffloadSession": "session",
    "current_session": "session",
    "OffloadSessionError": "executor_base",
    "StepStats": "executor_base",
    "SwapOutsideGroupWarning": "swap_wrappers",
    "swap_tensor_wrapper": "swap_wrappers",
    "swap_wrapper": "swap_wrappers",
    "estimate": "fit_estimate",
    "EstimateReport": "fit_estimate",
}

__all__ = [
    "EstimateReport",
    "HyperOffloadBackend",
    "OffloadConfig",
    "OffloadSession",
    "OffloadSessionError",
    "RegionReport",
    "ReplayMismatchError",
    "StepStats",
    "SwapOutsideGroupWarning",
    "__version__",
    "backend",
    "current_session",
    "estimate",
    "skip_offload",
    "swap_tensor_wrapper",
    "swap_wrapper",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    if name == "ReplayMismatchError":
        from hyper_offload.passes.op_guide import ReplayMismatchError

        return ReplayMismatchError
    raise AttributeError(f"module 'hyper_offload' has no attribute {name!r}")
