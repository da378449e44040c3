"""One stage per rank under FSDP: the stage stays unsharded, so the swap pass has no
lookahead UNSHARD to hang the load on. The design's rule ("delay") starts every load in the
comm block right before its backward, where no compute hides it; the default ("cover")
uses the cover point of a stage without FSDP. Measured with the cost model's windows."""

from __future__ import annotations

import pytest

from hyper_offload.passes.pipeline import ActivationSizes, SwapCostModel, build_rank_orders
from hyper_offload.passes.pipeline.swap_cost import chunk_windows

SIZES = ActivationSizes(default_bytes=128 << 20)  # 128 MiB of activations per chunk
COST = SwapCostModel()  # 20 GB/s each way, F 10 ms, B 20 ms: one H2D takes 6.7 ms


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_delayed_loads_are_exposed_and_cover_hides_them(schedule: str) -> None:
    kw = dict(num_ranks=4, stages_per_rank=1, num_microbatches=8, fsdp=True, swap=True)
    delayed = build_rank_orders(schedule, unsharded_load="delay", **kw)
    cover = build_rank_orders(schedule, **kw)
    checked = 0
    for rank in range(4):
        slow = chunk_windows(delayed[rank], SIZES, COST)
        fast = chunk_windows(cover[rank], SIZES, COST)
        assert slow.keys() == fast.keys()
        for key in slow:
            assert slow[key].load_window_s == 0.0, "delay: no compute between launch and wait"
            assert fast[key].load_window_s >= fast[key].h2d_s, "cover: one slot hides the H2D"
            checked += 1
    assert checked > 0


def test_cover_matches_a_stage_without_fsdp() -> None:
    kw = dict(num_ranks=4, stages_per_rank=1, num_microbatches=8, swap=True)
    with_fsdp = build_rank_orders("gpipe", fsdp=True, **kw)
    without = build_rank_orders("gpipe", **kw)
    for rank in range(4):
        strip = [s for s in with_fsdp[rank] if not s.is_fsdp]
        assert strip == without[rank]


def test_unknown_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="unsharded_load must be one of cover, delay"):
        build_rank_orders("gpipe", num_ranks=2, stages_per_rank=1, num_microbatches=8, swap=True,
                          unsharded_load="early")
