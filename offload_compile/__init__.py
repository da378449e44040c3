"""hyper-offload: budget-aware activation offloading for PyTorch training."""

from .config import OffloadConfig

__version__ = "0.1.0"

__all__ = ["OffloadConfig", "__version__"]
