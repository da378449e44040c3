"""Cross-rank analyses of pipeline orders: executability, and where each send may be waited.

Cross-rank executability: can every rank run its order to the end?

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

Send release: where each rank can wait for a posted send because its peer has it already.

The executor posts a send and moves on (isend); the tensor it sends (a stage's output, an
input gradient) stays alive while the request is pending. Waiting for every send at the end
of the step, as the executor did, keeps each chunk's sent tensors on the device until then:
in the zero-bubble schedules that is megabytes per rank, on top of every peak.

A rank may wait for a send earlier once it *knows* the receiver completed the matching
receive: then the wait returns at once (nothing to block on, so no deadlock), at a point
fixed by the orders alone (so the memory curve is deterministic and the residency model can
predict it). It knows that when it has received a message the receiver posted after that
receive, directly or through a chain of messages: the happens-before relation of the ranks'
orders (Lamport), which :func:`send_releases` computes with vector clocks.

Semantics, the executor's (see :mod:`.execution`): a rank completes a top-level step when
all of its receives are matched; a send is posted when its step starts. So a send posted at
step ``j`` of rank ``p`` tells its receiver that ``p`` completed every step before ``j``
(and everything ``p`` knew then). A send ``S`` of rank ``r`` whose receive sits at step
``i`` of rank ``p`` is *proven* after the first step ``k`` of ``r`` (at or after ``S``'s
own step) whose receives leave ``r`` knowing that ``p`` completed step ``i``.

The result names release points by a receive leaf, not a position, so it holds for every
order with the same P2P steps (the swap pass only adds swap steps): after the top-level step
holding receive ``key`` completes, the sends ``releases[rank][key]`` are proven. Sends that
are never proven are waited at the end of the step, as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

from hyper_offload.errors import TimelineError

from .check_order import OrderRule, OrderViolation
from .meta_step import MetaStep, P2P_KINDS, RECV_KINDS, SEND_KINDS, StepKind
from .build import PipelineLayout

__all__ = [
    "P2PKey",
    "SendReleases",
    "check_execution",
    "matching_p2p",
    "p2p_key",
    "send_releases",
]


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


SendReleases = Mapping[P2PKey, tuple[P2PKey, ...]]
"""One rank's release points: receive leaf → the sends proven once its step completes."""

class _Clocks:
    """Vector clocks of every rank while the orders are played against each other.

    ``known[r][q]``: how many leading steps of rank ``q`` rank ``r`` knows to be complete.
    """

    def __init__(self, orders: Mapping[int, Sequence[MetaStep]]) -> None:
        self.ranks = sorted(orders)
        self.slot = {rank: i for i, rank in enumerate(self.ranks)}
        self.known = {rank: [0] * len(self.ranks) for rank in self.ranks}
        self.posted: dict[P2PKey, tuple[int, ...]] = {}  # send -> its rank's clock at posting
        self.received_at: dict[P2PKey, tuple[int, int]] = {}  # receive -> (rank, step)
        # Per rank, after each step with receives: (step, first receive leaf, clock after it).
        self.after_receives: dict[int, list[tuple[int, P2PKey, tuple[int, ...]]]] = {
            rank: [] for rank in self.ranks
        }
        self.sent_at: dict[P2PKey, tuple[int, int]] = {}  # send -> (rank, step)

    def post(self, rank: int, position: int, step: MetaStep) -> None:
        for leaf in step.leaves():
            if leaf.kind in SEND_KINDS:
                key = p2p_key(leaf)
                self.posted[key] = tuple(self.known[rank])
                self.sent_at[key] = (rank, position)

    def can_complete(self, step: MetaStep) -> bool:
        receives = [p2p_key(leaf) for leaf in step.leaves() if leaf.kind in RECV_KINDS]
        return all(matching_p2p(key) in self.posted for key in receives)

    def complete(self, rank: int, position: int, step: MetaStep) -> None:
        clock = self.known[rank]
        receives = [p2p_key(leaf) for leaf in step.leaves() if leaf.kind in RECV_KINDS]
        for key in receives:
            message = self.posted[matching_p2p(key)]
            clock[:] = [max(a, b) for a, b in zip(clock, message)]
            self.received_at[key] = (rank, position)
        clock[self.slot[rank]] = position + 1
        if receives:
            self.after_receives[rank].append((position, receives[0], tuple(clock)))


def _play(orders: Mapping[int, Sequence[MetaStep]]) -> _Clocks:
    """Run every rank as far as it can (the executor's blocking rules); raise on deadlock."""
    clocks = _Clocks(orders)
    pc = dict.fromkeys(clocks.ranks, 0)
    started: set[tuple[int, int]] = set()
    progress = True
    while progress:
        progress = False
        for rank in clocks.ranks:
            order = orders[rank]
            while pc[rank] < len(order):
                position, step = pc[rank], order[pc[rank]]
                if (rank, position) not in started:  # a step posts its sends when it starts
                    started.add((rank, position))
                    clocks.post(rank, position, step)
                if not clocks.can_complete(step):
                    break
                clocks.complete(rank, position, step)
                pc[rank] += 1
                progress = True
    stuck = {rank: pc[rank] for rank in clocks.ranks if pc[rank] < len(orders[rank])}
    if stuck:
        where = ", ".join(f"rank {r} at step {p} ({orders[r][p]!r})" for r, p in stuck.items())
        raise TimelineError(
            f"send_releases: the orders deadlock ({where}); run check_execution on them to see "
            "which receive is never matched"
        )
    return clocks


def send_releases(orders: Mapping[int, Sequence[MetaStep]]) -> dict[int, SendReleases]:
    """Every rank's release points (module docstring): rank → receive leaf → proven sends.

    ``orders`` must be every rank's order of one pipeline (each rank's P2P steps as the
    executor runs them); raises TimelineError if they deadlock or a send is never received.
    """
    clocks = _play(orders)
    releases: dict[int, dict[P2PKey, list[P2PKey]]] = {rank: {} for rank in clocks.ranks}
    for send, (rank, sent) in sorted(clocks.sent_at.items(), key=lambda item: item[1]):
        receive = matching_p2p(send)
        if receive not in clocks.received_at:
            raise TimelineError(
                f"send_releases: rank {rank} posts {MetaStep(*send)!r} but no rank receives it "
                f"(no order holds {MetaStep(*receive)!r})"
            )
        peer, received = clocks.received_at[receive]
        proof = next(
            (key for position, key, clock in clocks.after_receives[rank]
             if position >= sent and clock[clocks.slot[peer]] > received),
            None,
        )
        if proof is not None:
            releases[rank].setdefault(proof, []).append(send)
    return {
        rank: MappingProxyType({key: tuple(sends) for key, sends in table.items()})
        for rank, table in releases.items()
    }
