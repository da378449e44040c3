"""What :func:`hyper_offload.check` found: :class:`CheckReport` and its parts."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["CheckReport", "Deviation", "Mismatch", "SavedTensor", "TilingDeviation", "Verdict"]


class Verdict(str, Enum):
    PASS = "PASS"
    """Loss and every gradient equal (``torch.equal``) at every step, with tensors moved."""
    FAIL = "FAIL"
    """A loss or gradient differs (:attr:`CheckReport.mismatch` names the first), or the
    run with the library raised (:attr:`CheckReport.error`)."""
    NOTHING_MOVED = "NOTHING MOVED"
    """Equal, but nothing left the device: the run proves nothing about offloading."""
    NOT_DETERMINISTIC = "NOT DETERMINISTIC"
    """Two runs *without* the library differ: no comparison can judge the library."""

    def __repr__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Mismatch:
    """The first value that differs: at ``step`` (1-based), ``what`` ("loss" or a
    parameter's name), by ``max_abs_diff`` (``inf`` for a NaN or a shape change)."""

    step: int
    what: str
    max_abs_diff: float

    def __str__(self) -> str:
        return f"step {self.step}, {self.what}: max abs diff {self.max_abs_diff:.6g}"


@dataclass(frozen=True)
class SavedTensor:
    """A saved activation the bisection found responsible: in compiled region
    ``region``, the saved node ``name`` (as the region's report names it), with what
    the backward observes of it (dtype, sizes, strides, bits)."""

    region: int
    name: str
    description: str

    def __str__(self) -> str:
        return f"region {self.region}, saved {self.name} ({self.description})"


@dataclass(frozen=True)
class Deviation:
    """How far one value (``what``: "loss" or "gradient of NAME") of a tiled run is from
    plain training's, the largest over the steps: ``max_abs`` the largest absolute
    difference of an element, ``max_rel`` that over the largest magnitude of the plain
    value (0 when both are all zeros; ``inf`` for a NaN or a shape change)."""

    what: str
    max_abs: float
    max_rel: float


@dataclass(frozen=True)
class TilingDeviation:
    """What :func:`hyper_offload.check` measured of sequence tiling (``tile_sequence``):
    what each region tiled (``tiled``, empty: nothing was, and the run is the exact one),
    the deviation of the loss and of every gradient, and what the tiled run raised."""

    mode: str
    tiled: tuple[str, ...]
    values: tuple[Deviation, ...]
    error: str = ""

    def __str__(self) -> str:
        head = f"  sequence tiling (tile_sequence={self.mode!r}): "
        if self.error:
            return head + f"the tiled run raised {self.error}"
        if not self.tiled:
            return head + "nothing was tiled (no token-wise op sets a floor); exact as above"
        width = max(len(v.what) for v in self.values)
        lines = [head + "NOT bit-exact by design (sums over tokens are reassociated); "
                 "deviation from plain training, the largest over the steps:"]
        lines += [f"    {line}" for line in self.tiled]
        lines.append(f"    {'value':<{width}}  {'max abs':>10}  {'max rel':>10}")
        lines += [f"    {v.what:<{width}}  {v.max_abs:>10.3g}  {v.max_rel:>10.3g}"
                  for v in self.values]
        return "\n".join(lines)


@dataclass(frozen=True)
class CheckReport:
    """The verdict of :func:`hyper_offload.check` on one model, door and step count.

    ``moved_storages`` / ``moved_bytes``: storages of saved activations (and their
    bytes, one step's D2H) the checked run moved. ``responsible``: the smallest set of moved tensors the
    bisection found that still reproduces ``mismatch`` (empty when it passed, when the
    door cannot bisect, or when no subset alone reproduced it). ``error``: what the run
    with the library raised, if it did. ``runs``: training runs the check made, the
    bisection's included."""

    door: str
    verdict: Verdict
    steps: int
    moved_storages: int
    moved_bytes: int
    mismatch: Mismatch | None = None
    responsible: tuple[SavedTensor, ...] = ()
    runs: int = 0
    note: str = ""
    error: str = ""
    tiling: TilingDeviation | None = None
    """With ``tile_sequence``: the tiled run's deviation from plain training."""

    @property
    def passed(self) -> bool:
        return self.verdict is Verdict.PASS

    def __str__(self) -> str:
        head = (f"hyper_offload.check ({self.door} door, {self.steps} steps, "
                f"{self.moved_storages} storage(s) / {self.moved_bytes} B moved per step): "
                f"{self.verdict.value}")
        lines = [head]
        if self.mismatch is not None:
            lines.append(f"  first mismatch: {self.mismatch}")
        if self.error:
            lines.append(f"  the run with the library raised: {self.error}")
        if self.responsible:
            lines.append("  responsible (moving only these reproduces it):")
            lines.extend(f"    {saved}" for saved in self.responsible)
        if self.note:
            lines.append(f"  {self.note}")
        if self.tiling is not None:
            lines.append(str(self.tiling))
        return "\n".join(lines)
