"""A score_mod ``score + c + a * q_idx + k * kv_idx`` taken as a key term and a row term.

``flexgen.frontend.terms`` finds the form (ALiBi and its spellings); the softmax kernels add
``k * (kv_idx - anchor)`` per score and fold the row term into the LSE and row maxima they
write (the forward) or the LSE they read (the backward). Checked here: which mods take the
form, that the split is exactly the mod, and the tl kernels' output, LSE, row maxima and
gradients against the float64 oracle under the interpreter (masks, dead rows, GQA, ragged
lengths, varlen, a learned slope); the Gluon kernels compile for sm_90 in
test_forward_gluon.py / test_backward_gluon.py and run against the oracle there on the GPU.
"""
from __future__ import annotations

import random

import pytest
import sympy
import torch

import flexgen
from flexgen import create_block_mask
from flexgen import mods as M
from flexgen.frontend import lowering
from flexgen.frontend.expr import INDEX_SYMBOLS, SCORE, to_sympy
from flexgen.frontend.terms import ANCHOR, separable_terms
from flexgen.frontend.trace import trace, trace_cached
from flexgen.reference import flex_attention_reference, per_element
from conftest import check, make_qkv

SLOPES = torch.tensor([0.5, 0.25, 0.125, 1 / 16])


def hand_alibi(score, b, h, q_idx, kv_idx):
    return score + (kv_idx - q_idx) * 0.3


def tensor_alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def integer_bias(score, b, h, q_idx, kv_idx):
    return score + (kv_idx - q_idx)


def rows_only(score, b, h, q_idx, kv_idx):
    return score + q_idx * 0.25


def mixed(score, b, h, q_idx, kv_idx):
    return score - 0.02 * kv_idx + 0.05 * q_idx + h * 0.5 - 1.5


SEPARABLE = {"alibi_8": M.alibi(8), "alibi_12": M.alibi(12), "alibi_max_bias": M.alibi(4, max_bias=5.5),
             "alibi_slopes": M.alibi(slopes=SLOPES), "hand": hand_alibi, "tensor": tensor_alibi,
             "integer": integer_bias, "rows_only": rows_only, "mixed": mixed}

OTHER = {
    "softcap": M.tanh_softcap(30.0),
    "score_scaled": lambda s, b, h, q, kv: s * 2 + (kv - q),
    "symmetric": lambda s, b, h, q, kv: s - (kv - q).abs() * 0.1,
    "product": lambda s, b, h, q, kv: s + q * kv * 1e-3,
    "square": lambda s, b, h, q, kv: s + kv * kv * 1e-3 + q,
    "table": lambda s, b, h, q, kv: s + SLOPES[q % 4],
    "causal_in_score": lambda s, b, h, q, kv: torch.where(q >= kv, s, -float("inf")),
    "keys_only": lambda s, b, h, q, kv: s + kv * 0.1,
}


def expr_of(mod):
    return to_sympy(trace(mod, "score_mod"), "s")


@pytest.mark.parametrize("name", sorted(SEPARABLE))
def test_the_split_is_the_mod(name):
    """T(q, kv) = k (kv - anchor) + T(anchor, anchor) + a (q - anchor) for any anchor, exactly."""
    expr = expr_of(SEPARABLE[name])
    k, a, c = separable_terms(expr)
    q, kv, b, h = (INDEX_SYMBOLS[n] for n in ("q_idx", "kv_idx", "b", "h"))
    assert not {q, kv} & (k.free_symbols | a.free_symbols | c.free_symbols)
    bias = expr - SCORE
    rng = random.Random(0)
    for _ in range(5):
        values = {q: rng.randrange(4000), kv: rng.randrange(4000), b: rng.randrange(3), h: rng.randrange(4)}
        anchor = rng.randrange(4000)
        split = k * (values[kv] - anchor) + c.subs(ANCHOR, anchor) + a * (values[q] - anchor)
        residual = (split - bias).subs(values)
        if residual.is_number:
            assert abs(float(residual)) < 1e-6       # (biases of a few thousand, in float64)
        else:                           # a captured slope (slopes[h]) stands as a symbol
            assert sympy.expand(residual) == 0


