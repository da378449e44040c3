"""``PipelineSwapSchedule``, a torch-style pipeline schedule that runs our finalized orders,
and the wrappers that choose which activations it swaps (``swap_wrapper``,
``swap_tensor_wrapper``).

It is a ``torch.distributed.pipelining.schedules.PipelineScheduleMulti`` (so ``step(*args,
target=..., losses=...)``, micro-batch splitting, loss handling and stage initialisation
are torch's own) whose step executes the rank-local order built by
:func:`~hyper_offload.passes.pipeline.build_rank_orders` — compute order → [overlap]
→ [dx/dw split] → P2P → [FSDP] → transport → [swap] — with
:class:`~.step_runner.StepRun`, which gets a frozen :class:`~.step_runner.StepContext` built
here for each step, never the schedule itself. ``PipelineStage`` does the stage compute and
builds the P2P ops; FSDP2 (``fully_shard``) modules are unsharded, resharded and reduced by the
order's FSDP steps.

``swap=True`` only injects the four swap steps and creates a
:class:`~hyper_offload.runtime.pipeline.session.PipelineSwapSession`; which activations
move is decided by
``swap_wrapper`` / ``swap_tensor_wrapper`` in the model. Without any wrapper, ``swap=True``
changes nothing but bookkeeping.

Unsupported combinations raise at construction, naming the fix:

* ``swap=True`` without ``loss_fn`` (forward only: nothing consumes the activations);
* FSDP2 stages with ``reshard_after_forward=True`` on orders that split backward into
  dx/dw (torch 2.13 computes wrong weight gradients there, even without swap);
* ``real_overlap=True`` with FSDP2 stages (FSDP's hooks are not thread-safe).

**Choosing activations.** Selection and timing are separate. The wrappers say *which*
activations of a stage may be swapped; a ``PipelineSwapSchedule(..., swap=True)`` decides
*when* (its four swap steps). ``swap=True`` never wraps a model or picks tensors by
itself, and the wrappers do nothing outside such a schedule's FWD leaves of eligible
chunks.

* ``swap_wrapper(module_or_callable, policy_fn=None, group_swap=False)``: the tensors that
  autograd saves while the wrapped forward runs join the current chunk's swap group
  (``torch.autograd.graph.saved_tensors_hooks``), filtered by ``policy_fn(tensor) -> bool``.
  Parameters (also FSDP-unsharded ones, by storage), the stage's inputs, its output and
  the loss never join; tensors sharing a storage join once.
* ``swap_tensor_wrapper(tensor_or_nested, tag=None, group_swap=False)``: registers the
  tensors of a nested structure with the current group and returns the input unchanged.
  Outside any pipeline FWD it warns (once per call site) and does nothing.

``group_swap=True`` (the design's "group / bulk copy"): the tensors it selects move in
their chunk's one packed host buffer, with a single copy each way for all of them
(:class:`~hyper_offload.runtime.pipeline.packed_copy.PackedCopy`), instead of one copy
per storage. The cost is a device staging buffer of the packed size while each copy is
issued (the members and the pack coexist for that moment); the gain is one large copy
instead of many small ones, which matters when a chunk saves many small tensors.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Callable, TypeVar

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import PipelineScheduleMulti
from torch.utils._pytree import tree_leaves

from hyper_offload.errors import (
    ConfigurationTypeError, SwapOutsideGroupWarning, UnsupportedScheduleError,
)
from hyper_offload.passes.pipeline import (
    ActivationSizes,
    StageFootprints,
    SwapCostModel,
    SwapCostReport,
    assert_valid_order,
    build_rank_orders,
    layout_for,
    plan_rank_swaps,
)
from hyper_offload.passes.pipeline.meta_step import MetaStep, StepKind
from hyper_offload.passes.pipeline.execution import SendReleases, send_releases
from hyper_offload.passes.pipeline.swap import MIN_SWAP_GAP

from hyper_offload.runtime.pinned_pool import PinnedMemoryPool
from hyper_offload.runtime.pipeline.session import (
    PipelineSwapSession,
    current_group,
    group_scope,
    in_pipeline_forward,
    saved_tensor_hooks,
    swap_step_scope,
)
from hyper_offload.runtime.pipeline.p2p import SentTensor
from .step_runner import StepContext, StepObserver, StepRun

__all__ = [
    "PipelineSwapSchedule", "SwapOutsideGroupWarning", "SwapWrapped", "UnsupportedScheduleError",
    "swap_tensor_wrapper", "swap_wrapper",
]

T = TypeVar("T")
Policy = Callable[[torch.Tensor], bool]


class PipelineSwapSchedule(PipelineScheduleMulti):
    """Runs one rank's finalized order (see the module docstring).

    ``stages`` are this rank's ``PipelineStage`` objects (one for GPipe / 1F1B, several for
    the interleaved schedules, two for the V-shaped ones). ``swap_only`` maps rank →
    chunks to swap (a cost model's choice, e.g. ``plan_rank_swaps(...)[r].chosen``);
    ranks absent from it swap every eligible chunk. ``unsharded_load`` is the swap pass's
    load placement for FSDP stages that stay unsharded (``"cover"``: hidden like a stage
    without FSDP; ``"delay"``: the design document's rule). ``swap_cost`` with
    ``activation_sizes`` turns on the cost-aware eligibility: every rank's chunks are
    chosen by :func:`~hyper_offload.passes.pipeline.plan_rank_swaps` (the decision for this
    rank is kept in ``swap_report``). ``timeout`` (seconds or a ``timedelta``) bounds
    every P2P wait. ``weight_swap`` (default on) also swaps each chunk's dW state across
    its BWD_INPUT → BWD_WEIGHT gap in orders that split dx/dw (zero-bubble schedules),
    under the same gap rule (and, with ``swap_cost``, the same cost-aware choice).
    ``release_sends`` (default on) waits each send as soon as the ranks' orders prove its
    receiver has it, which frees the sent tensor there instead of at the end of the step.
    ``verify`` (``True`` or ``"first_steps:N"``) checks every swapped byte
    (:mod:`~hyper_offload.runtime.verify`); a race raises ``TransferIntegrityError``.
    """

    def __init__(
        self,
        stages: Sequence[Any],
        n_microbatches: int,
        *,
        schedule: str,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        swap: bool = False,
        transport: str = "plain",
        min_gap: int = MIN_SWAP_GAP,
        dxdw_split: bool = False,
        overlap: bool = False,
        real_overlap: bool = False,
        swap_only: Mapping[int, Collection[tuple[int, int]]] | None = None,
        unsharded_load: str = "cover",
        swap_cost: SwapCostModel | None = None,
        activation_sizes: ActivationSizes | StageFootprints | None = None,
        target_peak_bytes: int | None = None,
        weight_swap: bool = True,
        release_sends: bool = True,
        scale_grads: bool = True,
        timeout: timedelta | float | None = None,
        pool: PinnedMemoryPool | None = None, verify: bool | str = False,
    ) -> None:
        stages = list(stages)
        if not stages:
            raise UnsupportedScheduleError("PipelineSwapSchedule needs at least one stage on this rank")
        super().__init__(stages, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        if swap and loss_fn is None:
            raise UnsupportedScheduleError(
                "swap=True without loss_fn: a forward-only schedule has no backward to consume "
                "swapped activations. Pass loss_fn, or drop swap=True"
            )
        self.schedule_name = schedule
        self.layout = layout_for(schedule, num_ranks=self.pp_group_size, stages_per_rank=len(stages))
        self._bind_stages(stages)
        order_options = dict(
            num_ranks=self.pp_group_size, stages_per_rank=len(stages),
            num_microbatches=n_microbatches, transport=transport, dxdw_split=dxdw_split,
            overlap=overlap, fsdp=any(isinstance(stage.submod, FSDPModule) for stage in stages),
        )
        self.swap_report: SwapCostReport | None = None
        """This rank's cost-aware swap decision (``swap_cost``), else ``None``."""
        weight_swap_only = None
        if swap and swap_cost is not None:
            swap_only, weight_swap_only = self._cost_aware_choice(
                schedule, order_options, swap_only, swap_cost, activation_sizes, min_gap=min_gap,
                target_peak_bytes=target_peak_bytes, weight_swap=weight_swap,
                release_sends=release_sends,
            )
        orders = build_rank_orders(
            schedule, **order_options, swap=swap, min_gap=min_gap, swap_only=swap_only,
            unsharded_load=unsharded_load, weight_swap=weight_swap,
            weight_swap_only=weight_swap_only,
        )
        self.order: list[MetaStep] = orders[self.rank]
        self.send_releases: SendReleases | None = (
            send_releases(orders)[self.rank] if release_sends else None
        )
        """After which receive each of this rank's sends is proven received and waited
        (:func:`~hyper_offload.passes.pipeline.execution.send_releases`); ``None`` with
        ``release_sends=False``: every send is waited at the end of the step."""
        self.last_sends: Mapping[tuple[StepKind, int, int], SentTensor] = MappingProxyType({})
        """The last step's send leaves: bytes sent and where each was released."""
        self._check_fsdp(stages, real_overlap)
        if swap:
            # The executor trusts the anchors; prove them before the first step.
            assert_valid_order(
                self.order, rank=self.rank, min_gap=min_gap, swapped=_chosen(swap_only, self.rank),
                unsharded_load=unsharded_load,
                weight_swapped=_chosen(weight_swap_only, self.rank) if weight_swap else (),
            )
        self.swap = swap
        device = stages[0].device
        self.session = PipelineSwapSession(self.order, device=device, pool=pool, verify=verify) if swap else None
        self.timeout = timeout if timeout is None or isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        self.real_overlap = real_overlap
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="pp-overlap") if real_overlap else None
        self.observer: StepObserver | None = None
        """Optional callbacks around each top-level step (memory sampling)."""

    def _cost_aware_choice(
        self,
        schedule: str,
        order_options: Mapping[str, Any],
        swap_only: Mapping[int, Collection[tuple[int, int]]] | None,
        swap_cost: SwapCostModel,
        activation_sizes: ActivationSizes | StageFootprints | None,
        **plan_options: Any,
    ) -> tuple[dict[int, Collection[tuple[int, int]]], dict[int, Collection[tuple[int, int]]]]:
        """``(swap_only, weight_swap_only)`` per rank, as :func:`plan_rank_swaps` chooses on
        every rank's order without swap (all ranks compute the same choice); keeps this
        rank's report in ``swap_report``. ``plan_options``: ``min_gap``,
        ``target_peak_bytes``, ``weight_swap``, ``release_sends``."""
        if activation_sizes is None or swap_only is not None:
            raise UnsupportedScheduleError(
                "swap_cost needs activation_sizes (bytes per chunk) and excludes swap_only "
                "(it computes the chosen chunks itself)"
            )
        plain = build_rank_orders(schedule, **order_options)
        reports = plan_rank_swaps(plain, sizes=activation_sizes, cost=swap_cost, **plan_options)
        self.swap_report = reports[self.rank]
        return (
            {rank: report.chosen for rank, report in reports.items()},
            {rank: report.chosen_weight for rank, report in reports.items()},
        )

    # ------------------------------------------------------------------ checks

    def _bind_stages(self, stages: list[Any]) -> None:
        """Check ``stages`` are this rank's, and tell each where every stage runs."""
        self._check_stages(stages)
        num_stages = self.layout.num_stages
        self.stage_index_to_group_rank = {s: self.layout.rank_of(s) for s in range(num_stages)}
        for stage in stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
        self.stage_by_index = {stage.stage_index: stage for stage in stages}

    def _check_stages(self, stages: list[Any]) -> None:
        expected = self.layout.stages_of(self.rank)
        got = tuple(sorted(stage.stage_index for stage in stages))
        if got != expected:
            raise UnsupportedScheduleError(
                f"rank {self.rank}: schedule {self.schedule_name!r} places stages {list(expected)} on this "
                f"rank ({self.layout.style.value} layout over {self.pp_group_size} ranks), got stages "
                f"{list(got)}; build the PipelineStage objects for exactly those stage indices"
            )
        for stage in stages:
            if stage.num_stages != self.layout.num_stages:
                raise UnsupportedScheduleError(
                    f"stage {stage.stage_index} was built with num_stages={stage.num_stages}, but "
                    f"{self.pp_group_size} ranks x {len(stages)} stages per rank = {self.layout.num_stages}"
                )

    def _check_fsdp(self, stages: list[Any], real_overlap: bool) -> None:
        fsdp_stages = [s.stage_index for s in stages if isinstance(s.submod, FSDPModule)]
        if not fsdp_stages:
            return
        if real_overlap:
            raise UnsupportedScheduleError(
                f"real_overlap=True with FSDP2 stages {fsdp_stages}: FSDP's forward/backward hooks "
                "are not thread-safe. Use real_overlap=False (OVERLAP composites then run in order)"
            )
        splits = any(leaf.kind is StepKind.BWD_INPUT for step in self.order for leaf in step.leaves())
        if not splits:
            return
        for stage in stages:
            for module in stage.submod.modules():
                if isinstance(module, FSDPModule) and reshards_after_forward(module):
                    raise UnsupportedScheduleError(
                        f"stage {stage.stage_index}: an FSDP2 module with reshard_after_forward=True "
                        f"in an order that splits backward into dx/dw ({self.schedule_name}); torch "
                        "2.13 computes wrong weight gradients there even without swap. Apply "
                        "fully_shard(..., reshard_after_forward=False)"
                    )

    # ------------------------------------------------------------------ execution

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """torch's ``step()``, marked as swapping for whoever watches the ops (from the
        input split on: an ``OffloadSession`` refuses before any communication)."""
        with swap_step_scope(self.swap):
            return super().step(*args, **kwargs)

    def _initialize_stages(self, args: tuple[Any, ...], kwargs: Any, target: Any = None, loss_kwargs: Any = None) -> None:
        # Stage initialisation runs real forwards (shape inference) outside any step: mark
        # them as pipeline forwards without a swap window so wrappers stay silent.
        with group_scope(None):
            super()._initialize_stages(args, kwargs, target, loss_kwargs)

    def _step_microbatches(
        self,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        losses: list | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not self._has_backward:
            raise UnsupportedScheduleError(
                "PipelineSwapSchedule runs training steps (forward and backward); forward-only "
                "evaluation is not supported: use torch's own schedules for eval()"
            )
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        self._initialize_stages(arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
        run = StepRun(self._step_context(), arg_mbs, kwarg_mbs, target_mbs, return_outputs, loss_kwargs)
        if self.session is not None:
            self.session.begin()
        try:
            run.run()
            if self.session is not None:
                self.session.end()
            self.last_sends = MappingProxyType(dict(run.p2p.sent))
        except BaseException as exc:
            run.abort()
            if self.session is not None:
                for error in self.session.abort():
                    exc.add_note(f"cleanup after the failure also raised: {error!r}")
            self._internal_losses.clear()
            raise
        self._update_losses(self._stages, losses)

    def _step_context(self) -> StepContext:
        """What :class:`StepRun` needs for one step, as data (no reference to ``self``).

        Built per step, so ``observer`` and ``order`` as they are at ``step()`` time apply.
        ``losses`` is torch's ``_internal_losses`` list itself: ``_update_losses`` reads it.
        """
        if self._loss_fn is None:  # pragma: no cover - _step_microbatches refuses it first
            raise UnsupportedScheduleError("a step needs loss_fn (forward-only runs are refused)")
        return StepContext(
            rank=self.rank,
            num_stages=self.layout.num_stages,
            n_microbatches=self._n_microbatches,
            stages=MappingProxyType(dict(self.stage_by_index)),
            order=tuple(self.order),
            loss_fn=self._loss_fn,
            losses=self._internal_losses,
            scale_grads=self.scale_grads,
            session=self.session,
            timeout=self.timeout,
            observer=self.observer,
            worker=self._worker,
            send_releases=self.send_releases,
        )

    def close(self) -> None:
        """Stop the overlap worker thread (if any)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def _chosen(
    per_rank: Mapping[int, Collection[tuple[int, int]]] | None, rank: int
) -> Collection[tuple[int, int]] | None:
    """What ``build_rank_orders`` swapped on ``rank`` from a per-rank choice: the rank's
    chunks, or every eligible one (``None``) where the choice does not name the rank."""
    return None if per_rank is None or rank not in per_rank else per_rank[rank]


def reshards_after_forward(module: FSDPModule) -> bool:
    """Whether an FSDP2 module frees its unsharded parameters after forward.

    FSDP2 keeps the mesh to reshard to after forward on each parameter group
    (``post_forward_mesh_info``): ``None`` means the parameters stay unsharded.
    """
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    group = getattr(state, "_fsdp_param_group", None)
    return group is not None and group.post_forward_mesh_info is not None


# ---------------------------------------------------------------- choosing activations

def swap_wrapper(
    module_or_callable: T, policy_fn: Policy | None = None, group_swap: bool = False
) -> T:
    """Make the saved activations of ``module_or_callable``'s forward swappable.

    A module is wrapped in place, the way ``fully_shard`` does it: its class becomes a
    subclass whose ``forward`` runs the original one under the collecting hooks. The
    module keeps its parameters and names (``layers[i] = swap_wrapper(layers[i])``), and a
    ``copy.deepcopy`` of it stays wrapped and runs *its own* parameters. A plain callable
    is returned wrapped. ``policy_fn(tensor)`` returning False keeps that tensor on the
    device.
    """
    _check_flag("swap_wrapper", "group_swap", group_swap)
    if policy_fn is not None and not callable(policy_fn):
        raise ConfigurationTypeError(f"swap_wrapper: policy_fn must be callable (tensor -> bool) or None, got {policy_fn!r}")
    if isinstance(module_or_callable, torch.nn.Module):
        module = module_or_callable
        if not isinstance(module, SwapWrapped):
            cls = type(module)
            module.__class__ = type(f"Swap{cls.__name__}", (SwapWrapped, cls), {})
        module._swap_policy_fn = policy_fn  # type: ignore[attr-defined]
        module._swap_group_swap = group_swap  # type: ignore[attr-defined]
        return module  # type: ignore[return-value]
    if not callable(module_or_callable):
        raise ConfigurationTypeError(
            f"swap_wrapper: expected an nn.Module or a callable, got {type(module_or_callable).__name__}"
        )
    fn = module_or_callable

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return _run_collecting(policy_fn, group_swap, fn, *args, **kwargs)

    return wrapped  # type: ignore[return-value]


class SwapWrapped:
    """Mixin put in front of a wrapped module's class by :func:`swap_wrapper`."""

    _swap_policy_fn: Policy | None = None
    _swap_group_swap: bool = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _run_collecting(
            self._swap_policy_fn, self._swap_group_swap, super().forward, *args, **kwargs  # type: ignore[misc]
        )


def _run_collecting(
    policy_fn: Policy | None, group_swap: bool, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    if current_group() is None:
        return fn(*args, **kwargs)
    with saved_tensor_hooks(collect=True, policy_fn=policy_fn, packed=group_swap):
        return fn(*args, **kwargs)


def swap_tensor_wrapper(tensor_or_nested: T, tag: str | None = None, group_swap: bool = False) -> T:
    """Register every tensor in ``tensor_or_nested`` with the current swap group; returns
    the input unchanged. Outside a pipeline FWD leaf: warns once per call site."""
    _check_flag("swap_tensor_wrapper", "group_swap", group_swap)
    if tag is not None and not isinstance(tag, str):
        raise ConfigurationTypeError(f"swap_tensor_wrapper: tag must be a str or None, got {tag!r}")
    group = current_group()
    if group is None:
        if not in_pipeline_forward():
            warnings.warn(
                f"swap_tensor_wrapper(tag={tag!r}) called outside a pipeline FWD leaf: nothing is "
                "registered. Call it inside a stage's forward run by PipelineSwapSchedule(swap=True)",
                SwapOutsideGroupWarning,
                stacklevel=2,
            )
        return tensor_or_nested
    for leaf in tree_leaves(tensor_or_nested):
        if isinstance(leaf, torch.Tensor):
            group.add(leaf, tag, packed=group_swap)
    return tensor_or_nested


def _check_flag(where: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigurationTypeError(f"{where}: {name} must be a bool, got {value!r}")
