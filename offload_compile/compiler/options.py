"""``options=`` of ``torch.compile(..., backend="hyper_offload")``: parsed and validated.

Accepted keys: every :class:`~hyper_offload.OffloadConfig` field
(``max_resident_activation_mb``, ``max_host_activation_mb``, ``local_world_size``,
``pageable_fallback``, ``planner``; the deprecated ``max_offload_activation_mb``), plus

* ``inner_compiler``: ``"inductor"`` (default) or ``"aot_eager"``;
* ``max_resident_activation_fraction``: the budget as a fraction in (0, 1] of the
  compiled region's activation peak without offload (what torch's
  ``activation_memory_budget`` users know), instead of ``max_resident_activation_mb``;
* ``recompute``: ``"auto"`` (default) or ``"off"``. ``"auto"`` lets a region whose
  offload-only plan stalls compute or cannot meet the budget recompute more in the
  backward as well (:mod:`.recompute.search`); a region whose offload-only plan is
  stall-free, or whose budget is at or above its peak, compiles exactly as with
  ``"off"``, which never asks the partitioner for more recompute than torch's default;
* ``transfer_bandwidth_gbps``: price host/device copies at this many GB/s each way
  instead of the link measured on the region's device (plan for a target machine's
  link, or make plans independent of a noisy measurement);
* ``budget_scope``: ``"step"`` (default) or ``"region"``. ``"step"``: the budget holds
  for the whole training step, however many regions and invocations it runs (per-block
  compile, graph breaks, DDP, FSDP2): each region is lowered at its floor for the first
  step and, once a step was seen, one step plan decides what each invocation keeps
  (:mod:`~hyper_offload.passes.plan.step.plan`); a fraction is of the step's peak.
  ``"region"``: each region is planned on its own under the whole budget (a fraction is of
  the region's peak), with the recompute search, as before the step plan: right when the
  step is one region run once;
* ``mode``: an Inductor mode (``torch.compile(..., mode=...)`` arrives here too):
  its settings apply to the inner Inductor, except CUDA graphs (a region's transfers
  keep host-side state, pool buffers and events, that a graph replay would skip; a
  warning says so once). Refused for ``inner_compiler="aot_eager"``, which has no modes;
* ``verify``: ``True`` checks every transfer (:mod:`hyper_offload.runtime.verify`: a
  checksum at each D2H, checked where the source is freed and where the reload is
  waited); ``"first_steps:N"`` checks the first N steps (needs ``budget_scope="step"``,
  which is where the backend sees steps). It changes no graph: the checks run inside
  the transfer ops' kernels, and a change of ``verify`` recompiles nothing;
* the disk tier (``max_disk_activation_mb``, ``disk_dir``, ``disk_bandwidth_gbps``:
  :class:`~hyper_offload.OffloadConfig`) needs ``budget_scope="region"``: each region's
  plan spills the host copies its host budget cannot hold (docs/disk-tier.md); a region
  with dynamic sizes plans without it;
* ``move_only``: the saved tensors that may move, as ``(region, saved name)`` pairs
  (names as a region's report lists them); every other saved activation stays on the
  device, and a storage moves only when every saved tensor on it may. For narrowing an
  exactness question down to the tensors responsible (``hyper_offload.check`` bisects
  with it); ``None`` (default): everything movable may move;
* ``tile_sequence``: ``"off"`` (default), ``"auto"`` or a tile count >= 2. Sequence
  tiling (:mod:`.tiling`): where a token-wise op (an MLP, a norm, the LM head and its
  loss) sets a region's floor, split it along the sequence into tiles, each recomputed
  in its backward; ``"auto"`` picks the fewest tiles whose floor fits the budget, an
  int that many tiles. **Not bit-exact**: the sums over tokens (weight gradients, a loss
  mean) are added tile by tile, in another order; ``hyper_offload.check`` measures the
  deviation on your model. With ``"off"`` every plan stays bit-exact.

Eager-only ``OffloadConfig`` fields (``rewarm_on_mismatch``) are refused: compiled
regions re-plan on recompilation instead.

Anything else, a wrong type, NaN, a negative or infinite number, or both budgets at
once raises :class:`~hyper_offload.ConfigurationError` (a ``ValueError``) naming the key
and what it accepts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hyper_offload.errors import ConfigurationError
from hyper_offload.config import OffloadConfig

__all__ = [
    "BUDGET_SCOPES",
    "EAGER_ONLY",
    "INNER_COMPILERS",
    "RECOMPUTE_MODES",
    "BackendOptions",
    "parse_backend_options",
]

INNER_COMPILERS = ("inductor", "aot_eager")
RECOMPUTE_MODES = ("auto", "off")
BUDGET_SCOPES = ("step", "region")
_FRACTION = "max_resident_activation_fraction"
_LINK = "transfer_bandwidth_gbps"
EAGER_ONLY = ("rewarm_on_mismatch",)
_CONFIG_KEYS = tuple(
    f.name for f in dataclasses.fields(OffloadConfig) if f.name not in EAGER_ONLY
)
_KEYS = (*_CONFIG_KEYS, "inner_compiler", _FRACTION, "recompute", _LINK, "mode", "budget_scope",
         "move_only", "tile_sequence")
_CUDAGRAPHS = "triton.cudagraphs"


@dataclass(frozen=True, kw_only=True)
class BackendOptions:
    """A validated option set. ``budget_fraction`` is None when the budget is in MiB;
    ``transfer_bandwidth_gbps`` is None when the link is measured."""

    config: OffloadConfig
    inner_compiler: str = "inductor"
    budget_fraction: float | None = None
    recompute: str = "auto"
    transfer_bandwidth_gbps: float | None = None
    mode: str | None = None
    budget_scope: str = "step"
    move_only: frozenset[tuple[int, str]] | None = None
    tile_sequence: str | int = "off"
    """``"off"``, ``"auto"`` or a tile count (module docstring): not bit-exact unless off."""
    host_budget_bytes: int | None = dataclasses.field(default=None, compare=False)
    """The host budget in bytes every plan keeps: ``config.host_budget_bytes()``, resolved
    once when the options are made (the node view reads the machine then). Not part of
    equality nor of :meth:`cache_key` (the config's ``max_host_activation_mb`` is): the
    node view's figure moves with the machine, and a cached graph whose plan asks for
    more host room than there is keeps those bytes on the device at run time
    (:func:`hyper_offload.runtime.ops` ``copy_d2h``), exactly."""

    disk_bandwidth_gbps: float | None = dataclasses.field(default=None, compare=False)
    """What plans price the disk tier at (``config.disk_bandwidth()``: given, or measured
    once on ``disk_dir`` when the options are made); None without a disk tier. Not part of
    equality nor of :meth:`cache_key`, as ``host_budget_bytes``."""

    def __post_init__(self) -> None:
        if self.host_budget_bytes is None:
            object.__setattr__(self, "host_budget_bytes", self.config.host_budget_bytes())
        if self.disk_bandwidth_gbps is None and self.config.disk_budget_bytes:
            object.__setattr__(self, "disk_bandwidth_gbps", self.config.disk_bandwidth())

    def may_move(self, region: int) -> frozenset[str] | None:
        """The saved tensors of ``region`` that may move (None: every movable one)."""
        if self.move_only is None:
            return None
        return frozenset(name for index, name in self.move_only if index == region)

    @property
    def step_scoped(self) -> bool:
        """Whether the budget is the whole step's (module docstring, ``budget_scope``)."""
        return self.budget_scope == "step"

    def _mode_settings(self) -> dict[str, Any]:
        """Every Inductor setting of ``mode`` (none without a mode)."""
        if self.mode is None:
            return {}
        from torch._inductor import list_mode_options

        return list_mode_options(self.mode)

    def inductor_patches(self) -> dict[str, Any]:
        """The Inductor settings of ``mode``, without CUDA graphs (module docstring)."""
        return {k: v for k, v in self._mode_settings().items() if k != _CUDAGRAPHS}

    @property
    def drops_cudagraphs(self) -> bool:
        """Whether ``mode`` asked for CUDA graphs, which hyper_offload regions run without."""
        return bool(self._mode_settings().get(_CUDAGRAPHS))

    def budget_bytes(self, peak_without_offload: int) -> int:
        """The region's budget: the fraction of its peak, else the configured MiB."""
        if self.budget_fraction is not None:
            return int(self.budget_fraction * peak_without_offload)
        return self.config.budget_bytes

    def cache_key(self) -> str:
        """What distinguishes two option sets in Inductor's caches (not ``verify``: it
        changes no graph, only what the transfer ops' kernels check)."""
        config = dataclasses.replace(self.config, verify=False)
        move_only = None if self.move_only is None else sorted(self.move_only)
        return repr((config, self.inner_compiler, self.budget_fraction, self.recompute,
                     self.transfer_bandwidth_gbps, self.mode, self.budget_scope, move_only,
                     self.tile_sequence))


def parse_backend_options(options: Mapping[str, Any] | None) -> BackendOptions:
    """Validate ``options`` (see the module docstring)."""
    options = dict(options or {})
    for key in options:
        if key in EAGER_ONLY:
            raise ConfigurationError(
                f"hyper_offload options: {key!r} is an eager-session option (OffloadSession); "
                "a compiled region re-plans when Dynamo recompiles it. Fix: remove it from "
                "the compile options"
            )
        if key not in _KEYS:
            raise ConfigurationError(
                f"hyper_offload options: unknown key {key!r}; accepted keys are "
                f"{', '.join(_KEYS)}"
            )
    if _FRACTION in options and "max_resident_activation_mb" in options:
        raise ConfigurationError(
            f"hyper_offload options: {_FRACTION!r} and 'max_resident_activation_mb' are two "
            "ways to give one budget; pass only one of them"
        )
    inner = options.pop("inner_compiler", "inductor")
    if inner not in INNER_COMPILERS:
        raise ConfigurationError(
            f"hyper_offload options: 'inner_compiler' must be one of "
            f"{', '.join(map(repr, INNER_COMPILERS))}, got {inner!r}"
        )
    mode = _parse_mode(options.pop("mode", None), inner)
    recompute = options.pop("recompute", "auto")
    if recompute not in RECOMPUTE_MODES:
        raise ConfigurationError(
            f"hyper_offload options: 'recompute' must be one of "
            f"{', '.join(map(repr, RECOMPUTE_MODES))}, got {recompute!r}"
        )
    scope = options.pop("budget_scope", "step")
    if scope not in BUDGET_SCOPES:
        raise ConfigurationError(
            f"hyper_offload options: 'budget_scope' must be one of "
            f"{', '.join(map(repr, BUDGET_SCOPES))}, got {scope!r}"
        )
    fraction = options.pop(_FRACTION, None)
    if fraction is not None and not (_is_number(fraction) and 0 < fraction <= 1):
        raise ConfigurationError(
            f"hyper_offload options: {_FRACTION!r} must be a number in (0, 1] (a fraction "
            f"of the region's activation peak without offload), got {fraction!r}"
        )
    link = options.pop(_LINK, None)
    if link is not None and not (_is_number(link) and 0 < link < math.inf):
        raise ConfigurationError(
            f"hyper_offload options: {_LINK!r} must be a finite number of GB/s > 0 (the "
            f"copy bandwidth each way to plan with), got {link!r}"
        )
    move_only = _parse_move_only(options.pop("move_only", None))
    tile_sequence = _parse_tile_sequence(options.pop("tile_sequence", "off"))
    try:
        config = OffloadConfig(**options)
    except (TypeError, ValueError) as error:
        key = next((k for k in options if k in str(error)), ", ".join(options))
        # A ConfigurationTypeError stays one (also a TypeError and a ValueError).
        kind = type(error) if isinstance(error, ConfigurationError) else ConfigurationError
        raise kind(f"hyper_offload options: {key!r}: {error}") from None
    if isinstance(config.verify, str) and scope != "step":
        raise ConfigurationError(
            f"hyper_offload options: verify={config.verify!r} counts steps, and with "
            "budget_scope='region' the backend sees regions, not steps. Fix: use "
            "verify=True, or budget_scope='step' (the default)"
        )
    if config.disk_budget_bytes and scope != "region":
        raise ConfigurationError(
            "hyper_offload options: max_disk_activation_mb (the disk tier) is planned per "
            "region so far: budget_scope='step' does not spill to disk yet. Fix: pass "
            "budget_scope='region', or drop max_disk_activation_mb"
        )
    return BackendOptions(
        config=config, inner_compiler=inner,
        budget_fraction=None if fraction is None else float(fraction),
        recompute=recompute,
        transfer_bandwidth_gbps=None if link is None else float(link),
        mode=mode, budget_scope=scope, move_only=move_only, tile_sequence=tile_sequence,
    )


def _parse_move_only(value: Any) -> frozenset[tuple[int, str]] | None:
    """``move_only`` as a frozenset of ``(region, saved name)`` pairs (module docstring)."""
    if value is None:
        return None
    pairs = list(value) if isinstance(value, (set, frozenset, list, tuple)) else None
    if pairs is None or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], int)
        and not isinstance(p[0], bool) and isinstance(p[1], str) for p in pairs
    ):
        raise ConfigurationError(
            "hyper_offload options: 'move_only' must be a collection of (region index, saved "
            f"tensor name) pairs, e.g. {{(0, 'addmm')}}, got {value!r}"
        )
    return frozenset(pairs)


