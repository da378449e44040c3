"""``OffloadConfig``: the one knob set every front door reads."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hyper_offload.errors import ConfigurationError, ConfigurationTypeError
from hyper_offload.passes.plan.protocol import ResidencyPlanner

MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """User configuration, validated on construction.

    Offloading never changes numerics: every option here trades memory for bandwidth,
    not accuracy.
    """

    max_resident_activation_mb: float = 1024
    """Device budget in MiB for resident activation bytes (the planner's ``budget_bytes``)."""

    max_offload_activation_mb: float = 65536
    """Cap in MiB on pinned host memory; past it the host pool hands out pageable memory."""

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
        for name in ("max_resident_activation_mb", "max_offload_activation_mb"):
            value = getattr(self, name)
            # ``not 0 <= value < inf`` is also true for NaN, which int() would reject later.
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0 <= value < math.inf
            ):
                raise ConfigurationError(
                    f"OffloadConfig.{name}: expected a finite number of MiB >= 0, got {value!r}"
                )
        if not isinstance(self.rewarm_on_mismatch, bool):
            raise ConfigurationTypeError(
                f"OffloadConfig.rewarm_on_mismatch: expected True or False, got "
                f"{self.rewarm_on_mismatch!r}"
            )
        if isinstance(self.max_warmups, bool) or not isinstance(self.max_warmups, int) or (
            self.max_warmups < 1
        ):
            raise ConfigurationError(
                f"OffloadConfig.max_warmups: expected a whole number of warmup steps >= 1, got "
                f"{self.max_warmups!r}"
            )
        if self.planner is not None and not callable(getattr(self.planner, "plan", None)):
            raise ConfigurationTypeError(
                f"OffloadConfig.planner: {self.planner!r} has no plan(trace) method; pass an "
                "object implementing hyper_offload.passes.ResidencyPlanner"
            )

    @property
    def budget_bytes(self) -> int:
        return int(self.max_resident_activation_mb * MIB)

    @property
    def max_host_bytes(self) -> int:
        return int(self.max_offload_activation_mb * MIB)

    def resolved_planner(self) -> ResidencyPlanner:
        if self.planner is not None:
            return self.planner
        from hyper_offload.passes import GreedyResidencyPlanner

        return GreedyResidencyPlanner()
