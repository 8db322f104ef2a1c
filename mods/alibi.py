"""ALiBi (Press et al., 2022): a per-head linear penalty on distance.

The score of query ``i`` and key ``j`` in head ``h`` gets
``slope[h] * (j - i)`` added: zero on the diagonal, falling linearly with
distance into the past (and rising into the future, which a causal mask
removes). Pictured as a bias matrix it is a Toeplitz ramp, steeper for heads
with larger slopes::

    alibi bias, slope 0.5, L = 4

     0.0  0.5  1.0  1.5
    -0.5  0.0  0.5  1.0
    -1.0 -0.5  0.0  0.5
    -1.5 -1.0 -0.5  0.0

The standard slopes are computed inside the kernel from ``h`` (no buffer to
load); custom slopes are a captured tensor indexed as ``slopes[h]``.
"""
from __future__ import annotations

import math

import torch

from flexgen.errors import expected

from ._check import float_tensor, positive_int, positive_number


def alibi_slopes(num_heads, device=None) -> torch.Tensor:
    """The paper's slopes, float32 ``[num_heads]``.

    For ``n`` a power of two: ``2 ** (-8 * (k + 1) / n)`` for head ``k``
    (1/2, 1/4, ..., 1/256 for 8 heads). Otherwise, as in the authors' code:
    the slopes of the nearest lower power of two ``p``, followed by every
    other slope of ``2p`` (the odd-numbered ones) until there are ``n``.
    """
    n = positive_int("num_heads", num_heads, "pass the number of query heads, >= 1")
    p = 2 ** int(math.floor(math.log2(n)))
    slopes = [2.0 ** (-8.0 * (k + 1) / p) for k in range(p)]
    slopes += [2.0 ** (-8.0 * (2 * k + 1) / (2 * p)) for k in range(n - p)]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def alibi(num_heads=None, slopes=None, max_bias=8.0):
    """score_mod adding ``slope[h] * (kv_idx - q_idx)`` to the score.

    Give ``num_heads`` for the paper's slopes (``alibi_slopes``), computed in
    the kernel as ``exp2(-max_bias * (h + 1) / p)`` and its odd-step continuation
    (``max_bias`` 8 in the paper; some models use another), or ``slopes``, a float
    tensor ``[H]`` (on the device of q) read as ``slopes[h]``. ``h`` is the query
    head, also under GQA.
    """
    if slopes is None:
        if num_heads is None:
            raise expected("num_heads", "an int (or slopes=)", None,
                           "pass alibi(num_heads=H) or alibi(slopes=tensor_of_H_slopes)")
        n = positive_int("num_heads", num_heads, "pass the number of query heads, >= 1")
        max_bias = float(positive_number("max_bias", max_bias, "pass the largest slope exponent, e.g. 8.0"))
        p = 2 ** int(math.floor(math.log2(n)))
        step, step_odd = -max_bias / p, -max_bias / 2 / p
        if n == p:
            def alibi_score_mod(score, b, h, q_idx, kv_idx):
                return score + torch.exp2(step * (h + 1)) * (kv_idx - q_idx)
            return alibi_score_mod

        def alibi_score_mod(score, b, h, q_idx, kv_idx):
            # heads past the largest power of two p take the odd slopes of 2p
            slope = torch.where(h < p, torch.exp2(step * (h + 1)),
                                torch.exp2(step_odd * (2 * (h - p) + 1)))
            return score + slope * (kv_idx - q_idx)

        return alibi_score_mod

    fix = "pass a float tensor [H] of per-head slopes"
    if not isinstance(slopes, torch.Tensor):
        try:
            slopes = torch.as_tensor(slopes, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise expected("slopes", "a float tensor [H]", repr(slopes), fix) from None
    slopes = float_tensor("slopes", slopes, (1,), fix)
    if num_heads is not None:
        n = positive_int("num_heads", num_heads, "pass the number of query heads, >= 1")
        if slopes.shape[0] != n:
            raise expected("slopes", f"{n} slopes (num_heads)", f"{slopes.shape[0]}",
                           "give one slope per query head, or drop num_heads")

    def alibi_custom_score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi_custom_score_mod
