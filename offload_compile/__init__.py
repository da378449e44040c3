"""hyper-offload: budget-aware activation offloading for PyTorch training."""

from .config import OffloadConfig
from .swap_wrappers import SwapOutsideGroupWarning, swap_tensor_wrapper, swap_wrapper

__version__ = "0.1.0"

__all__ = [
    "OffloadConfig",
    "SwapOutsideGroupWarning",
    "__version__",
    "swap_tensor_wrapper",
    "swap_wrapper",
]
