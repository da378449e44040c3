"""``OffloadConfig``: the one knob set every front door reads, and how a door resolves the
defaults that depend on the machine (the disk's bandwidth, this rank's host budget).

**The node view of host memory: a rank's share of the machine it runs on.** Every rank
of a node stages its offloaded activations in the same physical memory, so a per-rank
host budget only means something next to how many ranks share the machine.
:meth:`OffloadConfig.host_budget_bytes` turns ``OffloadConfig.max_host_activation_mb``
into bytes; when it is ``None`` (the default) the
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

import difflib
import math
import os
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hyper_offload.errors import ConfigurationError, ConfigurationTypeError
from hyper_offload.passes.plan.report import ResidencyPlanner

MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """User configuration, validated on construction.

    Offloading never changes numerics: every option here trades memory for bandwidth,
    not accuracy.

    Errors: a value of the wrong type raises :class:`ConfigurationTypeError` (also a
    ``TypeError``), a value out of range :class:`ConfigurationError`, and a keyword that
    is no field :class:`ConfigurationError` naming the closest field.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> OffloadConfig:
        # Keywords are checked here, before the generated ``__init__`` sees them: the
        # dataclass keeps its generated ``__init__`` (and ``replace``, ``repr``, pickling,
        # which call ``__new__`` with the same keywords or none), and a misspelt field
        # fails with the field it most likely meant instead of a bare TypeError.
        if args:
            raise ConfigurationTypeError(
                f"OffloadConfig: takes keyword arguments only, got {len(args)} positional "
                f"argument(s); write e.g. OffloadConfig(max_resident_activation_mb=512)"
            )
        names = [f.name for f in fields(cls) if f.init]
        for key in kwargs:
            if key not in names:
                raise ConfigurationError(_unknown_field(key, names))
        return super().__new__(cls)

    max_resident_activation_mb: float = 1024
    """Device budget in MiB for resident activation bytes (the planner's ``budget_bytes``)."""

    max_host_activation_mb: float | None = None
    """Host budget in MiB *per rank* for offloaded activations, counted as the host pool
    holds them (power-of-two buckets): every planner keeps it, like the device budget,
    and the host pool is capped at it. Where the two budgets cannot hold the step
    together, bytes stay on the device (the compile door's ``recompute="auto"``
    recomputes them instead) and the door says the host budget binds. ``None``
    (default): the node view, this machine's available memory divided by the ranks that
    share it (:func:`node_host_budget_bytes`), read when a door starts."""

    local_world_size: int | None = None
    """Ranks sharing this machine's host memory, for the node view of
    ``max_host_activation_mb=None``; ``None``: from ``torch.distributed`` when it is
    initialised (its world size, at most one rank per accelerator), else 1."""

    pageable_fallback: bool = False
    """What the host pool does when a request would break the host budget (a plan made
    with another budget, a custom planner): ``False`` (default) raises
    :class:`~hyper_offload.errors.HostBudgetError` naming the budget and the fix;
    ``True`` serves it from pageable memory past the pinned cap (slower: pageable copies
    block the host), as ``max_offload_activation_mb`` used to."""

    max_offload_activation_mb: float | None = None
    """Deprecated alias of ``max_host_activation_mb`` (it capped the pinned pool and then
    fell back to pageable memory; now the host budget is planned, and pageable memory is
    ``pageable_fallback``'s explicit choice). Setting it warns and sets the host budget;
    setting both raises."""

    max_disk_activation_mb: float | None = None
    """The disk tier below host memory, in MiB per rank: where the host budget binds, the
    planners move the host copies that wait longest to files in ``disk_dir`` instead of
    keeping their bytes on the device (written asynchronously once their D2H is done, read
    back before their reload; exact, bit for bit). ``None`` or ``0`` (default): no disk
    tier. Costs disk bandwidth (``disk_bandwidth_gbps``), priced on the same timeline as
    the copies; docs/disk-tier.md says when it pays."""

    disk_dir: str | os.PathLike[str] | None = None
    """The directory of the disk tier's files (required with ``max_disk_activation_mb``):
    an existing writable directory, or one that can be created (its nearest existing
    parent is a writable directory). Each session or compiled model writes into a
    temporary subdirectory of its own and removes every file on every exit path (a step,
    a failed step, an interrupt, garbage collection, process exit). A local NVMe drive,
    not a network file system."""

    disk_bandwidth_gbps: float | None = None
    """The disk tier's write/read bandwidth in GB/s (10^9 bytes/s) the planners price
    spills and loads at; ``None`` (default): measured once on ``disk_dir`` when a door
    starts (:func:`hyper_offload.runtime.disk_store.profile_disk_bandwidth`)."""

    planner: ResidencyPlanner | None = None
    """Planner used to build the schedule; ``None`` means ``GreedyResidencyPlanner()``."""

    rewarm_on_mismatch: bool = False
    """Eager ``OffloadSession`` only: when a replayed step does not match the warmup
    trace (another branch or shape), re-trace and re-plan transparently instead of
    raising ``ReplayMismatchError``. Off by default so a changing step is reported."""

    max_warmups: int = 3
    """Eager ``OffloadSession`` only: real loops run other ops on their first step or two
    (DDP's bucket rebuild, optimizer state, pipeline stage setup, lazy modules), so until
    two consecutive steps run the same ops the session re-warms by itself, up to this many
    warmup steps in all; then it is strict (``ReplayMismatchError``, unless
    ``rewarm_on_mismatch``). ``1``: strict from the first replay."""

    verify: bool | str = False
    """Check every transfer (``hyper_offload.runtime.verify``): a checksum of the bytes each
    D2H reads, compared where the device bytes are freed and after each reload's wait;
    a difference raises ``TransferIntegrityError``. ``True``: every step;
    ``"first_steps:N"``: the first N steps, then off (leave it in a real run);
    ``False`` (default): nothing is computed."""

    def __post_init__(self) -> None:
        # Validated here, where the user wrote it (torch is imported by then anyway).
        from hyper_offload.runtime.verify import verify_steps

        verify_steps(self.verify)
        for name in ("max_resident_activation_mb", "max_host_activation_mb",
                     "max_offload_activation_mb", "max_disk_activation_mb"):
            value = getattr(self, name)
            if value is None and name != "max_resident_activation_mb":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigurationTypeError(
                    f"OffloadConfig.{name}: expected a finite number of MiB >= 0 (an int or a "
                    f"float), got {type(value).__name__} {value!r}"
                )
            # ``not 0 <= value < inf`` is also true for NaN, which int() would reject later.
            if not 0 <= value < math.inf:
                raise ConfigurationError(
                    f"OffloadConfig.{name}: expected a finite number of MiB >= 0, got {value!r}"
                )
        if not isinstance(self.rewarm_on_mismatch, bool):
            raise ConfigurationTypeError(
                f"OffloadConfig.rewarm_on_mismatch: expected True or False, got "
                f"{self.rewarm_on_mismatch!r}"
            )
        _require_int("max_warmups", self.max_warmups)
        if self.max_warmups < 1:
            raise ConfigurationError(
                f"OffloadConfig.max_warmups: expected a whole number of warmup steps >= 1, got "
                f"{self.max_warmups!r}"
            )
        self._resolve_alias()
        if self.local_world_size is not None:
            _require_int("local_world_size", self.local_world_size)
        if self.local_world_size is not None and self.local_world_size < 1:
            raise ConfigurationError(
                f"OffloadConfig.local_world_size: expected a whole number of ranks >= 1 "
                f"sharing this machine's host memory (or None: from torch.distributed), got "
                f"{self.local_world_size!r}"
            )
        if not isinstance(self.pageable_fallback, bool):
            raise ConfigurationTypeError(
                f"OffloadConfig.pageable_fallback: expected True or False, got "
                f"{self.pageable_fallback!r}"
            )
        self._check_disk()
        if self.planner is not None and not callable(getattr(self.planner, "plan", None)):
            raise ConfigurationTypeError(
                f"OffloadConfig.planner: {self.planner!r} has no plan(trace) method; pass an "
                "object implementing hyper_offload.passes.ResidencyPlanner"
            )

    @property
    def budget_bytes(self) -> int:
        return int(self.max_resident_activation_mb * MIB)

    @property
    def disk_budget_bytes(self) -> int:
        """``max_disk_activation_mb`` in bytes (0: no disk tier)."""
        return int((self.max_disk_activation_mb or 0) * MIB)

    def _check_disk(self) -> None:
        """The disk tier's fields: a bandwidth > 0 if given; a usable ``disk_dir`` when
        the tier is on (checked without creating anything: the door creates it)."""
        gbps = self.disk_bandwidth_gbps
        if gbps is not None and (isinstance(gbps, bool) or not isinstance(gbps, (int, float))
                                 or not 0 < gbps < math.inf):
            raise ConfigurationError(
                f"OffloadConfig.disk_bandwidth_gbps: expected a finite number of GB/s > 0 (or "
                f"None: measured on disk_dir), got {gbps!r}"
            )
        if not self.disk_budget_bytes:
            return
        if self.disk_dir is None:
            raise ConfigurationError(
                f"OffloadConfig.max_disk_activation_mb={self.max_disk_activation_mb!r} turns the "
                "disk tier on, but disk_dir is None: pass disk_dir=<a directory on a local "
                "drive> for its files (or max_disk_activation_mb=None for no disk tier)"
            )
        if not isinstance(self.disk_dir, (str, os.PathLike)):
            raise ConfigurationTypeError(
                f"OffloadConfig.disk_dir: expected a path (str or os.PathLike), got "
                f"{type(self.disk_dir).__name__}"
            )
        problem = disk_dir_problem(Path(self.disk_dir))
        if problem:
            raise ConfigurationError(
                f"OffloadConfig.disk_dir={os.fspath(self.disk_dir)!r}: {problem}; pass a "
                "writable directory on a local drive (it is created if missing)"
            )

    def _resolve_alias(self) -> None:
        old = self.max_offload_activation_mb
        if old is None:
            return
        if self.max_host_activation_mb is not None and self.max_host_activation_mb != old:
            raise ConfigurationError(
                f"OffloadConfig: max_offload_activation_mb={old!r} and max_host_activation_mb="
                f"{self.max_host_activation_mb!r} both set the host budget; keep only "
                "max_host_activation_mb (max_offload_activation_mb is its deprecated alias)"
            )
        warnings.warn(
            "OffloadConfig.max_offload_activation_mb is deprecated: it is now the host budget "
            "the planners keep, max_host_activation_mb (pageable memory past it only with "
            "pageable_fallback=True)", DeprecationWarning, stacklevel=4,
        )
        object.__setattr__(self, "max_host_activation_mb", old)
        # One field holds the budget from here on, so replace() and repr() see it once.
        object.__setattr__(self, "max_offload_activation_mb", None)

    @property
    def max_host_bytes(self) -> int:
        """The host budget in bytes, resolved now (:meth:`host_budget_bytes`)."""
        return self.host_budget_bytes()

    def host_budget_bytes(self) -> int:
        """``max_host_activation_mb`` in bytes, or the node view when it is ``None``
        (:func:`node_host_budget_bytes`: read from the system
        at this call; a door calls it once, where it starts, and keeps the figure)."""
        if self.max_host_activation_mb is not None:
            return int(self.max_host_activation_mb * MIB)
        return node_host_budget_bytes(self.local_world_size)

    def disk_bandwidth(self) -> float:
        """``disk_bandwidth_gbps``, or measured on ``disk_dir`` now when it is None (a
        door calls it once, where it starts, and keeps the figure)."""
        if self.disk_bandwidth_gbps is not None:
            return float(self.disk_bandwidth_gbps)
        if self.disk_dir is None:
            raise ConfigurationError(
                "OffloadConfig.disk_bandwidth(): no disk_dir to measure; set disk_dir, or "
                "disk_bandwidth_gbps")
        from hyper_offload.runtime.disk_store import profile_disk_bandwidth

        return profile_disk_bandwidth(self.disk_dir).gbps

    def resolved_planner(self, host_budget_bytes: int | None = None) -> ResidencyPlanner:
        """The configured planner, else ``GreedyResidencyPlanner`` keeping
        ``host_budget_bytes`` (the door's resolved host budget; None: no host budget)."""
        if self.planner is not None:
            return self.planner
        from hyper_offload.passes import GreedyResidencyPlanner

        return GreedyResidencyPlanner(host_budget_bytes=host_budget_bytes)