def _parse_tile_sequence(value: Any) -> str | int:
    """``tile_sequence``: "off", "auto" or an int tile count >= 2 (module docstring)."""
    if value in ("off", "auto") and isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
        return value
    raise ConfigurationError(
        "hyper_offload options: 'tile_sequence' must be 'off' (the default, bit-exact), "
        "'auto' (the fewest tiles whose floor fits the budget) or a tile count >= 2, got "
        f"{value!r}. Tiling is not bit-exact: sums over tokens are reassociated"
    )


def _parse_mode(mode: Any, inner: str) -> str | None:
    """``mode`` validated against Inductor's modes (None and "default" mean none)."""
    if mode is None or mode == "default":
        return None
    from torch._inductor import list_mode_options

    modes = [m for m in list_mode_options() if m != "default"]
    if mode not in modes:
        raise ConfigurationError(
            f"hyper_offload options: 'mode' must be one of {', '.join(map(repr, modes))} "
            f"(Inductor's modes), got {mode!r}"
        )
    if inner != "inductor":
        raise ConfigurationError(
            f"hyper_offload options: mode={mode!r} is an Inductor mode, and "
            f"inner_compiler={inner!r} has none. Fix: drop mode, or use "
            "inner_compiler='inductor'"
        )
    return mode


def _is_number(value: Any) -> bool:
    """A real number that is not NaN (bools are not numbers here)."""
    return (
        not isinstance(value, bool) and isinstance(value, (int, float)) and not math.isnan(value)
    )
