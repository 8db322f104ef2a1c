"""Build one mod out of several.

``and_masks(a, b)`` keeps a position only where every mask keeps it (the
intersection of the pictures), ``or_masks(a, b)`` where any one does (the
union). ``compose_score_mods(f, g)`` applies ``f`` and then ``g`` to the
score. The results are ordinary mods: they trace like hand-written ones, so
``and_masks(causal_mask, document_mask(ids))`` compiles to one kernel.

Same names and meaning as ``torch.nn.attention.flex_attention``, except
that the constant masks are comparisons (``q_idx >= 0``) rather than new
tensors, because a mod may not create tensors.
"""
from __future__ import annotations

from ._check import callables


def noop_mask(b, h, q_idx, kv_idx):
    """Keeps every position (a picture with every cell filled)."""
    return q_idx >= 0


def _empty_mask(b, h, q_idx, kv_idx):
    """Keeps no position: what ``or_masks()`` of nothing is."""
    return q_idx < 0


def and_masks(*mask_mods):
    """A mask_mod keeping a position only where every one of ``mask_mods`` does.

    With no arguments it is ``noop_mask`` (everything kept).
    """
    callables("and_masks", mask_mods)
    if not mask_mods:
        return noop_mask

    def and_mask(b, h, q_idx, kv_idx):
        keep = mask_mods[0](b, h, q_idx, kv_idx)
        for mod in mask_mods[1:]:
            keep = keep & mod(b, h, q_idx, kv_idx)
        return keep

    return and_mask


def or_masks(*mask_mods):
    """A mask_mod keeping a position where any one of ``mask_mods`` does.

    With no arguments it keeps nothing.
    """
    callables("or_masks", mask_mods)
    if not mask_mods:
        return _empty_mask

    def or_mask(b, h, q_idx, kv_idx):
        keep = mask_mods[0](b, h, q_idx, kv_idx)
        for mod in mask_mods[1:]:
            keep = keep | mod(b, h, q_idx, kv_idx)
        return keep

    return or_mask


def compose_score_mods(*score_mods):
    """A score_mod applying ``score_mods`` in order: ``g(f(score))`` for ``(f, g)``.

    Each one sees the score the previous one returned and the same indices.
    With no arguments it returns the score unchanged.
    """
    callables("compose_score_mods", score_mods)

    def composed_score_mod(score, b, h, q_idx, kv_idx):
        for mod in score_mods:
            score = mod(score, b, h, q_idx, kv_idx)
        return score

    return composed_score_mod
