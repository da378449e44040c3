"""What the backend did to one compiled region, from Python and through ``logging``: the
plan's records (:class:`RegionReport` and its parts) and what sequence tiling did to the
region and what it chose from (:class:`TilingReport`, ``tile_sequence``, :mod:`.tiling`),
which the region report, the step report and ``hyper_offload.check`` print.

Logger ``hyper_offload`` (quiet by default: the report is logged at INFO, and the one
WARNING per region whose budget is infeasible reaches stderr through Python's
last-resort handler unless the application configures logging).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from ..passes.fx.sizes import SymbolicSize

LOGGER = logging.getLogger("hyper_offload")

UNDER_FLOOR = "hyper_offload_under_floor"
"""Set (True) on the log records that say the device budget is under the floor, so that a
caller who chose such a budget on purpose (``hyper_offload.check``'s budget 0: everything
movable moved) can filter them without reading their text."""

__all__ = [
    "LOGGER",
    "NOT_BIT_EXACT",
    "UNDER_FLOOR",
    "InfeasibleOpReport",
    "KeptSavedReport",
    "PartitionReport",
    "RecomputeReport",
    "RegionReport",
    "TiledSpanReport",
    "TilingReport",
    "log_region_report",
]


@dataclass(frozen=True)
class InfeasibleOpReport:
    """An op whose non-offloadable live bytes exceed the budget, by ``excess_bytes``."""

    op: str
    required_bytes: int
    excess_bytes: int


@dataclass(frozen=True)
class KeptSavedReport:
    """One storage of saved activations that stays on the device, and why
    (``passes.fx.saved``): ``names`` are the saved tensors on it."""

    names: tuple[str, ...]
    nbytes: int
    reason: str


@dataclass(frozen=True)
class PartitionReport:
    """One partition the recompute search planned: torch's min-cut partition at
    ``activation_memory_budget=memory_budget``, planned under the region's budget.

    ``step_s`` = ``compute_s`` (every op of both graphs, recomputation included, priced
    by the roofline) + ``stall_s`` (the timeline model's stall of its plan), predicted.
    ``rejected`` says why the search could not use it (None: it could)."""

    memory_budget: float
    compute_s: float
    stall_s: float
    feasible: bool
    peak_without_offload: int
    peak_with_plan: int
    bytes_d2h: int
    recomputed: int
    rejected: str | None = None
    spliced: int = 0
    """Saved activations of the default partition that its spliced backward recomputes
    (:mod:`.recompute.splice`; 0: torch's own partition at ``memory_budget``)."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.stall_s


@dataclass(frozen=True)
class RecomputeReport:
    """What the recompute search chose for one region (``options={"recompute": ...}``).

    ``recomputed`` names the saved activations the chosen partition recomputes in the
    backward instead of saving, beyond what torch's default partition already
    recomputes (empty: the default partition was kept). The three ``*_s`` figures are
    predicted step times (compute + stall): ``offload_only_s`` the default partition
    planned by hyper_offload (None when infeasible), ``recompute_only_s`` the cheapest
    searched partition whose own peak fits the budget with no copy (None: none does, or
    the search did not run), ``joint_s`` the chosen one. ``searched`` is False when the
    default partition's plan already met the budget without stalling (nothing to
    gain) or recompute is off; ``restriction`` names the exactness rule that limited
    what could be recomputed, if any; ``spliced`` counts the saved activations the
    chosen spliced backward recomputes (0: a partition of torch's was chosen).
    """

    mode: str
    searched: bool
    memory_budget: float
    recomputed: tuple[str, ...]
    offload_only_s: float | None
    recompute_only_s: float | None
    joint_s: float
    partitions: tuple[PartitionReport, ...] = ()
    restriction: str | None = None
    spliced: int = 0
    work_bounded: bool = False
    """True when the search stopped at its work bound (:mod:`.recompute.search`,
    :data:`~.recompute.candidates.SEARCH_MIN_WORK`) before trying every partition."""

    def summary(self) -> dict[str, object]:
        data = dict(self.__dict__)
        data["recomputed"] = list(self.recomputed)
        data["partitions"] = [{**p.__dict__, "step_s": p.step_s} for p in self.partitions]
        return data

    def describe(self, placed: str = "") -> str:
        """One line: what was chosen and each strategy's predicted step; ``placed``
        (e.g. "3 saved tensor(s) kept, 2 moved") is said first when given."""
        def ms(seconds: float | None) -> str:
            return "cannot fit" if seconds is None else f"{seconds * 1e3:.3f} ms"

        head = f"recompute={self.mode}: {placed + ', ' if placed else ''}"
        if not self.searched:
            why = "recompute off" if self.mode == "off" else "the offload-only plan does not stall"
            return f"{head}no extra recompute ({why}); predicted step {ms(self.joint_s)}"
        if self.spliced:
            chosen = (
                f"{self.spliced} saved activation(s) recomputed by the spliced backward "
                f"({len(self.recomputed)} op(s))"
            )
        elif self.recomputed:
            chosen = (
                f"{len(self.recomputed)} more op(s) recomputed "
                f"(activation_memory_budget={self.memory_budget:g})"
            )
        else:
            chosen = "no extra recompute"
        restriction = f"; {self.restriction}" if self.restriction else ""
        if self.work_bounded:
            restriction += "; the search stopped at its work bound"
        return (
            f"{head}{chosen}, {len(self.partitions)} partition(s) searched; predicted step: "
            f"offload only {ms(self.offload_only_s)}, recompute only "
            f"{ms(self.recompute_only_s)}, chosen {ms(self.joint_s)}{restriction}"
        )

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True)
class RegionReport:
    """Per compiled region: sizes, the plan's predicted effect, and its feasibility.

    ``predicted_peak_before`` / ``after`` are the activation bytes resident at the
    region's peak without and with the plan (``check_schedule``'s curve); "without" is
    torch's default partition (plain compile), "with" includes any extra recompute;
    ``exposed_transfer_s`` is the copy time compute is not predicted to hide;
    ``kept`` lists the saved activations no plan can move (parameters and inputs are
    not activations and are not listed), largest first. ``budget_bytes`` is the bound the
    region was planned under: the options' budget under ``budget_scope="region"``; under
    ``"step"`` the region's floor is planned under its own peak (the most any of its ops
    needs), and the step's budget is the step report's.
    """

    region: int
    inner_compiler: str
    fw_nodes: int
    bw_nodes: int
    saved_activation_bytes: int
    budget_bytes: int
    predicted_peak_before: int
    predicted_peak_after: int
    bytes_d2h: int
    bytes_h2d: int
    transfers: int
    offloaded: tuple[str, ...]
    d2h_s: float
    h2d_s: float
    exposed_transfer_s: float
    infeasible_ops: tuple[InfeasibleOpReport, ...]
    plan_seconds: float
    kept: tuple[KeptSavedReport, ...] = ()
    recompute: RecomputeReport | None = None
    """What the recompute search chose (None: the region was planned without it)."""
    resident: tuple[str, ...] = ()
    """Saved activations that stay on the device (not moved: those the plan keeps and
    those in ``kept``); with ``offloaded`` and ``recompute.recomputed``: kept, moved,
    recomputed."""
    sizes: tuple[SymbolicSize, ...] = ()
    """The region's symbolic sizes and the value its plan assumes for each
    (:mod:`hyper_offload.passes.fx.sizes`): the plan holds at every size up to a
    ``RANGE`` bound; a ``HINT`` size has no bound and a larger one may exceed the budget
    (empty: the region has static shapes)."""
    host_budget_bytes: int | None = None
    """The host budget the region's plan keeps (pool buckets; None: none, the step
    scope's floor, whose host bytes the step plan keeps)."""
    peak_host_bytes: int = 0
    """The most host bytes (pool buckets) the region's plan holds at once (*predicted*)."""
    binding: str = "none"
    """Which budget limits the plan: ``"device"`` (the device budget made it move bytes,
    or its ops' own operands are over it), ``"host"`` (the host budget kept bytes on the
    device past ``budget_bytes``: ``predicted_peak_after`` is over it, exactly), ``"none"``."""
    tiling: TilingReport | None = None
    """What sequence tiling did to the region (``tile_sequence``; None: off). A tiled
    region's plan is *not bit-exact* (its ``__str__`` says so)."""

    @property
    def feasible(self) -> bool:
        return not self.infeasible_ops

    @property
    def kept_bytes(self) -> int:
        """Bytes of saved activations that stay on the device whatever the budget."""
        return sum(k.nbytes for k in self.kept)

    def summary(self) -> dict[str, object]:
        data = dict(self.__dict__)
        data["infeasible_ops"] = [op.__dict__ for op in self.infeasible_ops]
        data["kept"] = [{**k.__dict__, "names": list(k.names)} for k in self.kept]
        data["kept_bytes"] = self.kept_bytes
        data["offloaded"] = list(self.offloaded)
        data["resident"] = list(self.resident)
        data["feasible"] = self.feasible
        data["recompute"] = None if self.recompute is None else self.recompute.summary()
        data["sizes"] = [{**size.__dict__, "sources": list(size.sources),
                          "bound": size.bound.value} for size in self.sizes]
        data["tiling"] = None if self.tiling is None else self.tiling.summary()
        return data

    def __str__(self) -> str:
        recompute = "" if self.recompute is None else f"; {self.recompute}"
        if self.sizes:
            recompute += "; sizes: " + ", ".join(str(size) for size in self.sizes)
        if self.tiling is not None:
            recompute += f"; {self.tiling}"
        return (
            f"hyper_offload region {self.region} ({self.inner_compiler}): "
            f"{self.fw_nodes}+{self.bw_nodes} nodes, saved activations "
            f"{self.saved_activation_bytes} B, budget {self.budget_bytes} B, predicted peak "
            f"{self.predicted_peak_before} -> {self.predicted_peak_after} B, "
            f"{len(self.resident)} saved kept, {len(self.offloaded)} offloaded ({self.bytes_d2h} B D2H, {self.bytes_h2d} B H2D, "
            f"{self.transfers} transfers), {self.kept_bytes} B saved that cannot move "
            f"({len(self.kept)} storages), predicted exposed transfer "
            f"{self.exposed_transfer_s * 1e6:.1f} us, planned in {self.plan_seconds * 1e3:.1f} ms"
            f"{recompute}"
        )

    def infeasible_message(self) -> str:
        worst = sorted(self.infeasible_ops, key=lambda o: -o.excess_bytes)[:5]
        ops = ", ".join(f"{o.op} needs {o.required_bytes} B (+{o.excess_bytes} B)" for o in worst)
        return (
            f"hyper_offload region {self.region}: the budget of {self.budget_bytes} B is "
            f"infeasible at {len(self.infeasible_ops)} op(s) whose own live activations do "
            f"not fit ({ops}). The step runs correctly at the best feasible peak, "
            f"{self.predicted_peak_after} B. Fix: raise max_resident_activation_mb (or the "
            "fraction), or split the region (e.g. hyper_offload.skip_offload)"
        )


def log_region_report(report: RegionReport) -> None:
    LOGGER.info("%s", report)
    if not report.feasible:
        LOGGER.warning("%s", report.infeasible_message(), extra={UNDER_FLOOR: True})
    if report.binding == "host":
        LOGGER.warning(
            "hyper_offload region %d: the host budget of %d B (OffloadConfig."
            "max_host_activation_mb, per rank, in pool buckets) cannot take what the device "
            "budget of %d B would move: the plan holds %d B on the host and peaks at %d B "
            "on the device (exact). Fix: recompute='auto' (the default) recomputes what "
            "neither budget holds; or raise max_host_activation_mb or the device budget",
            report.region, report.host_budget_bytes or 0, report.budget_bytes,
            report.peak_host_bytes, report.predicted_peak_after)


_MIB = 1 << 20

NOT_BIT_EXACT = (
    "NOT bit-exact: splitting sums over tokens (weight gradients, a loss mean) into tiles "
    "reassociates them; hyper_offload.check measures the deviation"
)
"""Said by every report of a tiled plan."""


@dataclass(frozen=True)
class TiledSpanReport:
    """Token-wise ops tiled together: the first and last op of one of them, what they
    are, in how many tiles, and how many identical spans (one per layer) got the same."""

    first: str
    last: str
    ops: str
    tiles: int
    copies: int = 1

    def __str__(self) -> str:
        copies = f" (x{self.copies} identical)" if self.copies > 1 else ""
        return f"{self.first}..{self.last} [{self.ops}] in {self.tiles} tiles{copies}"


@dataclass(frozen=True)
class TilingReport:
    """One region's tiling choice. Figures are *predicted*: ``floor_*`` the most any op
    of the region needs with everything movable moved (the region's floor), before and
    after; ``compute_*`` every op of both graphs at the roofline prices, the tiles'
    recomputation included (after - before is its price); ``probes``: compiles of the
    region's graphs (no code) the choice made; ``stopped``: why it chose what it did."""

    mode: str
    seq_len: int | None
    spans: tuple[TiledSpanReport, ...]
    floor_before_bytes: int
    floor_after_bytes: int
    floor_op_before: str
    floor_op_after: str
    compute_before_s: float
    compute_after_s: float
    probes: int
    seconds: float
    stopped: str

    @property
    def tiled(self) -> bool:
        return bool(self.spans)

    def summary(self) -> dict[str, object]:
        data = asdict(self)
        data["spans"] = [asdict(span) for span in self.spans]
        data["tiled"] = self.tiled
        data["exact"] = not self.tiled
        return data

    def __str__(self) -> str:
        head = f"tile_sequence={self.mode}"
        if not self.tiled:
            return f"{head}: not tiled ({self.stopped}); exact"
        spans = "; ".join(map(str, self.spans))
        return (
            f"{head}: TILED {spans}; {NOT_BIT_EXACT}. Predicted floor "
            f"{self.floor_before_bytes / _MIB:,.2f} -> {self.floor_after_bytes / _MIB:,.2f} MiB "
            f"(set by {self.floor_op_after}), compute {self.compute_before_s * 1e3:.3f} -> "
            f"{self.compute_after_s * 1e3:.3f} ms (the tiles' recompute); {self.stopped}; "
            f"{self.probes} probe(s) in {self.seconds:.1f} s"
        )
