"""Block-causal attention: full inside a block, causal between blocks.

The sequence is cut into blocks of ``block_size`` tokens (frames of a video,
images in an interleaved stream); a query sees every token of its own block
and of all earlier blocks. The picture is a staircase: the lower triangle
with the diagonal widened into full squares::

    block_causal(3), L = 7

    █ █ █ · · · ·
    █ █ █ · · · ·
    █ █ █ · · · ·
    █ █ █ █ █ █ ·
    █ █ █ █ █ █ ·
    █ █ █ █ █ █ ·
    █ █ █ █ █ █ █
"""
from __future__ import annotations

from ._check import positive_int


def block_causal(block_size):
    """mask_mod keeping ``kv_idx // block_size <= q_idx // block_size``."""
    block_size = positive_int("block_size", block_size, "pass the block length in tokens, >= 1")

    def block_causal_mask(b, h, q_idx, kv_idx):
        return kv_idx // block_size <= q_idx // block_size

    return block_causal_mask
