"""The node view of host memory: a rank's share of the machine it runs on.

Every rank of a node stages its offloaded activations in the same physical memory, so a
per-rank host budget only means something next to how many ranks share the machine.
:meth:`~hyper_offload.config.OffloadConfig.host_budget_bytes` turns
``OffloadConfig.max_host_activation_mb`` into bytes; when it is ``None`` (the default) the
budget is the node view::

    host budget = available host memory / local ranks

* available host memory: what the operating system reports as available *now*
  (``MemAvailable`` of ``/proc/meminfo`` on Linux: free memory plus what the kernel can
  reclaim; elsewhere ``os.sysconf``'s available physical pages), read when a door
  resolves its configuration (the eager session's construction, the compile backend's
  options), never at import;
* local ranks: ``OffloadConfig.local_world_size`` when given, else, with
  ``torch.distributed`` initialised, its world size capped at the accelerators this
  machine has (one rank per device, the usual launch; on a CPU-only build every rank is
  taken to share this machine), else 1.

Both figures can be overridden (``max_host_activation_mb``, ``local_world_size``): a node
that also hosts a data loader, or runs several jobs, should set its own. No environment
variable is read: launchers' ``LOCAL_WORLD_SIZE`` belongs to the launcher.
"""

from __future__ import annotations

import os
from pathlib import Path

from hyper_offload.errors import ConfigurationError

__all__ = ["available_host_bytes", "local_world_size", "node_host_budget_bytes"]

_MEMINFO = Path("/proc/meminfo")


def available_host_bytes() -> int:
    """Host memory the operating system can give this process now, in bytes."""
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        pass  # not Linux (or no procfs): the portable, more conservative figure below
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError) as error:
        raise ConfigurationError(
            "OffloadConfig.max_host_activation_mb=None: this system reports no available "
            f"host memory ({error}); set max_host_activation_mb to this rank's share of it"
        ) from None


def local_world_size() -> int:
    """Ranks sharing this machine's host memory (module docstring)."""
    import torch

    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return 1
    world = distributed.get_world_size()
    if torch.accelerator.is_available():
        return max(1, min(world, torch.accelerator.device_count()))
    return world


def node_host_budget_bytes(local_ranks: int | None = None) -> int:
    """This rank's share of the machine's available host memory: available bytes over
    ``local_ranks`` (None: :func:`local_world_size`)."""
    ranks = local_world_size() if local_ranks is None else local_ranks
    return available_host_bytes() // max(1, ranks)