@pytest.mark.parametrize("name", sorted(OTHER))
def test_other_mods_keep_their_per_element_form(name):
    """Anything but score + c + a q_idx + k kv_idx (a reading q_idx) is printed as before."""
    assert separable_terms(expr_of(OTHER[name])) is None
    assert lowering.lower(trace_cached(OTHER[name], "score_mod")).terms is None


def test_the_terms_travel_with_the_lowered_mod_and_the_shipped_forms():
    """The lowered record keeps them (the restart index, flexgen.mods' shipped forms), the
    forward and backward specs carry them, the decode spec does not (its template adds the
    mod per element)."""
    lowered = lowering.lower(trace_cached(M.alibi(16), "score_mod"))
    assert lowered.terms is not None and len(lowered.terms) == 3
    again = lowering._from_record(lowering._record(lowered), lowered.graph, lowered.prefix)
    assert again.terms == lowered.terms
    q, k, v = make_qkv(H=16, L=64)
    plan = flexgen.api.plan(q, k, v, score_mod=M.alibi(16))
    assert plan.spec.score_terms == lowered.terms
    for part in ("forward", "dq", "dkdv"):
        assert "key_step2" in flexgen.kernel_source(q, k, v, score_mod=M.alibi(16), part=part)
    # A learned slope: the dQ kernel scatters its gradient from the mod's per-element form.
    slopes = torch.rand(16, requires_grad=True)
    learned = M.alibi(slopes=slopes)
    assert "key_step2" not in flexgen.kernel_source(q, k, v, score_mod=learned, part="dq")
    assert "key_step2" in flexgen.kernel_source(q, k, v, score_mod=learned, part="dkdv")
    decode = flexgen.api.plan(q[:, :, :1], k, v, score_mod=M.alibi(16))
    assert decode.kernel == "decode" and decode.decode.spec.score_terms is None


def reference_max_scores(q, k, v, score_mod, mask_mod, scale=None):
    """Each row's largest score after score_mod (float64; -inf for a fully masked row)."""
    B, H, Lq, D = q.shape
    group = H // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    scores = q.double() @ k.transpose(-1, -2) * (D ** -0.5 if scale is None else scale)
    scores = per_element(score_mod, B, H, Lq, k.shape[2], "cpu", score=scores)
    if mask_mod is not None:
        scores = scores.masked_fill(~per_element(mask_mod, B, H, Lq, k.shape[2], "cpu").bool(), float("-inf"))
    return scores.amax(-1)


def dead_rows(b, h, q_idx, kv_idx):
    """Rows below 40 see no key; the others the causal ones."""
    return (q_idx >= 40) & (q_idx >= kv_idx)


@pytest.mark.parametrize("mask", [None, "causal", "dead_rows"])
@pytest.mark.parametrize("name", ["alibi_12", "alibi_slopes", "integer", "rows_only", "mixed"])
def test_forward_output_lse_and_max_scores_match_the_oracle(name, mask):
    """GQA, ragged lengths (200 queries, 333 keys), a fully masked stretch of rows."""
    mask_mod = {"causal": M.causal_mask, "dead_rows": dead_rows}.get(mask)
    score_mod = SEPARABLE[name]
    q, k, v = make_qkv(B=2, H=4, Hkv=2, L=200, Lkv=333, D=64)
    bm = None if mask_mod is None else create_block_mask(mask_mod, 2, 4, 200, 333, device="cpu")
    out, aux = flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True,
                                      return_aux=flexgen.AuxRequest(lse=True, max_scores=True))
    ref, ref_lse = flex_attention_reference(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                            enable_gqa=True, return_lse=True)
    check(out, ref, q.dtype, aux.lse, ref_lse)
    ref_max = reference_max_scores(q, k, v, score_mod, mask_mod)
    dead = torch.isneginf(ref_max)
    assert torch.equal(torch.isneginf(aux.max_scores), dead)
    torch.testing.assert_close(aux.max_scores[~dead].double(), ref_max[~dead], atol=1e-4, rtol=1e-5)


