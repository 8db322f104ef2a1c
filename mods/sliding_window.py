"""Sliding-window (local) attention: each query sees only nearby keys.

Causal (the default): query ``i`` sees the ``window`` most recent keys,
itself included, ``i - window < j <= i``: a diagonal band ``window`` cells
wide, on and below the diagonal. Two-sided (``causal=False``): it sees
every key with ``|i - j| < window``, a band ``2 * window - 1`` wide centred
on the diagonal::

    sliding_window(3), L = 6     sliding_window(2, causal=False), L = 6

    █ · · · · ·                  █ █ · · · ·
    █ █ · · · ·                  █ █ █ · · ·
    █ █ █ · · ·                  · █ █ █ · ·
    · █ █ █ · ·                  · · █ █ █ ·
    · · █ █ █ ·                  · · · █ █ █
    · · · █ █ █                  · · · · █ █
"""
from __future__ import annotations

from ._check import positive_int


def sliding_window(window, causal=True):
    """mask_mod of a band of ``window`` keys per query (see the module picture).

    ``causal=True``: ``0 <= q_idx - kv_idx < window`` (Mistral-style; window 1
    is the diagonal alone). ``causal=False``: ``|q_idx - kv_idx| < window``.
    """
    window = positive_int("window", window, "pass the number of keys each query sees, >= 1")

    if causal:
        def causal_sliding_window_mask(b, h, q_idx, kv_idx):
            distance = q_idx - kv_idx
            return (distance >= 0) & (distance < window)
        return causal_sliding_window_mask

    def sliding_window_mask(b, h, q_idx, kv_idx):
        return abs(q_idx - kv_idx) < window

    return sliding_window_mask
