"""The eager door: ``with OffloadSession(OffloadConfig(...)):`` around a training step.

Step 0 (warmup) records the step through a ``TorchDispatchMode`` with online eviction,
then plans it with the one planning pipeline of :mod:`hyper_offload.passes`; later steps
replay that schedule through the runtime's ``ResidencyManager``.

* :mod:`.session` — :class:`OffloadSession`, phase and reports;
* :mod:`.executor_base` — the active session and executor (a ``ContextVar``; a leaf module);
* :mod:`.dispatch_mode` — recording ops and storages (the mode and the tracker);
* :mod:`.executor_base`, :mod:`.warmup`, :mod:`.replay` — the two executors;
* :mod:`.opaque` — regions run as one op
  (``@skip_offload``, compiled submodules).
"""

from __future__ import annotations

from .._lazy import lazy_getattr
from ..errors import OffloadBudgetWarning, OffloadSessionError, ReplayMismatchError

_LAZY = {
    "OffloadSession": ".session",
    "StepStats": ".executor_base",
    "current_session": ".executor_base",
    "skip_offload": ".opaque",
}

__all__ = [
    "OffloadBudgetWarning",
    "OffloadSession",
    "OffloadSessionError",
    "ReplayMismatchError",
    "StepStats",
    "current_session",
    "skip_offload",
]


__getattr__ = lazy_getattr(__name__, _LAZY)
