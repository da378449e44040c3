"""What sequence tiling did to one compiled region (``tile_sequence``, :mod:`.tiling`), and
what it chose from.

A leaf module (imports nothing of the package): the region keeps both records, the
region report, the step report and ``hyper_offload.check`` print the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from torch import fx

__all__ = ["NOT_BIT_EXACT", "TiledSpanReport", "TilingReport", "TilingSource"]

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


class TilingSource(NamedTuple):
    """A region's untiled Dynamo graph, its example inputs as Dynamo's fake values
    (never the real ones: an activation holds its whole autograd graph), the inputs that
    carry tokens (``{placeholder: token dim}``; None: the analysis' default) and the
    inputs that are activations (AOTAutograd's names), kept so that the step can choose
    again (:meth:`.step.lowerings.RegionLowerings.retile`)."""

    graph: fx.GraphModule
    inputs: list[Any]
    seeds: dict[str, int | None] | None
    moving: frozenset[str]
