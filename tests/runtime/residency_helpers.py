"""What the two modules of the residency manager's tests (``test_residency.py``,
``test_residency_misuse.py``) share besides ``conftest.py``'s fixtures."""

from __future__ import annotations

import torch

from hyper_offload.runtime.residency import ResidencyManager

MIB = 1 << 20


def offloaded(manager: ResidencyManager, sid: int = 0) -> torch.Tensor:
    """A tensor bound to ``manager`` as ``sid`` whose only copy is now on the host (its
    D2H done, its device bytes released)."""
    tensor = torch.ones(32)
    manager.bind(sid, tensor)
    manager.copy_d2h(sid)
    manager.release_device(sid)
    return tensor
