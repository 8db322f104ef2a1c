"""A score_mod's bias as steps along the keys and the queries.

Where ``score_mod(score) = score + T`` and ``T = c + a * q_idx + k * kv_idx`` (``a`` not
zero; ``a``, ``k`` and ``c`` may read ``b``, ``h``, constants and captured tensors
indexed by them), ALiBi's ``slope[h] * (kv_idx - q_idx)`` being the everyday case, a
softmax row does not see the part of ``T`` that is the same across the row. Relative to
a position ``anchor`` the kernel picks near its tile (a program's first query or key):

    T(q_idx, kv_idx) = k * (kv_idx - anchor) + T(anchor, anchor) + a * (q_idx - anchor)

The scores take the key term ``k * (kv_idx - anchor)``: in the forward and the dQ kernels,
``k * j`` for a tile's j-th key (a vector computed once a program) plus ``k * (start -
anchor)``, the same for the whole tile (the forward adds it to the tile's row maxima, not
to each score); in the dK / dV kernels, whose programs own their keys, one vector a
program. The row term ``T(anchor, anchor) + a * (q_idx - anchor)`` goes into the row's
statistics: the forward adds it to the LSE and the row maximum it writes, the backward
takes it off the LSE it reads (one value a row). Per score that is one add, where the
mod's printed form also costs, per tile, a subtraction, a conversion and a multiply for
each position difference a thread holds (Triton's compiler shares those between a
thread's rows): at head dim 64 the Gluon forward's loop went from 587 to 488
instructions a tile pair.

Each part stays as small as the bias itself near the tile: ``k * (kv_idx - anchor)``,
not ``k * kv_idx``, whose float32 rounding at long positions would exceed the bias's own.
"""
from __future__ import annotations

import sympy

from .expr import INDEX_SYMBOLS, SCORE

ANCHOR = sympy.Symbol("anchor", integer=True, nonnegative=True)


def separable_terms(expr):
    """(k, a, T(anchor, anchor)) of score_mod ``expr`` as sympy expressions free of the
    positions, or None where the mod is not ``score + c + a * q_idx + k * kv_idx`` with ``a``
    not zero (``k`` may be zero: a bias of the queries only)."""
    q, kv = INDEX_SYMBOLS["q_idx"], INDEX_SYMBOLS["kv_idx"]
    bias = expr - SCORE
    if not expr.has(SCORE) or bias.has(SCORE) or q not in bias.free_symbols:
        return None
    try:
        # A load indexed by a position, a floor, a Piecewise of one ... is no polynomial.
        poly = sympy.Poly(bias, q, kv)
    except sympy.PolynomialError:
        return None
    if not set(poly.monoms()) <= {(0, 0), (1, 0), (0, 1)} or poly.coeff_monomial(q) == 0:
        return None
    # The coefficients as the mod writes them (Poly's own are re-simplified: rounding apart).
    return sympy.diff(bias, kv), sympy.diff(bias, q), bias.xreplace({q: ANCHOR, kv: ANCHOR})


def print_terms(expr) -> tuple | None:
    """(k, a, T(anchor, anchor)) of ``expr`` as Snippets (``flexgen.codegen.printer``), or None."""
    terms = separable_terms(expr)
    if terms is None:
        return None
    from ..codegen.printer import print_snippet
    return tuple(print_snippet(t, f"s{name}_") for t, name in zip(terms, ("k", "a", "c")))
