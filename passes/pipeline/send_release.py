"""Send release: where each rank can wait for a posted send because its peer has it already.

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

from .execution import P2PKey, matching_p2p, p2p_key
from .meta_step import RECV_KINDS, SEND_KINDS, MetaStep

__all__ = ["SendReleases", "send_releases"]

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
