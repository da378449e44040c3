"""hyper-offload: budget-aware activation offloading for PyTorch training.

One subpackage per front door; the root holds only the names a first user needs:

* :mod:`hyper_offload.compiler` — ``torch.compile(backend="hyper_offload")``, its options,
  region planning and report, and :func:`estimate` (will a step fit?) on fake tensors;
  :func:`register_backend` names a configured backend for trainers that take a backend
  name, :func:`step_report` reads its step plan back by that name;
* :mod:`hyper_offload.eager` — :class:`OffloadSession` for code ``torch.compile`` cannot take;
* :mod:`hyper_offload.pipeline` — ``swap_wrapper`` and ``PipelineSwapSchedule`` for
  pipeline-parallel training;
* :mod:`hyper_offload.cli` — the ``hyper-offload`` command;
* :mod:`hyper_offload.viz` — plan and pipeline plots (matplotlib, optional);
* :mod:`hyper_offload.exactness` — :func:`check`: is the library bit-exact on *your*
  model? (trains a few steps with and without it, names any saved tensor that differs);
* :mod:`hyper_offload.errors` — every error and warning the library raises, exported
  here too (``except hyper_offload.HyperOffloadError`` catches them all).

Every door plans through :func:`hyper_offload.passes.plan_residency`; the bytes move in
:mod:`hyper_offload.runtime`.
"""

from __future__ import annotations

from . import errors
from ._lazy import lazy_getattr
from .config import OffloadConfig
from .errors import *  # noqa: F403  (errors.__all__: every error and warning, torch-free)

__version__ = "0.1.0"

# The doors import torch; the CLI and the pure passes must not pay for it, so these
# names are loaded on first access.
_LAZY = {
    "backend": ".compiler.registry",
    "check": ".exactness.check",
    "estimate": ".compiler.estimate.fit",
    "OffloadSession": ".eager.session",
    "register_backend": ".compiler.registry",
    "skip_offload": ".eager.opaque",
    "step_report": ".compiler.registry",
}

__all__ = [
    "OffloadConfig", "OffloadSession", "__version__", "backend", "check", "estimate",
    "register_backend", "skip_offload", "step_report", *errors.__all__,
]


__getattr__ = lazy_getattr(__name__, _LAZY)