def disk_dir_problem(path: Path) -> str | None:
    """What makes ``path`` unusable as the disk tier's directory, or None: an existing
    path must be a writable directory; a missing one needs its nearest existing parent
    to be a writable directory (then it can be created)."""
    if path.exists():
        if not path.is_dir():
            return "exists and is not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return "is a directory this process cannot write"
        return None
    parent = next((p for p in path.absolute().parents if p.exists()), None)
    if parent is None or not parent.is_dir():
        return "does not exist, and no existing parent directory holds it"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"does not exist, and its parent {os.fspath(parent)!r} is not writable"
    return None


def _require_int(name: str, value: Any) -> None:
    """``value`` is a whole number (not a bool): else :class:`ConfigurationTypeError`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationTypeError(
            f"OffloadConfig.{name}: expected a whole number (int), got {type(value).__name__} "
            f"{value!r}"
        )


def _unknown_field(key: str, names: list[str]) -> str:
    """The message for a keyword that is no ``OffloadConfig`` field: the closest field
    (``difflib``), else every field."""
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    hint = (f"did you mean {close[0]!r}?" if close
            else f"the fields are {', '.join(names)}")
    return (f"OffloadConfig: unknown field {key!r}; {hint} (see help(OffloadConfig) for "
            "what each field does)")


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
