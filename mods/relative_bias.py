"""Learned relative-position biases: a score bonus that depends on ``q - kv``.

Both mods add a learned value that is constant along each diagonal of the
score matrix (a Toeplitz picture): ``relative_position_bias`` has one entry
per distance; ``t5_relative_bias`` shares entries between distances through
T5's buckets (exact for small distances, log-spaced up to ``max_distance``,
one bucket for everything further)::

    T5 buckets of kv - q, num_buckets=8, max_distance=8, bidirectional

    kv - q : -9 -8 -7 -6 -5 -4 -3 -2 -1  0  1  2  3  4  5  6  7  8  9
    bucket :  3  3  3  3  3  3  2  2  1  0  5  6  6  7  7  7  7  7  7

The bucket is computed with integers only: ``min(n, max_exact)`` plus one
for every log-spaced threshold the distance ``n`` has reached. The
thresholds are found once, in the factory, with Hugging Face's float32
formula, so the buckets agree with ``T5Attention._relative_position_bucket``.
"""
from __future__ import annotations

import math

import torch

from flexgen.errors import expected

from ._check import float_tensor, positive_int


def relative_position_bias(table, max_len):
    """score_mod adding ``table[h, q_idx - kv_idx + c]`` (``c`` = the centre column).

    ``table`` is a float tensor ``[H, 2*L - 1]`` (or ``[2*L - 1]``, shared by
    all heads), column ``c = L - 1`` holding distance 0; ``max_len`` is the
    longest query or key length it will be used with, which must satisfy
    ``max_len <= L`` so every index stays inside the table.
    """
    fix = "pass a float tensor [H, 2*L-1] or [2*L-1] with L >= the longest sequence"
    table = float_tensor("table", table, (1, 2), fix)
    max_len = positive_int("max_len", max_len, "pass the longest query/key length, >= 1")
    size = table.shape[-1]
    if size % 2 == 0:
        raise expected("table", "an odd last dimension 2*L-1 (distance 0 in the middle)",
                       f"shape {list(table.shape)}", fix)
    if size < 2 * max_len - 1:
        raise expected("table", f"a last dimension >= 2*max_len-1 = {2 * max_len - 1}",
                       f"shape {list(table.shape)}", fix)
    centre = (size - 1) // 2

    if table.dim() == 1:
        def shared_relative_bias_score_mod(score, b, h, q_idx, kv_idx):
            return score + table[q_idx - kv_idx + centre]
        return shared_relative_bias_score_mod

    def relative_bias_score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + centre]

    return relative_bias_score_mod


def _t5_thresholds(num_buckets: int, max_distance: int) -> list[int]:
    """Distances at which T5's log-spaced bucket steps up, one entry per step."""
    max_exact = num_buckets // 2
    n = torch.arange(max_exact, max_distance + 1)
    # Hugging Face's formula, in float32 as there, so that rounding agrees
    large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return [int(n[large >= max_exact + k][0]) for k in range(1, num_buckets - max_exact)]


def t5_relative_bias(table, num_buckets=32, max_distance=128, bidirectional=True):
    """score_mod adding ``table[h, bucket(kv_idx - q_idx)]`` with T5 bucketing.

    ``table`` is a float tensor ``[H, num_buckets]`` (or ``[num_buckets]``),
    T5's ``relative_attention_bias.weight.T``. With ``bidirectional`` half
    the buckets are for keys after the query; without it (decoders) every
    key after the query shares bucket 0 with the query itself.
    """
    fix = "pass a float tensor [H, num_buckets] or [num_buckets]"
    table = float_tensor("table", table, (1, 2), fix)
    num_buckets = positive_int("num_buckets", num_buckets, "pass an int, 32 in T5")
    per_side = num_buckets // 2 if bidirectional else num_buckets
    if per_side < 2:
        raise expected("num_buckets", f">= {4 if bidirectional else 2}", num_buckets,
                       "pass more buckets (T5 uses 32)")
    max_exact = per_side // 2
    max_distance = positive_int("max_distance", max_distance, "pass an int, 128 in T5")
    if max_distance <= max_exact:
        raise expected("max_distance", f"> {max_exact} (the exact-bucket range)", max_distance,
                       "pass a larger max_distance (T5 uses 128)")
    if table.shape[-1] != num_buckets:
        raise expected("table", f"a last dimension of num_buckets = {num_buckets}",
                       f"shape {list(table.shape)}", fix)
    thresholds = _t5_thresholds(per_side, max_distance)

    def bucket_of(relative):
        n = abs(relative) if bidirectional else torch.clamp(-relative, min=0)
        bucket = torch.clamp(n, max=max_exact)
        for t in thresholds:
            bucket = bucket + (n >= t)
        if bidirectional:
            bucket = torch.where(relative > 0, bucket + per_side, bucket)
        return bucket

    if table.dim() == 1:
        def shared_t5_bias_score_mod(score, b, h, q_idx, kv_idx):
            return score + table[bucket_of(kv_idx - q_idx)]
        return shared_t5_bias_score_mod

    def t5_bias_score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, bucket_of(kv_idx - q_idx)]

    return t5_bias_score_mod
