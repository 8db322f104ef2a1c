"""Padding masks for batches of sequences of different lengths.

``kv_padding`` hides the padded keys of each batch element: the first
``kv_lengths[b]`` columns are kept, the rest are blank (a left-aligned
block of full columns, its width varying with ``b``). ``q_padding`` blanks
the padded query rows instead; those rows see nothing, and their output is
zeros. Combine with other masks through ``and_masks``::

    kv_padding(lengths), lengths[b] = 4, Lq = 3, Lkv = 6

    █ █ █ █ · ·
    █ █ █ █ · ·
    █ █ █ █ · ·
"""
from __future__ import annotations

from ._check import int_tensor

_FIX = "pass an integer tensor [B] of valid lengths, on the device of q"


def kv_padding(kv_lengths):
    """mask_mod keeping ``kv_idx < kv_lengths[b]`` (``kv_lengths``: integer tensor ``[B]``).

    Picture of batch element ``b``: the first ``kv_lengths[b]`` columns kept, the rest blank.
    """
    lengths = int_tensor("kv_lengths", kv_lengths, (1,), _FIX)

    def kv_padding_mask(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    return kv_padding_mask


def q_padding(q_lengths):
    """mask_mod keeping ``q_idx < q_lengths[b]`` (``q_lengths``: integer tensor ``[B]``).

    Picture of batch element ``b``: the first ``q_lengths[b]`` rows kept, the rest blank
    (those queries attend to nothing: zero output, LSE -inf).
    """
    lengths = int_tensor("q_lengths", q_lengths, (1,), _FIX)

    def q_padding_mask(b, h, q_idx, kv_idx):
        return q_idx < lengths[b]

    return q_padding_mask
