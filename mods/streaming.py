"""Attention sinks (StreamingLLM, Xiao et al., 2023): a window plus the first tokens.

Each query sees the first ``num_sinks`` tokens (the "sinks" that soak up
attention mass) and a causal sliding window of the ``window`` most recent
tokens, itself included: a band along the diagonal plus a strip of columns
on the left, cut to the lower triangle::

    attention_sinks(1, 3), L = 7

    █ · · · · · ·
    █ █ · · · · ·
    █ █ █ · · · ·
    █ █ █ █ · · ·
    █ · █ █ █ · ·
    █ · · █ █ █ ·
    █ · · · █ █ █
"""
from __future__ import annotations

from ._check import nonnegative_int, positive_int


def attention_sinks(num_sinks, window):
    """mask_mod keeping ``kv_idx <= q_idx & (kv_idx < num_sinks | q_idx - kv_idx < window)``."""
    num_sinks = nonnegative_int("num_sinks", num_sinks, "pass the number of sink tokens, e.g. 4")
    window = positive_int("window", window, "pass the number of recent keys each query sees, >= 1")

    def attention_sinks_mask(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        return (distance >= 0) & ((kv_idx < num_sinks) | (distance < window))

    return attention_sinks_mask
