"""Cross-rank executability: can every rank run its order to the end?

:func:`check_execution` plays all ranks' orders against each other, the way torch's
``_simulate_comms_compute`` does, with the semantics the executor will have:

* a plain ``SEND_*`` is posted and the rank moves on (isend; it is waited on later);
* a plain ``RECV_*`` blocks until the matching send has been posted
  (``SEND_F s m`` ↔ ``RECV_F s+1 m``, ``SEND_B s m`` ↔ ``RECV_B s-1 m``);
* a ``BATCH_SEND_RECV`` posts all its ops at once (one ``batch_isend_irecv``) and blocks
  until its receives are matched; its sends are waited on lazily, like plain sends. With
  ``batch_waits_sends=True`` it blocks until *every* op is matched instead — the semantics of
  a backend that completes a fused batch as a whole (NCCL coalescing). Under that stricter
  rule GPipe and 1F1B batch orders stay deadlock-free (the fused pairs match torch's
  Schedule1F1B runtime), while interleaved and V-shaped orders can deadlock: run them with
  ``plain`` transport, or check the shape with this function first;
* compute, FSDP and swap steps never block on another rank.

On top of deadlock it checks local data dependencies: a FWD needs its input (the local
previous stage's FWD, or its RECV_F), a BWD / BWD_INPUT needs its FWD and its output
gradient (the local next stage's backward, or its RECV_B), a BWD_WEIGHT needs its BWD_INPUT,
a SEND needs the compute that produces it; leaves of one composite run concurrently and
cannot feed each other; a stage with FSDP steps must be unsharded when it computes; every
posted op is matched in the end.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .check_order import OrderRule, OrderViolation
from .meta_step import P2P_KINDS, RECV_KINDS, MetaStep, StepKind
from .orders import PipelineLayout

P2PKey = tuple[StepKind, int, int]
"""``(kind, stage, micro)`` of a P2P (or compute) leaf."""
# P2P kind -> (kind of the matching op, stage offset of the matching op)
_PARTNER = {
    StepKind.SEND_F: (StepKind.RECV_F, 1),
    StepKind.RECV_F: (StepKind.SEND_F, -1),
    StepKind.SEND_B: (StepKind.RECV_B, -1),
    StepKind.RECV_B: (StepKind.SEND_B, 1),
}


def p2p_key(step: MetaStep) -> P2PKey:
    """``(kind, stage, micro)`` of a leaf."""
    assert step.stage is not None and step.micro is not None
    return (step.kind, step.stage, step.micro)


def matching_p2p(key: P2PKey) -> P2PKey:
    """The P2P op that matches ``key`` on the neighbouring stage's rank."""
    kind, offset = _PARTNER[key[0]]
    return (kind, key[1] + offset, key[2])


def _text(key: P2PKey) -> str:
    return repr(MetaStep(*key))


class _RankState:
    """Where one rank is: next position, finished leaves, unsharded stages, posted batches."""

    def __init__(self, rank: int, order: Sequence[MetaStep]) -> None:
        self.rank = rank
        self.order = order
        self.pc = 0
        self.done: set[P2PKey] = set()
        self.unsharded: set[int] = set()
        self.fsdp_stages = {s.stage for s in order if s.is_fsdp}
        self.posted_at: set[int] = set()


