"""Training runs of a user's model, with and without the library, that :mod:`.check`
compares, and what the comparison finds (:class:`CheckReport` and its parts).

A *run* trains a fresh deep copy of the model for a few steps from one seed: zero the
gradients, forward, a scalar loss, backward, record the loss and every parameter's
gradient, then an SGD step (so later steps run on other weights, as training does). Every
run of one check starts from the same weights, inputs and RNG state, so two runs differ
only in what the door under test does.

Doors (:class:`Door`): ``plain_compile`` (``torch.compile`` with the inner compiler alone),
``offload_compile`` (``backend=hyper_offload`` at budget 0, optionally moving only some
saved tensors), ``plain_eager`` and ``offload_eager`` (an ``OffloadSession`` at budget 0
around each step).

**How far sequence tiling moves training from plain training** (:func:`measure_tiling`).
Sequence tiling (``tile_sequence``, :mod:`hyper_offload.compiler.tiling`) is the one
option that is not bit-exact: each tile's forward is the untiled rows of token-wise
ops, but sums over tokens (weight gradients, a loss mean, an embedding's gradient) are
added tile by tile, in another order. So :func:`~.check.check` does not judge it with
``torch.equal``; it trains once more with tiling (everything movable moved, as the
exact run) and reports, for the loss and every gradient, the largest absolute and
relative difference from the plain run over the steps.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hyper_offload.config import OffloadConfig
from hyper_offload.errors import CheckUsageError

__all__ = [
    "CheckReport", "Deviation", "Door", "Mismatch", "Problem", "RunResult", "SavedTensor",
    "StepValues", "TilingDeviation", "Verdict", "deviations", "first_mismatch",
    "measure_tiling", "train",
]


# ---------------------------------------------------------------- what a check finds

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


# ---------------------------------------------------------------- the runs

class StepValues(NamedTuple):
    """What one step computed: its loss and each parameter's gradient, by name."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Problem:
    """What every run of one check trains: the pristine ``model`` (never trained
    itself), its ``inputs``, the ``loss`` of an output, and how many ``steps``."""

    model: nn.Module
    inputs: tuple[Any, ...]
    loss: Callable[[Any], torch.Tensor]
    steps: int
    seed: int = 0


@dataclass
class RunResult:
    """The steps of one run, and the door's state after it (reports, stats)."""

    steps: list[StepValues]
    state: Any = None


@dataclass
class Door:
    """How one run executes a step: ``wrap(model)`` gives the callable that runs the
    model (a compiled one, or the model), ``step()`` a context around each step's
    forward and backward, ``state`` what the run leaves to inspect."""

    name: str
    wrap: Callable[[nn.Module], Callable[..., Any]]
    step: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    state: Any = None
    resets_dynamo: bool = field(default=False)


def train(problem: Problem, door: Door) -> RunResult:
    """Train a fresh copy of ``problem.model`` through ``door`` (module docstring)."""
    if door.resets_dynamo:
        # Two copies of one module class share compiled code; each run compiles anew.
        torch._dynamo.reset()
    model = copy.deepcopy(problem.model)
    run = door.wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    steps = []
    with _seeded(problem.seed):
        for _ in range(problem.steps):
            optimizer.zero_grad(set_to_none=True)
            with door.step():
                loss = problem.loss(run(*problem.inputs))
                loss.backward()
            grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()
                     if p.grad is not None}
            steps.append(StepValues(loss.detach().clone(), grads))
            optimizer.step()
    return RunResult(steps, door.state)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Every run draws the same random numbers (dropout), and the caller's RNG state is
    what it was."""
    with torch.random.fork_rng(devices=_accelerators()):
        torch.manual_seed(seed)
        yield


def _accelerators() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def first_mismatch(want: Sequence[StepValues], got: Sequence[StepValues]) -> Mismatch | None:
    """The first value of ``got`` that is not ``torch.equal`` to ``want``'s (step order,
    then the loss, then parameters in the model's order), or None."""
    for step, (a, b) in enumerate(zip(want, got), 1):
        pairs = [("loss", a.loss, b.loss)]
        pairs += [(f"gradient of {name}", grad, b.grads.get(name)) for name, grad in a.grads.items()]
        missing = sorted(set(b.grads) - set(a.grads))
        pairs += [(f"gradient of {name}", None, b.grads[name]) for name in missing]
        for what, x, y in pairs:
            if x is None or y is None or not torch.equal(x, y):
                return Mismatch(step, what, _max_abs_diff(x, y))
    return None


def _max_abs_diff(x: torch.Tensor | None, y: torch.Tensor | None) -> float:
    if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
        return float("inf")
    if x.is_complex():
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    diff = (x.double() - y.double()).abs()
    return float("inf") if diff.isnan().any() else float(diff.max()) if diff.numel() else 0.0


