"""One ``step()`` of a pipeline schedule: the rank's order, top to bottom.

The runner never sees the schedule object: the schedule hands it a frozen
:class:`StepContext` (stages, finalized order, loss function, counts, session, observer,
timeout) built for that step, plus the step's micro-batches. This module imports nothing
of the schedule's, so the dependency runs one way only (schedule → runner).

Each top-level step is dispatched by kind:

* compute leaves (FWD / BWD / BWD_INPUT / BWD_WEIGHT) through :meth:`StepRun.forward_leaf`
  and :meth:`StepRun.backward_leaf` — the only two entry points, used by the main thread
  and by the overlap worker alike. A FWD of an eligible chunk runs inside its swap group
  (:meth:`~hyper_offload.runtime.pipeline.session.PipelineSwapSession.forward_scope`);
  its output and loss are protected right after. A same-rank neighbour stage (V
  schedules) gets its input or output gradient directly, without P2P, as in torch's
  runtime;
* ``OVERLAP_B_F`` / ``OVERLAP_F_B``: leaves in order, or — with ``real_overlap`` — the
  forward leaves on the calling thread and the backward leaves on a worker thread, joined
  before the next step; a worker's exception is re-raised here;
* P2P leaves and ``BATCH_SEND_RECV`` through
  :class:`~hyper_offload.runtime.pipeline.p2p.P2PTracker`, which waits a
  send once the order proves it received (``StepContext.send_releases``);
* ``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD`` on the stage's FSDP2 modules;
* the four swap kinds through the session.

Losses follow torch's ``PipelineScheduleMulti`` bookkeeping: a last-stage FWD appends its
micro-batch's loss to :attr:`StepContext.losses` (the schedule's own list, shared), and a
backward reads it back by micro-batch index.
"""

from __future__ import annotations

import contextvars
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_leaves, tree_map_only

from hyper_offload.errors import ConfigurationError, PipelineStateError
from hyper_offload.passes.pipeline.meta_step import OVERLAP_KINDS, MetaStep, StepKind
from hyper_offload.passes.pipeline.execution import SendReleases

from hyper_offload.runtime.pipeline.p2p import P2PTracker

if TYPE_CHECKING:
    from .session import PipelineSwapSession

__all__ = ["StepContext", "StepObserver", "StepRun"]

_BWD_LEAVES = (StepKind.BWD, StepKind.BWD_INPUT, StepKind.BWD_WEIGHT)


class StepObserver(Protocol):
    """Called around every top-level step (tests and benchmarks sample memory here)."""

    def before_step(self, position: int, step: MetaStep) -> None: ...

    def after_step(self, position: int, step: MetaStep) -> None: ...


@dataclass(frozen=True, kw_only=True)
class StepContext:
    """What one ``step()`` reads from its schedule, as data (built fresh for every step).

    Invariants: it holds no reference to the schedule object; ``stages`` is read-only and
    maps every stage index this rank owns (and only those) to its ``PipelineStage``;
    ``order`` is the rank's finalized order, already validated by the schedule; a context
    exists only for training steps, so ``loss_fn`` is never ``None``. ``losses`` is the one
    mutable field, shared by reference with the schedule: the runner appends exactly one
    loss per last-stage FWD, the schedule reads and clears it after the step.
    """

    rank: int
    """This rank in the pipeline group (error messages name it)."""
    num_stages: int
    """Stages of the whole pipeline, over all ranks (P2P tags depend on it)."""
    n_microbatches: int
    """Micro-batches per step: a stage's last backward is its ``n_microbatches``-th."""
    stages: Mapping[int, Any]
    """Stage index → this rank's ``PipelineStage``."""
    order: tuple[MetaStep, ...]
    """The rank's finalized order, run top to bottom."""
    loss_fn: Callable[..., torch.Tensor]
    """``loss_fn(output, target, **loss_kwargs)`` on the last stage's output."""
    losses: list[torch.Tensor]
    """Per-micro-batch losses in FWD order (the schedule's list, appended to here)."""
    scale_grads: bool
    """Divide gradients by ``n_microbatches`` (at REDUCE_GRAD or at the end of the step)."""
    session: PipelineSwapSession | None
    """The swap session, ``None`` when the order has no swap steps."""
    timeout: timedelta | None
    """Bound on every P2P wait (``None``: the process group's own)."""
    observer: StepObserver | None = None
    """Callbacks around every top-level step."""
    worker: ThreadPoolExecutor | None = None
    """The overlap worker thread (``real_overlap``); ``None`` runs OVERLAP leaves in order."""
    send_releases: SendReleases | None = None
    """After which receive each send is proven received and waited (``None``: every send
    is waited at the end of the step)."""


