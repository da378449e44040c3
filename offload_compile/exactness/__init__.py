"""Exactness a user can see on their own model: :func:`check` trains a few steps with
and without the library and compares every loss and gradient bit for bit
(:mod:`.check`), naming the saved tensor(s) responsible for any difference."""

from __future__ import annotations

from .._lazy import lazy_getattr

_LAZY = {
    "check": ".check",
    "CheckReport": ".runs",
    "Deviation": ".runs",
    "Mismatch": ".runs",
    "SavedTensor": ".runs",
    "TilingDeviation": ".runs",
    "Verdict": ".runs",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
