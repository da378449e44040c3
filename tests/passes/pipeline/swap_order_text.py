"""Test helper: write pipeline orders compactly, with short names for the swap steps."""

from __future__ import annotations

from hyper_offload.passes.pipeline.meta_step import MetaStep, parse_order

SWAP_SHORT_NAMES = {
    "LO": "SWAP_LAUNCH_OFFLOAD",
    "WO": "SWAP_WAIT_OFFLOAD",
    "LL": "SWAP_LAUNCH_LOAD",
    "WL": "SWAP_WAIT_LOAD",
}


def order(text: str) -> list[MetaStep]:
    """Parse an order, with LO / WO / LL / WL as short names of the four swap steps."""
    words = []
    for word in text.split():
        for short, long in SWAP_SHORT_NAMES.items():
            if short in word and long not in word:
                word = word.replace(short, long)
        words.append(word)
    return parse_order(words)
