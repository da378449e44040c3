"""hyper-offload: budget-aware activation offloading for PyTorch training."""

from .config import OffloadConfig
from .executor_base import OffloadSessionError, StepStats
from .session import OffloadSession, current_session
from .skip import skip_offload
from hyper_offload.passes.op_guide import ReplayMismatchError

__version__ = "0.1.0"

__all__ = [
    "OffloadConfig",
    "OffloadSession",
    "OffloadSessionError",
    "ReplayMismatchError",
    "StepStats",
    "__version__",
    "current_session",
    "skip_offload",
]
