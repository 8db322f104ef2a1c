"""Chunked local attention (Llama 4's iRoPE layers): causal inside fixed chunks.

The sequence is cut into chunks of ``chunk_size`` tokens; a query sees the
keys of its own chunk up to itself. The picture is a row of lower
triangles on the diagonal, nothing between chunks::

    chunked_local(3), L = 7

    █ · · · · · ·
    █ █ · · · · ·
    █ █ █ · · · ·
    · · · █ · · ·
    · · · █ █ · ·
    · · · █ █ █ ·
    · · · · · · █
"""
from __future__ import annotations

from ._check import positive_int


def chunked_local(chunk_size):
    """mask_mod keeping ``q_idx // chunk_size == kv_idx // chunk_size & kv_idx <= q_idx``."""
    chunk_size = positive_int("chunk_size", chunk_size, "pass the chunk length in tokens, >= 1")

    def chunked_local_mask(b, h, q_idx, kv_idx):
        return (q_idx // chunk_size == kv_idx // chunk_size) & (kv_idx <= q_idx)

    return chunked_local_mask
