"""Send release points: hand-built orders by hand; on every schedule, each send released
exactly at the first step its receive happens before (an independent graph search)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_offload.passes.pipeline import SCHEDULES, StepKind, build_rank_orders, layout_for, parse_order
from hyper_offload.passes.pipeline.execution import matching_p2p, send_releases

F, B = StepKind.SEND_F, StepKind.SEND_B


def test_a_send_is_proven_by_the_first_later_message_from_its_receiver() -> None:
    orders = {
        0: parse_order("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1"),
        1: parse_order("1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"),
    }
    releases = send_releases(orders)
    # Rank 1 posted SEND_B0 after receiving F0: RECV_B0 proves SEND_F0. It received F1
    # only after posting SEND_B0, so SEND_F1 waits for RECV_B1.
    assert dict(releases[0]) == {
        (StepKind.RECV_B, 0, 0): ((F, 0, 0),),
        (StepKind.RECV_B, 0, 1): ((F, 0, 1),),
    }
    # Rank 0 never sends after its receives of B: rank 1's sends wait for the step end.
    assert dict(releases[1]) == {}


def test_a_batch_proves_the_sends_it_posts_itself_when_its_receive_carries_the_proof() -> None:
    orders = build_rank_orders("1f1b", num_ranks=2, stages_per_rank=1, num_microbatches=2, transport="batch")
    releases = send_releases(orders)
    assert dict(releases[0]) == {
        (StepKind.RECV_B, 0, 0): ((F, 0, 0),),
        (StepKind.RECV_B, 0, 1): ((F, 0, 1),),
    }


def test_deadlocked_orders_are_refused_with_the_stuck_steps() -> None:
    orders = {0: parse_order("0RECV_B0 0F0 0SEND_F0"), 1: parse_order("1RECV_F0 1F0 1B0 1SEND_B0")}
    with pytest.raises(ValueError, match=r"deadlock \(rank 0 at step 0 \(0RECV_B0\), rank 1 at step 0"):
        send_releases(orders)


def test_a_send_nobody_receives_is_refused() -> None:
    orders = {0: parse_order("0F0 0SEND_F0"), 1: parse_order("1F0")}
    with pytest.raises(ValueError, match=r"posts 0SEND_F0 but no rank receives it \(no order holds 1RECV_F0\)"):
        send_releases(orders)


def _positions(order) -> dict:
    """P2P leaf key -> position of its top-level step."""
    out = {}
    for position, step in enumerate(order):
        for leaf in step.leaves():
            if leaf.is_p2p:
                out[(leaf.kind, leaf.stage, leaf.micro)] = position
    return out


def _first_known(orders, where, peer: int, completed: int, rank: int) -> int | None:
    """The first step of ``rank`` that ``peer``'s step ``completed`` happens before, by a
    graph search (independent of the pass's vector clocks): program order on each rank,
    and a message posted at step ``j`` of rank ``q`` and received at step ``k`` of rank
    ``r`` carries everything up to ``q``'s step ``j - 1`` into ``(r, k)``."""
    delivers: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r, keys in where.items():
        for key, k in keys.items():
            if key[0] in (StepKind.RECV_F, StepKind.RECV_B):
                q = next(q for q in where if matching_p2p(key) in where[q])
                j = where[q][matching_p2p(key)]
                if j >= 1:
                    delivers.setdefault((q, j - 1), []).append((r, k))
    reached = {peer: completed}  # per rank: the first step reached (later ones follow)
    frontier = [(peer, completed)]
    while frontier:
        q, start = frontier.pop()
        for position in range(start, len(orders[q])):
            for r, k in delivers.get((q, position), ()):
                if k < reached.get(r, len(orders[r])):
                    reached[r] = k
                    frontier.append((r, k))
    return reached.get(rank)


def _check_sound_and_earliest(schedule: str, ranks: int, micro: int, transport: str) -> int:
    spr = 1 if schedule in ("gpipe", "1f1b") else 2
    orders = build_rank_orders(
        schedule, num_ranks=ranks, stages_per_rank=spr, num_microbatches=micro,
        transport=transport, swap=True,
    )
    layout = layout_for(schedule, num_ranks=ranks, stages_per_rank=spr)
    releases = send_releases(orders)
    where = {r: _positions(o) for r, o in orders.items()}
    released = 0
    for rank, table in releases.items():
        proven = {send: where[rank][receive] for receive, sends in table.items() for send in sends}
        for send, sent_at in where[rank].items():
            if send[0] not in (F, B):
                continue
            receive = matching_p2p(send)
            peer = layout.rank_of(receive[1])
            first = _first_known(orders, where, peer, where[peer][receive], rank)
            if first is None:
                assert send not in proven, (schedule, rank, send)
                continue
            assert first >= sent_at, "a receive cannot be known before its send is posted"
            assert proven.get(send) == first, (schedule, rank, send)
            released += 1
    return released


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("transport", ["plain", "batch", "boundary"])
def test_every_schedule_releases_each_send_at_its_earliest_proof(schedule: str, transport: str) -> None:
    micro = 8
    released = _check_sound_and_earliest(schedule, 4, micro, transport)
    # Every chunk's forward send but the last few is proven by the backward coming back.
    assert released >= micro, f"{schedule}: only {released} sends released"


@settings(max_examples=25, deadline=None)
@given(
    schedule=st.sampled_from(SCHEDULES),
    ranks=st.integers(2, 4),
    rounds=st.integers(1, 3),
    transport=st.sampled_from(["plain", "batch"]),
)
def test_release_points_are_sound_on_random_shapes(schedule: str, ranks: int, rounds: int, transport: str) -> None:
    micro = ranks * rounds * (2 if schedule == "dualpipev" else 1)
    _check_sound_and_earliest(schedule, ranks, micro, transport)
