"""Prefix-LM: a bidirectional prefix followed by causal generation.

Every query sees the whole prefix (the first ``prefix_length`` keys) and,
past it, the usual causal triangle: a full block of columns on the left
joined to the lower triangle. Used by T5-style prefix LMs and PaliGemma
(image and prompt tokens attend to each other both ways)::

    prefix_lm(3), L = 6

    █ █ █ · · ·
    █ █ █ · · ·
    █ █ █ · · ·
    █ █ █ █ · ·
    █ █ █ █ █ ·
    █ █ █ █ █ █
"""
from __future__ import annotations

import torch

from ._check import int_tensor, nonnegative_int


def prefix_lm(prefix_length):
    """mask_mod keeping ``kv_idx < prefix | kv_idx <= q_idx``.

    ``prefix_length`` is an int (the same prefix for every sequence; 0 gives
    plain causal) or an integer tensor ``[B]``, read as ``prefix_length[b]``
    (a different prefix per sequence; its values are runtime data, so
    changing them does not recompile). Put the tensor on the device of q.
    """
    fix = "pass an int >= 0, or an integer tensor [B] of per-sequence prefix lengths"
    if isinstance(prefix_length, torch.Tensor):
        prefix = int_tensor("prefix_length", prefix_length, (1,), fix)

        def per_batch_prefix_lm_mask(b, h, q_idx, kv_idx):
            return (kv_idx < prefix[b]) | (kv_idx <= q_idx)

        return per_batch_prefix_lm_mask

    prefix = nonnegative_int("prefix_length", prefix_length, fix)

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (kv_idx <= q_idx)

    return prefix_lm_mask
