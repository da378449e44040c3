"""``options=`` of ``torch.compile(..., backend="hyper_offload")``: parsed and validated.

Accepted keys: every :class:`~hyper_offload.OffloadConfig` field
(``max_resident_activation_mb``, ``max_offload_activation_mb``, ``planner``), plus

* ``inner_compiler``: ``"inductor"`` (default) or ``"aot_eager"``;
* ``max_resident_activation_fraction``: the budget as a fraction in (0, 1] of the
  compiled region's activation peak without offload (what torch's
  ``activation_memory_budget`` users know), instead of ``max_resident_activation_mb``.

Anything else, a wrong type, NaN, a negative or infinite number, or both budgets at
once raises ``ValueError`` naming the key and what it accepts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hyper_offload.config import OffloadConfig

__all__ = ["INNER_COMPILERS", "BackendOptions", "parse_backend_options"]

INNER_COMPILERS = ("inductor", "aot_eager")
_FRACTION = "max_resident_activation_fraction"
_CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(OffloadConfig))
_KEYS = (*_CONFIG_KEYS, "inner_compiler", _FRACTION)


@dataclass(frozen=True, kw_only=True)
class BackendOptions:
    """A validated option set. ``budget_fraction`` is None when the budget is in MiB."""

    config: OffloadConfig
    inner_compiler: str = "inductor"
    budget_fraction: float | None = None

    def budget_bytes(self, peak_without_offload: int) -> int:
        """The region's budget: the fraction of its peak, else the configured MiB."""
        if self.budget_fraction is not None:
            return int(self.budget_fraction * peak_without_offload)
        return self.config.budget_bytes

    def cache_key(self) -> str:
        """What distinguishes two option sets in Inductor's caches."""
        return repr((self.config, self.inner_compiler, self.budget_fraction))


def parse_backend_options(options: Mapping[str, Any] | None) -> BackendOptions:
    """Validate ``options`` (see the module docstring)."""
    options = dict(options or {})
    for key in options:
        if key not in _KEYS:
            raise ValueError(
                f"hyper_offload options: unknown key {key!r}; accepted keys are "
                f"{', '.join(_KEYS)}"
            )
    if _FRACTION in options and "max_resident_activation_mb" in options:
        raise ValueError(
            f"hyper_offload options: {_FRACTION!r} and 'max_resident_activation_mb' are two "
            "ways to give one budget; pass only one of them"
        )
    inner = options.pop("inner_compiler", "inductor")
    if inner not in INNER_COMPILERS:
        raise ValueError(
            f"hyper_offload options: 'inner_compiler' must be one of "
            f"{', '.join(map(repr, INNER_COMPILERS))}, got {inner!r}"
        )
    fraction = options.pop(_FRACTION, None)
    if fraction is not None and (
        isinstance(fraction, bool)
        or not isinstance(fraction, (int, float))
        or not 0 < fraction <= 1
        or math.isnan(fraction)
    ):
        raise ValueError(
            f"hyper_offload options: {_FRACTION!r} must be a number in (0, 1] (a fraction "
            f"of the region's activation peak without offload), got {fraction!r}"
        )
    try:
        config = OffloadConfig(**options)
    except (TypeError, ValueError) as error:
        key = next((k for k in options if k in str(error)), ", ".join(options))
        raise ValueError(f"hyper_offload options: {key!r}: {error}") from None
    return BackendOptions(
        config=config, inner_compiler=inner,
        budget_fraction=None if fraction is None else float(fraction),
    )
