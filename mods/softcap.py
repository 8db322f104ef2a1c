"""Logit soft-capping (Gemma 2, Grok): squash scores smoothly into (-cap, cap).

``cap * tanh(score / cap)`` is the identity for small scores and saturates
at ``±cap`` for large ones; no position is masked, so there is no picture:
the mask is the full square. Plotted against the raw score it is an S-curve
through the origin with slope 1 there.

``approx=True`` replaces tanh by a rational function (Padé approximant from
Lambert's continued fraction, degree 11 over 10) that needs only multiply,
add, one divide and a clamp: no exp, no tanh call. Its input is clamped at
``±7.6223…``, where the approximant reaches 1. Max ``|approx - tanh|`` over
all reals: 4.8e-7 in exact arithmetic, 7.5e-7 evaluated in float32 (about
6 float32 ulps of 1), so the soft-capped score is within ``cap * 7.5e-7``.
"""
from __future__ import annotations

import torch

from ._check import positive_number

# tanh(x) ~ x * P(x²) / Q(x²) for |x| <= _CLAMP, coefficients in ascending powers
# of x², normalised by the constant term 13749310575 so that P(0) = Q(0) = 1.
_P = tuple(c / 13749310575 for c in (13749310575, 1964187225, 64324260, 675675, 2145, 1))
_Q = tuple(c / 13749310575 for c in (13749310575, 6547290750, 413513100, 7567560, 45045, 66))
_CLAMP = 7.622339845796429  # the positive root of x P(x²) = Q(x²)


def _polynomial(coefficients, x2):
    """Horner's rule: sum of coefficients[k] * x2**k."""
    result = coefficients[-1]
    for c in reversed(coefficients[:-1]):
        result = result * x2 + c
    return result


def tanh_approx(x):
    """tanh(x) to within 7.5e-7 (float32) using only + * / and a clamp (traceable)."""
    x = torch.clamp(x, -_CLAMP, _CLAMP)
    x2 = x * x
    return x * _polynomial(_P, x2) / _polynomial(_Q, x2)


def tanh_softcap(cap, approx=False):
    """score_mod returning ``cap * tanh(score / cap)``.

    ``cap`` is a positive number (Gemma 2 uses 50 for attention logits).
    ``approx=True`` uses ``tanh_approx`` (see the module docstring for the
    error bound) instead of ``torch.tanh``.
    """
    cap = positive_number("cap", cap, "pass the soft-cap value, e.g. 50.0")

    if approx:
        def tanh_softcap_approx_score_mod(score, b, h, q_idx, kv_idx):
            return cap * tanh_approx(score / cap)
        return tanh_softcap_approx_score_mod

    def tanh_softcap_score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return tanh_softcap_score_mod
