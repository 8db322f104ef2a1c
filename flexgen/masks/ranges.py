"""The kv positions a mask can keep for a query, read off its canonical form.

Packed variable-length attention (``flexgen.varlen_attention``) builds no block
lists: each program walks the key tiles of one sequence. For the masks serving
uses (causal, sliding window, chunked prefill's bottom-right causal) the keys a
query can see form a band ``q_idx + lo <= kv_idx <= q_idx + hi``; the kernel
then visits only the tiles that meet the band and applies the mask only on the
tiles the band cuts (the others are entirely inside it).

``kv_range`` finds the band in the conjuncts of the canonical mask expression
that compare ``q_idx`` and ``kv_idx`` with unit coefficients and a constant
(``q_idx >= kv_idx``, ``q_idx - kv_idx < W``, ``Eq(q_idx, kv_idx)``). Other
conjuncts (a document id, a padding bound) stay in the mask, which the kernel
then applies on every visited tile (``exact`` False). A mask that is not a
conjunction of such terms (an Or, a prefix-LM) gets no band: every tile, mask
applied. The band only ever removes keys the mask removes, so it is safe.
"""
from __future__ import annotations

RELATIONS = ("GreaterThan", "StrictGreaterThan", "LessThan", "StrictLessThan", "Equality")


def _unit_difference(d):
    """(s, c) with ``d == s * (q_idx - kv_idx) + c`` and s = +-1, c an integer; else None."""
    import sympy
    coefficients = sympy.expand(d).as_coefficients_dict()
    by_name, constant = {}, 0
    for term, c in coefficients.items():
        if term == 1:
            if not c.is_Integer:
                return None
            constant = int(c)
        elif isinstance(term, sympy.Symbol) and term.name in ("q_idx", "kv_idx") and c.is_Integer:
            by_name[term.name] = int(c)
        else:
            return None
    s = by_name.get("q_idx")
    if s not in (1, -1) or by_name.get("kv_idx") != -s:
        return None
    return s, constant


def kv_range(expr) -> tuple | None:
    """``(lo, hi, exact)``: the mask keeps only ``q_idx + lo <= kv_idx <= q_idx + hi`` (either
    bound None when the mask sets none), and exactly that band when ``exact``; None when the
    mask bounds kv_idx by no such band."""
    import sympy
    if expr is sympy.true or expr is sympy.false:
        return None
    terms = expr.args if isinstance(expr, sympy.And) else (expr,)
    lo = hi = None
    exact = True
    for term in terms:
        kind = type(term).__name__
        found = _unit_difference(term.lhs - term.rhs) if kind in RELATIONS else None
        if found is None:
            exact = False
            continue
        s, c = found
        # As "e >= 0" with e = s * (q - kv) + c, one per side the relation bounds.
        normalized = {"GreaterThan": [(s, c)], "StrictGreaterThan": [(s, c - 1)],
                      "LessThan": [(-s, -c)], "StrictLessThan": [(-s, -c - 1)],
                      "Equality": [(s, c), (-s, -c)]}[kind]
        for sign, const in normalized:
            if sign == 1:            # q - kv + const >= 0: kv <= q + const
                hi = const if hi is None else min(hi, const)
            else:                    # kv - q + const >= 0: kv >= q - const
                lo = -const if lo is None else max(lo, -const)
    if lo is None and hi is None:
        return None
    return lo, hi, exact


__all__ = ["kv_range"]
