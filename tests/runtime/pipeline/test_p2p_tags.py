"""P2P tags: a send and the receive that matches it share a tag; no two other messages do."""

from __future__ import annotations

import pytest

from hyper_offload.passes.pipeline import MetaStep, StepKind, build_rank_orders
from hyper_offload.runtime.pipeline.p2p import p2p_tag

_MATCH = {StepKind.SEND_F: (StepKind.RECV_F, 1), StepKind.SEND_B: (StepKind.RECV_B, -1)}


@pytest.mark.parametrize(
    ("schedule", "ranks", "spr", "micro"),
    [("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("interleaved-1f1b", 2, 2, 4), ("interleaved-zb", 4, 2, 8),
     ("zbv", 2, 2, 4), ("dualpipev", 4, 2, 8)],
)
def test_matching_leaves_share_a_tag_and_tags_are_unique(schedule: str, ranks: int, spr: int, micro: int) -> None:
    orders = build_rank_orders(schedule, num_ranks=ranks, stages_per_rank=spr, num_microbatches=micro)
    num_stages = ranks * spr
    leaves = [leaf for order in orders.values() for step in order for leaf in step.leaves() if step.is_p2p]
    sends = [leaf for leaf in leaves if leaf.kind in _MATCH]
    recvs = {(leaf.kind, leaf.stage, leaf.micro): leaf for leaf in leaves if leaf.kind not in _MATCH}
    assert sends and len(sends) == len(recvs)
    for send in sends:
        kind, offset = _MATCH[send.kind]
        recv = recvs[(kind, send.stage + offset, send.micro)]
        assert p2p_tag(send, num_stages) == p2p_tag(recv, num_stages) > 0
    tags = [p2p_tag(s, num_stages) for s in sends]
    assert len(set(tags)) == len(tags), "two different messages share a tag"


def test_tag_of_a_non_p2p_leaf_is_refused() -> None:
    with pytest.raises(ValueError, match="not a P2P leaf"):
        p2p_tag(MetaStep(StepKind.FWD, 0, 0), 2)