def weighted_sum_loss(output: Any) -> torch.Tensor:
    """A scalar loss that sees every element of every floating (or complex) tensor of
    ``output`` through fixed pseudo-random weights, so a gradient error anywhere shows
    (a plain sum sends the same gradient to every element, which hides permutations)."""
    leaves = [leaf for leaf in tree_flatten(output)[0]
              if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())
              and leaf.requires_grad]
    if not leaves:
        raise CheckUsageError(
            "hyper_offload.check: the model's output holds no tensor that requires grad, so "
            "there is nothing to differentiate. Fix: pass loss_fn=... that turns the output "
            "into a scalar loss"
        )
    generator = torch.Generator().manual_seed(1234)
    total = torch.zeros((), device=leaves[0].device)
    for leaf in leaves:
        values = torch.view_as_real(leaf) if leaf.is_complex() else leaf
        weights = torch.rand(values.shape, generator=generator, dtype=torch.float64)
        total = total + (values.double() * weights.to(values.device)).sum().to(total.dtype)
    return total


def plain_compile(inner_compiler: str) -> Door:
    return Door(f"torch.compile(backend={inner_compiler!r})",
                lambda model: torch.compile(model, backend=inner_compiler), resets_dynamo=True)


def offload_compile(inner_compiler: str, options: dict[str, Any],
                    move_only: frozenset[tuple[int, str]] | None = None) -> Door:
    """``backend=hyper_offload`` with everything movable moved (budget 0, the caller's
    other ``options`` kept), or only ``move_only``."""
    from hyper_offload.compiler.registry import backend as offload_backend

    settings = {**options, "inner_compiler": inner_compiler, "max_resident_activation_mb": 0}
    if move_only is not None:
        settings["move_only"] = move_only
    backend = offload_backend(**settings)
    return Door("hyper_offload compile door",
                lambda model: torch.compile(model, backend=backend),
                state=backend, resets_dynamo=True)


def plain_eager() -> Door:
    return Door("eager", lambda model: model)


def offload_eager(config: dict[str, Any]) -> Door:
    """An ``OffloadSession`` at budget 0 (the caller's other ``OffloadConfig`` fields
    kept) around each step."""
    from hyper_offload.eager.session import OffloadSession

    session = OffloadSession(OffloadConfig(**{**config, "max_resident_activation_mb": 0}))
    return Door("hyper_offload eager door", lambda model: model, lambda: session, session)


def measure_tiling(
    problem: Problem, want: RunResult, inner_compiler: str, options: dict[str, Any]
) -> TilingDeviation:
    """Train ``problem`` through the compile door with ``options`` (their
    ``tile_sequence``) and compare with the plain run ``want`` (module docstring)."""
    mode = str(options["tile_sequence"])
    door = offload_compile(inner_compiler, options)
    try:
        got = train(problem, door)
    except Exception as error:  # reported, never swallowed: it is the check's finding
        return TilingDeviation(mode, (), (), error=f"{type(error).__name__}: {error}")
    tiled = tuple(
        f"region {region.index}: {region.tiling}" for region in door.state.regions
        if region.tiling is not None and region.tiling.tiled
    )
    return TilingDeviation(mode, tiled, deviations(want.steps, got.steps))


def deviations(want: Sequence[StepValues], got: Sequence[StepValues]) -> tuple[Deviation, ...]:
    """The loss's and each gradient's deviation of ``got`` from ``want``, the largest
    over the steps, in the model's parameter order."""
    worst: dict[str, tuple[float, float]] = {}
    for a, b in zip(want, got):
        pairs = [("loss", a.loss, b.loss)]
        pairs += [(f"gradient of {name}", grad, b.grads.get(name)) for name, grad in a.grads.items()]
        for what, x, y in pairs:
            found = _deviation(x, y)
            old = worst.get(what, (0.0, 0.0))
            worst[what] = (max(old[0], found[0]), max(old[1], found[1]))
    return tuple(Deviation(what, *found) for what, found in worst.items())


def _deviation(x: torch.Tensor, y: torch.Tensor | None) -> tuple[float, float]:
    """(max abs difference, that over max |x|) of two values of one step."""
    if y is None or x.shape != y.shape:
        return float("inf"), float("inf")
    if x.is_complex():
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    x, y = x.double(), y.double()
    if not x.numel():
        return 0.0, 0.0
    diff = float((x - y).abs().max())
    if diff != diff:  # NaN
        return float("inf"), float("inf")
    scale = float(x.abs().max())
    return diff, (diff / scale if scale else (0.0 if diff == 0 else float("inf")))