def test_varlen_alibi_matches_each_sequence_alone():
    """Packed sequences: the anchor is a position of each sequence (queries aligned to the last
    keys where a sequence has fewer queries than keys)."""
    lens_q, lens_k = [70, 0, 130], [70, 40, 200]
    H, D = 4, 32
    q = torch.randn(sum(lens_q), H, D)
    k = torch.randn(sum(lens_k), H, D)
    v = torch.randn(sum(lens_k), H, D)
    cu_q = torch.tensor([0, 70, 70, 200], dtype=torch.int32)
    cu_k = torch.tensor([0, 70, 110, 310], dtype=torch.int32)
    out, lse = flexgen.varlen_attention(q, k, v, cu_q, cu_k, 130, 200, score_mod=M.alibi(H),
                                        mask_mod=M.causal_mask, return_lse=True)
    for s in (0, 2):
        qs = q[cu_q[s]:cu_q[s + 1]].transpose(0, 1)[None]
        ks, vs = (t[cu_k[s]:cu_k[s + 1]].transpose(0, 1)[None] for t in (k, v))
        shift = lens_k[s] - lens_q[s]

        def aligned(b, h, q_idx, kv_idx, shift=shift):
            return q_idx + shift >= kv_idx

        def alibi_aligned(score, b, h, q_idx, kv_idx, shift=shift):
            return M.alibi(H)(score, b, h, q_idx + shift, kv_idx)

        ref, ref_lse = flex_attention_reference(qs, ks, vs, score_mod=alibi_aligned, mask_mod=aligned,
                                                return_lse=True)
        check(out[cu_q[s]:cu_q[s + 1]].transpose(0, 1)[None], ref, q.dtype,
              lse[:, cu_q[s]:cu_q[s + 1]][None], ref_lse)


@pytest.mark.parametrize("mask", [None, "causal", "dead_rows"])
@pytest.mark.parametrize("name", ["alibi_12", "mixed", "learned"])
def test_gradients_match_the_oracle(name, mask):
    """The backward takes the key term per score and the row term off the LSE the forward
    wrote (both kernels; a learned slope's dQ kernel the mod per element, scattering the
    slope's gradient): every gradient matches the oracle's, dead rows included. Errors are
    measured against each gradient's largest entry (test_backward's measure): the kernels
    anchor the bias at their own tiles, so the forward's LSE and the dQ kernel's scores round
    differently at ~1e-5 of an exponent, and a slope's gradient sums ~28k such products
    (float32: 7e-5 of its largest entry here, 7e-6 with the mod per element everywhere)."""
    mask_mod = {"causal": M.causal_mask, "dead_rows": dead_rows}.get(mask)
    slopes = SLOPES.clone().requires_grad_()
    score_mod = M.alibi(slopes=slopes) if name == "learned" else SEPARABLE[name]
    q, k, v = (t.requires_grad_() for t in make_qkv(B=1, H=4, Hkv=2, L=150, Lkv=190, D=32))
    bm = None if mask_mod is None else create_block_mask(mask_mod, 1, 4, 150, 190, device="cpu")
    inputs = (q, k, v) + ((slopes,) if name == "learned" else ())
    out = flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, grad)
    inputs64 = tuple(t.detach().double().requires_grad_() for t in inputs)
    ref_mod = M.alibi(slopes=inputs64[3]) if name == "learned" else score_mod
    ref = flex_attention_reference(*inputs64[:3], score_mod=ref_mod, mask_mod=mask_mod, enable_gqa=True)
    want = torch.autograd.grad(ref, inputs64, grad.double())
    for g, w in zip(got, want):
        assert not torch.isnan(g).any()
        assert (g.double() - w).abs().max() <= 2e-4 * max(1.0, w.abs().max().item())
