"""Dilated sliding window (Longformer-style): a causal window with gaps.

Query ``i`` sees keys ``i, i - d, i - 2d, ...``: ``window`` keys spread
``dilation`` apart, so it reaches ``window * dilation`` positions back while
reading only ``window`` of them. The picture is ``window`` parallel
diagonals, ``dilation`` apart, starting at the main diagonal::

    dilated_sliding_window(3, 2), L = 7

    █ · · · · · ·
    · █ · · · · ·
    █ · █ · · · ·
    · █ · █ · · ·
    █ · █ · █ · ·
    · █ · █ · █ ·
    · · █ · █ · █
"""
from __future__ import annotations

from ._check import positive_int


def dilated_sliding_window(window, dilation):
    """mask_mod keeping ``0 <= q-kv < window * dilation`` with ``(q-kv) % dilation == 0``."""
    window = positive_int("window", window, "pass the number of keys each query sees, >= 1")
    dilation = positive_int("dilation", dilation, "pass the gap between keys, >= 1 (1: no gaps)")
    reach = window * dilation

    def dilated_sliding_window_mask(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        # distance >= 0 is checked too, so % never sees a negative operand where it matters
        return (distance >= 0) & (distance < reach) & (distance % dilation == 0)

    return dilated_sliding_window_mask
