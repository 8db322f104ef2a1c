"""Causal masks: a query sees itself and the keys before it.

The picture is the lower triangle, diagonal included. ``causal(offset)``
slides the diagonal right by ``offset`` columns; ``causal_lower_right``
picks the offset that puts the diagonal's end in the bottom-right corner
when there are more keys than queries (decoding with a KV cache)::

    causal_mask, L = 6           causal_lower_right(3, 6)

    █ · · · · ·                  █ █ █ █ · ·
    █ █ · · · ·                  █ █ █ █ █ ·
    █ █ █ · · ·                  █ █ █ █ █ █
    █ █ █ █ · ·
    █ █ █ █ █ ·
    █ █ █ █ █ █
"""
from __future__ import annotations

from ._check import int_scalar, positive_int


def causal_mask(b, h, q_idx, kv_idx):
    """mask_mod: the lower triangle, diagonal included (``kv_idx <= q_idx``)."""
    return q_idx >= kv_idx


def causal(offset=0):
    """mask_mod keeping ``kv_idx <= q_idx + offset``: the lower triangle, shifted.

    ``offset`` > 0 moves the diagonal right (each query also sees ``offset``
    keys ahead), < 0 moves it left (the first ``-offset`` rows see nothing).
    ``offset`` is an int (a kernel constant) or a 0-d integer tensor (a
    runtime scalar: changing its value does not recompile).
    """
    offset = int_scalar("offset", offset, "pass an int such as kv_len - q_len")

    def causal_offset_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    return causal_offset_mask


def causal_lower_right(q_len, kv_len):
    """Causal mask for ``q_len`` queries that are the last ``q_len`` of ``kv_len`` keys.

    Query ``i`` sees keys ``0 .. i + kv_len - q_len``: the triangle's
    diagonal ends in the bottom-right corner (torch's ``causal_lower_right``).
    With ``q_len > kv_len`` the first ``q_len - kv_len`` rows see nothing.
    """
    q_len = positive_int("q_len", q_len, "pass the query length, an int >= 1")
    kv_len = positive_int("kv_len", kv_len, "pass the key/value length, an int >= 1")
    return causal(kv_len - q_len)
