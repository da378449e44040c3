"""hyper-offload: budget-aware activation offloading for PyTorch training."""

from __future__ import annotations

from typing import Any

from .config import OffloadConfig

__version__ = "0.1.0"

# The compile front door imports torch; the CLI and the pure passes must not pay for it,
# so these names are loaded on first access.
_LAZY = {
    "HyperOffloadBackend": "compile_backend",
    "backend": "compile_backend",
    "RegionReport": "region_report",
    "skip_offload": "skip",
}

__all__ = ["HyperOffloadBackend", "OffloadConfig", "RegionReport", "__version__", "backend", "skip_offload"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'hyper_offload' has no attribute {name!r}")