class StepRun:
    """State of one ``step()``: P2P requests, FSDP handles, backward counters.

    Everything it knows of the schedule comes through ``context`` (see :class:`StepContext`).
    """

    def __init__(
        self,
        context: StepContext,
        arg_mbs: list[Any],
        kwarg_mbs: list[Any],
        target_mbs: list[Any] | None,
        return_outputs: bool,
        loss_kwargs: dict[str, Any] | None,
    ) -> None:
        self.context = context
        self.stages = context.stages
        self.session = context.session
        self.arg_mbs = arg_mbs
        self.kwarg_mbs = kwarg_mbs
        self.target_mbs = target_mbs
        self.return_outputs = return_outputs
        self.loss_kwargs = loss_kwargs
        self.p2p = P2PTracker(self.stages, context.timeout, context.num_stages, context.send_releases)
        self.unshard_handles: dict[int, list[Any]] = {}
        self.unsharded: set[int] = set()
        self.backward_count: Counter[int] = Counter()
        self.reduced: set[int] = set()
        self.kept_outputs: dict[tuple[int, int], int] = {}
        """(last stage, micro) -> index of its output in ``stage.output_chunks``."""

    # ------------------------------------------------------------------ driver

    def run(self) -> None:
        """Run the context's order; then wait for sends and scale gradients not yet reduced."""
        context = self.context
        observer = context.observer
        for position, step in enumerate(context.order):
            if observer is not None:
                observer.before_step(position, step)
            try:
                self._dispatch(step, position, context.worker)
            except Exception as exc:
                exc.add_note(f"rank {context.rank}: while running step {position} ({step!r}) of its order")
                raise
            if observer is not None:
                observer.after_step(position, step)
        self.p2p.wait_sends()
        if self.unshard_handles:
            raise PipelineStateError(
                f"rank {context.rank}: UNSHARD of stages {sorted(self.unshard_handles)} was "
                "never consumed by a compute step; the FSDP pass placed an unused unshard"
            )
        for index, stage in self.stages.items():
            if index not in self.reduced and context.scale_grads:
                stage.scale_grads(context.n_microbatches)

    def abort(self) -> None:
        """Exception path: drop P2P bookkeeping and wait for outstanding unshards."""
        self.p2p.drop()
        for handles in self.unshard_handles.values():
            for handle in handles:
                try:
                    handle.wait()
                except Exception:  # best effort: the original error matters more
                    pass
        self.unshard_handles.clear()

    def _dispatch(self, step: MetaStep, position: int, pool: ThreadPoolExecutor | None) -> None:
        kind = step.kind
        if step.is_swap:
            assert self.session is not None, "swap steps exist only when the schedule has a session"
            self.session.run_swap_step(step)
        elif step.is_p2p:
            self.p2p.run(step, position)
        elif kind is StepKind.FSDP_UNSHARD:
            self._unshard(step.stage)  # type: ignore[arg-type]
        elif kind is StepKind.FSDP_RESHARD:
            self._reshard(step.stage)  # type: ignore[arg-type]
        elif kind is StepKind.REDUCE_GRAD:
            self._reduce_grad(step.stage)  # type: ignore[arg-type]
        elif kind in OVERLAP_KINDS:
            self._overlap(step, pool)
        elif kind is StepKind.FWD:
            self.forward_leaf(step)
        elif kind in _BWD_LEAVES:
            self.backward_leaf(step)
        else:  # pragma: no cover - StepKind is closed
            raise ConfigurationError(f"{step!r}: unknown step kind {kind.name}")

    # ------------------------------------------------------------------ compute leaves

    def forward_leaf(self, leaf: MetaStep) -> None:
        s, m = leaf.stage, leaf.micro
        assert s is not None and m is not None
        stage = self.stages[s]
        self._ensure_unsharded(stage)
        prev_local = s - 1 in self.stages
        if not stage.is_first and not prev_local:
            self._require_received(leaf, StepKind.RECV_F)
        inputs = self._stage_inputs(stage, m)
        scope = (
            self.session.forward_scope(leaf, _protected(stage.submod, inputs))
            if self.session is not None else nullcontext()
        )
        with scope:
            output = stage.forward_one_chunk(
                m, self.arg_mbs[m], self.kwarg_mbs[m], save_forward_output=self.return_outputs
            )
            if stage.is_last and self.return_outputs:
                self.kept_outputs[(s, m)] = len(stage.output_chunks) - 1
            self._maybe_compute_loss(stage, output, m)
        if self.session is not None:
            roots = list(_tensors(output))
            if stage.is_last:
                roots.append(self.context.losses[-1])
            self.session.protect((s, m), roots)
        if s + 1 in self.stages:
            self.stages[s + 1].set_local_fwd_input(output, m)

    def backward_leaf(self, leaf: MetaStep) -> None:
        s, m = leaf.stage, leaf.micro
        assert s is not None and m is not None
        stage = self.stages[s]
        self._ensure_unsharded(stage)
        next_local = s + 1 in self.stages
        if leaf.kind is StepKind.BWD_WEIGHT:
            self.backward_count[s] += 1
            stage.backward_weight_one_chunk(m, last_backward=self._is_last_backward(s))
        else:
            if not stage.is_last and not next_local:
                self._require_received(leaf, StepKind.RECV_B)
            loss = self._maybe_get_loss(stage, m)
            full = leaf.kind is StepKind.BWD
            if full:
                self.backward_count[s] += 1
            stage.backward_one_chunk(
                m, loss=loss, full_backward=full, last_backward=full and self._is_last_backward(s)
            )
            self._detach_kept_output(stage, s, m)
            if s - 1 in self.stages:
                self.stages[s - 1].set_local_bwd_input(stage.get_local_bwd_output(m), m)
        if self.session is None:
            return
        if leaf.kind is StepKind.BWD_INPUT and leaf.chunk in self.session.weight_swapped:
            grads, keep = _weight_state(stage, m)
            self.session.after_compute(leaf, grads, [*keep, *_protected(stage.submod, [])])
        else:
            self.session.after_compute(leaf)

    def _detach_kept_output(self, stage: Any, s: int, m: int) -> None:
        """After a last-stage chunk's backward, its output kept for the caller
        (``return_outputs``) no longer needs its autograd graph.

        torch detaches it in place for the same reason, but skips views, which cannot be
        detached in place — and a ``Linear`` on a 3-D input returns one. Its graph then
        keeps every node the backward did not free (under dx/dw split, every node above
        the weight-path intermediates, with their saved tensors) alive until the step
        ends: 1.06 MB per micro-batch on the example GPT's last stage. An out-of-place
        detach in ``output_chunks`` frees them; the values returned are the same."""
        index = self.kept_outputs.pop((s, m), None)
        if index is not None:
            stage.output_chunks[index] = tree_map_only(torch.Tensor, torch.Tensor.detach, stage.output_chunks[index])

    def _overlap(self, step: MetaStep, pool: ThreadPoolExecutor | None) -> None:
        forwards = [leaf for leaf in step.sub_steps if leaf.kind is StepKind.FWD]
        backwards = [leaf for leaf in step.sub_steps if leaf.kind is not StepKind.FWD]
        if pool is None or not forwards or not backwards:
            for leaf in step.sub_steps:
                self._dispatch(leaf, -1, None)
            return
        context = contextvars.copy_context()
        future = pool.submit(context.run, self._run_leaves, backwards)
        try:
            self._run_leaves(forwards)
        finally:
            # Join before anything else runs, even when the forward failed: the worker must
            # not keep touching the stages while the caller unwinds.
            worker_error = future.exception()
        if worker_error is not None:
            worker_error.add_note(f"raised on the overlap worker thread running {backwards!r} of {step!r}")
            raise worker_error

    def _run_leaves(self, leaves: list[MetaStep]) -> None:
        for leaf in leaves:
            if leaf.kind is StepKind.FWD:
                self.forward_leaf(leaf)
            else:
                self.backward_leaf(leaf)

    # ------------------------------------------------------------------ FSDP

    def _unshard(self, index: int) -> None:
        stage = self.stages[index]
        if not isinstance(stage.submod, FSDPModule):
            return
        if index in self.unsharded or index in self.unshard_handles:
            raise PipelineStateError(f"UNSHARD of stage {index} twice without a RESHARD in between")
        self.unshard_handles[index] = [
            module.unshard(async_op=True) for module in stage.submod.modules() if isinstance(module, FSDPModule)
        ]

    def _reshard(self, index: int) -> None:
        stage = self.stages[index]
        if not isinstance(stage.submod, FSDPModule):
            return
        if index in self.unshard_handles:
            self._ensure_unsharded(stage)
        if index not in self.unsharded:
            raise PipelineStateError(f"RESHARD of stage {index}, which is not unsharded")
        for module in stage.submod.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        self.unsharded.discard(index)

    def _reduce_grad(self, index: int) -> None:
        factor = self.context.n_microbatches if self.context.scale_grads else 1
        self.stages[index].perform_reduce_grad(factor)
        self.reduced.add(index)

    def _ensure_unsharded(self, stage: Any) -> None:
        """Wait for the stage's pending UNSHARD (if any); refuse to compute while sharded."""
        if not isinstance(stage.submod, FSDPModule):
            return
        index = stage.stage_index
        if index in self.unshard_handles:
            for handle in self.unshard_handles.pop(index):
                if handle is not None:  # None: the module was unsharded already
                    handle.wait()
            self.unsharded.add(index)
        if index not in self.unsharded:
            raise PipelineStateError(
                f"stage {index} computes while sharded: its order has no FSDP_UNSHARD before this step"
            )

    # ------------------------------------------------------------------ losses

    def _maybe_compute_loss(self, stage: Any, output: Any, micro: int) -> None:
        """Last stage only: append ``loss_fn(output, target)`` (torch's ``_maybe_compute_loss``)."""
        if stage.is_last:
            target = self.target_mbs[micro]  # type: ignore[index]
            self.context.losses.append(self.context.loss_fn(output, target, **(self.loss_kwargs or {})))

    def _maybe_get_loss(self, stage: Any, micro: int) -> torch.Tensor | None:
        """The loss a backward starts from: the last stage's, else ``None`` (torch's ``_maybe_get_loss``)."""
        losses = self.context.losses
        valid_index = 0 <= micro < len(losses)
        if stage.is_last and valid_index:
            return losses[micro]
        if losses and not valid_index:
            raise PipelineStateError(
                f"Loss for microbatch {micro} is not available. Available losses for microbatches: {losses}"
            )
        return None

    # ------------------------------------------------------------------ helpers

    def _require_received(self, leaf: MetaStep, recv: StepKind) -> None:
        key = (recv, leaf.stage, leaf.micro)
        if key not in self.p2p.received:
            raise PipelineStateError(
                f"{leaf!r} runs before its {MetaStep(recv, leaf.stage, leaf.micro)!r}; the order must "
                "receive a chunk's input before computing it (check_execution finds this statically)"
            )
        self.p2p.received.discard(key)  # type: ignore[arg-type]

    def _is_last_backward(self, stage_index: int) -> bool:
        return self.backward_count[stage_index] == self.context.n_microbatches

    def _stage_inputs(self, stage: Any, micro: int) -> list[torch.Tensor]:
        if stage.is_first:
            return list(_tensors((self.arg_mbs[micro], self.kwarg_mbs[micro])))
        infos = stage.args_recv_info[micro]
        return [info.buffer for info in infos if isinstance(getattr(info, "buffer", None), torch.Tensor)]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            yield leaf


def _weight_state(stage: Any, micro: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What a BWD_INPUT left for its BWD_WEIGHT, from torch's ``PipelineStage``: the
    gradients at the weight-path intermediates (``backward_state[micro]``'s param groups,
    read by ``stage_backward_weight``), and what must stay on the device: the stage's
    inputs, output and output gradients kept there, and the input gradients waiting to
    be sent (``bwd_cache``)."""
    state = stage.backward_state.get(micro)
    if state is None:  # a custom dw_runner keeps its own state: nothing we can move
        return [], []
    input_values, param_groups, stage_output, output_grads = state[:4]
    grads = [
        g for group in param_groups for grads_tuple in group.get("grads") or () for g in grads_tuple
        if isinstance(g, torch.Tensor)
    ]
    keep = list(_tensors((input_values, stage_output, output_grads, stage.bwd_cache.get(micro))))
    return grads, keep


def _protected(module: torch.nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Storages a FWD leaf must never release: the stage's parameters as they are now
    (FSDP-unsharded during compute) and buffers, plus the leaf's inputs."""
    return [*module.parameters(), *module.buffers(), *inputs]