class _Simulation:
    def __init__(self, layout: PipelineLayout, batch_waits_sends: bool) -> None:
        self.layout = layout
        self.batch_waits_sends = batch_waits_sends
        self.posted: set[P2PKey] = set()
        self.out: list[OrderViolation] = []

    def report(self, state: _RankState, leaf: MetaStep, rule: OrderRule, message: str) -> None:
        self.out.append(OrderViolation(state.rank, state.pc, leaf.stage, leaf.micro, rule, message))

    def try_step(self, state: _RankState, step: MetaStep) -> bool:
        """Run ``step`` if it can run now, reporting local problems; False means blocked."""
        if step.is_p2p:
            return self._p2p(state, step)
        if step.kind is StepKind.FSDP_UNSHARD:
            state.unsharded.add(step.stage)  # type: ignore[arg-type]
        elif step.kind is StepKind.FSDP_RESHARD:
            state.unsharded.discard(step.stage)  # type: ignore[arg-type]
        elif step.is_compute_slot:
            leaves = list(step.leaves())
            for leaf in leaves:  # checked before any leaf finishes: they run concurrently
                self._check_inputs(state, leaf)
            state.done.update(p2p_key(leaf) for leaf in leaves)
        return True

    def _p2p(self, state: _RankState, step: MetaStep) -> bool:
        leaves = list(step.leaves())
        if state.pc not in state.posted_at:
            for leaf in leaves:
                if leaf.kind not in RECV_KINDS:
                    self._check_send_source(state, leaf)
                self.posted.add(p2p_key(leaf))
            state.posted_at.add(state.pc)
        strict = self.batch_waits_sends and step.kind is StepKind.BATCH_SEND_RECV
        blocking = leaves if strict else [leaf for leaf in leaves if leaf.kind in RECV_KINDS]
        if any(matching_p2p(p2p_key(leaf)) not in self.posted for leaf in blocking):
            return False
        state.done.update(p2p_key(leaf) for leaf in leaves)
        return True

    def _check_send_source(self, state: _RankState, leaf: MetaStep) -> None:
        sources = [StepKind.FWD] if leaf.kind is StepKind.SEND_F else [StepKind.BWD, StepKind.BWD_INPUT]
        if not any((k, leaf.stage, leaf.micro) in state.done for k in sources):
            self.report(state, leaf, OrderRule.DEPENDENCY, f"{leaf!r} sends a result not computed yet")

    def _check_inputs(self, state: _RankState, leaf: MetaStep) -> None:
        for options in self._inputs_of(state.rank, leaf):
            if not any(k in state.done for k in options):
                wanted = " or ".join(_text(k) for k in options)
                self.report(state, leaf, OrderRule.DEPENDENCY, f"{leaf!r} runs before {wanted}")
        if leaf.stage in state.fsdp_stages and leaf.stage not in state.unsharded:
            self.report(
                state, leaf, OrderRule.NOT_UNSHARDED, f"{leaf!r} computes while stage {leaf.stage} is sharded"
            )

    def _inputs_of(self, rank: int, leaf: MetaStep) -> list[tuple[P2PKey, ...]]:
        """For each input of ``leaf``: the leaves that can provide it (any one suffices)."""
        s, m = leaf.stage, leaf.micro
        assert s is not None and m is not None
        local = self.layout.rank_of
        if leaf.kind is StepKind.FWD:
            if s == 0:
                return []
            return [((StepKind.FWD, s - 1, m),) if local(s - 1) == rank else ((StepKind.RECV_F, s, m),)]
        if leaf.kind is StepKind.BWD_WEIGHT:
            return [((StepKind.BWD_INPUT, s, m),)]
        needs: list[tuple[P2PKey, ...]] = [((StepKind.FWD, s, m),)]
        if s < self.layout.num_stages - 1:
            if local(s + 1) == rank:
                needs.append(((StepKind.BWD, s + 1, m), (StepKind.BWD_INPUT, s + 1, m)))
            else:
                needs.append(((StepKind.RECV_B, s, m),))
        return needs


def check_execution(
    orders: Mapping[int, Sequence[MetaStep]], layout: PipelineLayout, *, batch_waits_sends: bool = False
) -> list[OrderViolation]:
    """Every dependency, FSDP, matching and deadlock problem of the ranks' orders together.

    ``step`` of an UNMATCHED_P2P violation is -1: the op is posted but never matched.
    """
    sim = _Simulation(layout, batch_waits_sends)
    ranks = [_RankState(r, orders[r]) for r in sorted(orders)]
    progress = True
    while progress:
        progress = False
        for state in ranks:
            while state.pc < len(state.order) and sim.try_step(state, state.order[state.pc]):
                state.pc += 1
                progress = True
    for state in ranks:
        if state.pc < len(state.order):
            step = state.order[state.pc]
            waiting = [_text(matching_p2p(p2p_key(leaf))) for leaf in step.leaves()
                       if leaf.kind in P2P_KINDS and matching_p2p(p2p_key(leaf)) not in sim.posted]
            sim.out.append(OrderViolation(
                state.rank, state.pc, step.stage, step.micro, OrderRule.DEADLOCK,
                f"{step!r} waits forever for {', '.join(waiting)} from a peer rank",
            ))
    for key in sorted(k for k in sim.posted if matching_p2p(k) not in sim.posted):
        sim.out.append(OrderViolation(
            layout.rank_of(key[1]), -1, key[1], key[2], OrderRule.UNMATCHED_P2P,
            f"{_text(key)} is posted but no rank posts the matching {_text(matching_p2p(key))}",
        ))
    return sim.out
