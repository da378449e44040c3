"""hyper-offload: budget-aware activation offloading for PyTorch training."""

from .config import OffloadConfig
from .session import OffloadSession, current_session

__version__ = "0.1.0"

__all__ = ["OffloadConfig", "OffloadSession", "__version__", "current_session"]
