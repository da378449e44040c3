"""Timeline picture: the file is a real PNG and every timeline record is drawn exactly once."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

from hyper_offload.passes.pipeline.build import build_rank_orders
from hyper_offload.passes.pipeline.timeline import Timeline, WindowKind, build_timeline
from hyper_offload.viz import (
    GID_BUBBLE,
    GID_COMPUTE,
    GID_WINDOW,
    PlotDependencyError,
    draw_timeline,
    plot_timeline,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def timeline_of(schedule: str, ranks: int, microbatches: int, **options) -> Timeline:
    orders = build_rank_orders(
        schedule,
        num_ranks=ranks,
        stages_per_rank=2 if schedule in ("zbv", "dualpipev", "interleaved-1f1b") else 1,
        num_microbatches=microbatches,
        **options,
    )
    return build_timeline(orders)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, "not a PNG file"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data[-8:-4] == b"IEND", "PNG truncated"
    return width, height


def count(figure, gid: str) -> int:
    return sum(1 for patch in figure.axes[0].patches if patch.get_gid() == gid)


@pytest.mark.parametrize(
    "schedule, ranks, microbatches, options",
    [
        ("gpipe", 4, 8, {"swap": True}),
        ("interleaved-1f1b", 2, 4, {"swap": True, "min_gap": 2}),
        ("dualpipev", 2, 4, {"swap": True, "dxdw_split": True, "fsdp": True}),
        ("1f1b", 3, 6, {}),
    ],
)
def test_every_slot_bubble_and_window_is_one_rectangle(schedule, ranks, microbatches, options) -> None:
    timeline = timeline_of(schedule, ranks, microbatches, **options)
    figure = draw_timeline(timeline)
    assert count(figure, GID_COMPUTE) == len(timeline.slots)
    assert count(figure, GID_BUBBLE) == len(timeline.bubbles)
    for kind in WindowKind:
        assert count(figure, GID_WINDOW[kind]) == sum(w.kind is kind for w in timeline.windows)
    assert (len(timeline.windows) > 0) is bool(options.get("swap"))
    # one band label per rank on the y axis
    labels = [tick.get_text() for tick in figure.axes[0].get_yticklabels()]
    assert [label for label in labels if label.startswith("rank")] == [f"rank {r}" for r in timeline.ranks]


def test_compute_rectangles_sit_at_their_slots_and_swap_marks_the_chunks() -> None:
    timeline = timeline_of("gpipe", 4, 8, swap=True)
    figure = draw_timeline(timeline)
    starts = sorted(p.get_x() for p in figure.axes[0].patches if p.get_gid() == GID_COMPUTE)
    assert starts == sorted(float(s.start) for s in timeline.slots)
    texts = {t.get_text() for t in figure.axes[0].texts}
    # every GPipe chunk at 8 micro-batches has gap 8 >= 4: collected in F, waited before B
    assert {"C·F0", "C·F7", "W·B0", "W·B7"} <= texts


def test_png_is_written_and_grows_with_the_schedule(tmp_path: Path) -> None:
    small = plot_timeline(timeline_of("gpipe", 2, 2), tmp_path / "small.png")
    large = plot_timeline(timeline_of("gpipe", 4, 8, swap=True), tmp_path / "large.png", title="GPipe + swap")
    small_w, small_h = png_size(small)
    large_w, large_h = png_size(large)
    assert 300 <= small_w and 150 <= small_h
    assert large_w > small_w and large_h > small_h  # more slots, more ranks and copy lanes
    assert large_w < 4000 and large_h < 3000


def test_missing_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotDependencyError, match=r"pip install hyper-offload\[plot\]"):
        plot_timeline(timeline_of("gpipe", 2, 2), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_a_zero_bubble_timeline_draws_the_dw_state_windows() -> None:
    """ZBV swaps the dW state across its BWD_INPUT -> BWD_WEIGHT gaps: the picture shows
    those copy windows in lanes of their own, and marks each BWD_WEIGHT that waits for one."""
    pytest.importorskip("matplotlib")
    from hyper_offload.passes.pipeline import build_rank_orders, build_timeline
    from hyper_offload.passes.pipeline.timeline import WindowKind
    from hyper_offload.viz import draw_timeline

    orders = build_rank_orders("zbv", num_ranks=4, stages_per_rank=2, num_microbatches=8, swap=True)
    timeline = build_timeline(orders)
    dw_windows = [w for w in timeline.windows if w.kind in (WindowKind.WEIGHT_OFFLOAD, WindowKind.WEIGHT_LOAD)]
    assert dw_windows
    figure = draw_timeline(timeline)
    gids = [patch.get_gid() for patch in figure.axes[0].patches]
    assert gids.count("dw_offload") + gids.count("dw_load") == len(dw_windows)
    texts = [t.get_text() for t in figure.axes[0].texts]
    assert any(text.startswith("W·W") for text in texts)
