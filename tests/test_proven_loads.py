"""Captured-tensor loads the host proves in bounds: read without checks, at clamped positions.

Where interval bounds over a call's positions put every index of a load in [0, size)
(``flexgen.frontend.bounds_check.proven_loads``), the planner keeps the proof in the kernel
spec and the printer reads the tensor without the wrap of negative indices and without the
bounds mask, at positions clamped into the sequence (so a ragged tile's padded rows and keys
stay inside the tensor). Everything else keeps the checked form. These tests check the proof
(exactly-sized tables, one entry short, negative wraps, data-dependent indices, the int32
extent), that a proof is a spec of its own (never a stale kernel), and the forward, backward,
decode, sigmoid and varlen kernels against the float64 oracle with odd lengths and GQA; on a
GPU the same cases run compiled (the tl and Gluon kernels).
"""
from __future__ import annotations

import pytest
import torch

import flexgen
import flexgen.runtime.plan
from flexgen import create_block_mask, flex_attention, sigmoid_attention
from flexgen.codegen import cache
from flexgen.frontend.bounds_check import IndexBoundsError, proven_loads
from flexgen.frontend.trace import trace
from flexgen.reference import flex_attention_reference, sigmoid_attention_reference
from conftest import make_qkv, run_and_check
from test_varlen import offsets, pack, padded_reference

# Front-end checks (tracing, masks, mods and their kernels' numerics): CI runs them with the
# newest Triton; its second pass compiles their launches from the first pass's record.
pytestmark = pytest.mark.once

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TILES = {"BLOCK_M": 32, "BLOCK_N": 32}      # CPU: several tiles per sequence, ragged tails


def rel_bias(table, offset):
    """score + table[h, q_idx - kv_idx + offset] (a learned relative-position bias)."""
    def rel(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + offset]
    return rel


def rel_bias_1d(table, offset):
    def rel1d(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + offset]
    return rel1d


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def doc_mask(doc):
    def same_doc(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)
    return same_doc


def proven(mod, kind, B, H, Lq, Lkv):
    return proven_loads(trace(mod, kind), B, H, Lq, Lkv)


# ------------------------------------------------------------------------- the proof

def test_a_table_exactly_the_needed_size_is_proven():
    for Lq, Lkv in ((67, 131), (131, 67), (1, 1)):
        table = torch.zeros(3, Lq + Lkv - 1)
        want = "sbuf0(h, -kv_idx + q_idx" + (f" + {Lkv - 1})" if Lkv > 1 else ")")
        assert proven(rel_bias(table, Lkv - 1), "score_mod", 2, 3, Lq, Lkv) == (want,)
        # Positions the call does not reach do not matter: shorter calls are proven too.
        assert proven(rel_bias(table, Lkv - 1), "score_mod", 2, 3, Lq - 1 or 1, Lkv) != ()


def test_what_is_not_proven_keeps_its_checks():
    table = torch.zeros(3, 198)
    # One entry short of q - kv + 99 in [0, 198]: the host raises (below); no proof.
    assert proven(rel_bias(table, 99), "score_mod", 1, 3, 100, 100) == ()
    assert proven(rel_bias(table, 99), "score_mod", 1, 3, 99, 100) != ()
    # Negative indices that wrap (torch semantics): valid, but not in [0, size).
    assert proven(rel_bias(table, 0), "score_mod", 1, 3, 50, 50) == ()
    # A head the table lacks.
    assert proven(rel_bias(table, 99), "score_mod", 1, 4, 99, 100) == ()
    # Empty or unknown ranges prove nothing.
    assert proven(rel_bias(table, 99), "score_mod", 1, 3, 0, 100) == ()
    assert proven(rel_bias(table, 99), "score_mod", 1, 3, None, 100) == ()
    # An index read from a tensor: known on the device only; the position-only load is proven.
    doc = torch.zeros(1, 100, dtype=torch.int32)
    per_doc = torch.zeros(5)

    def doc_bias(score, b, h, q_idx, kv_idx):
        return score + per_doc[doc[b, q_idx]]

    assert proven(doc_bias, "score_mod", 1, 3, 100, 100) == ("sbuf0(b, q_idx)",)   # doc: traced first


def test_position_offsets_past_int32_are_not_proven():
    """The dims that read positions add int32 offsets in the kernel: their extent must fit."""
    wide = torch.empty(1 << 16, 1 << 16, device="meta")      # 2**32 elements, no memory

    def pair_bias(score, b, h, q_idx, kv_idx):
        return score + wide[q_idx, kv_idx]

    assert proven(pair_bias, "score_mod", 1, 1, 100, 100) == ()
    narrow = torch.empty(1 << 15, 1 << 15, device="meta")    # 2**30

    def pair_bias2(score, b, h, q_idx, kv_idx):
        return score + narrow[q_idx, kv_idx]

    assert proven(pair_bias2, "score_mod", 1, 1, 100, 100) == ("sbuf0(q_idx, kv_idx)",)
    # Dims that read b / h only take 64-bit offsets: a huge head stride is fine.
    per_head = torch.empty(4, 1 << 31, device="meta")

    def head_rows(score, b, h, q_idx, kv_idx):
        return score + per_head[h, q_idx]

    assert proven(head_rows, "score_mod", 1, 4, 100, 100) == ("sbuf0(h, q_idx)",)


def test_tables_too_small_still_raise():
    q, k, v = make_qkv(H=3, L=100)
    table = torch.zeros(3, 198)
    with pytest.raises(IndexBoundsError):
        flex_attention(q, k, v, score_mod=rel_bias(table, 99))
    with pytest.raises(IndexBoundsError):
        flexgen.kernel_source(q, k, v, score_mod=rel_bias(table, 99))


def test_the_proof_is_part_of_the_spec():
    """One mod, two calls: proven at short lengths, wrapping (valid, unproven) at long ones. Each
    gets its own kernel, both match the oracle, and the first call's kernel comes back."""
    table = torch.randn(2, 64)
    mod = rel_bias(table, 20)                  # q - kv + 20: in [4, 36] at 17, [-19, 59] at 40
    short, long = make_qkv(H=2, L=17), make_qkv(H=2, L=40)
    p_short, p_long = flexgen.api.plan(*short, score_mod=mod), flexgen.api.plan(*long, score_mod=mod)
    assert p_short.proven[0] and not p_long.proven[0]
    assert p_short.spec.key != p_long.spec.key
    assert "q_idx_clamped" in flexgen.kernel_source(*short, score_mod=mod)
    checked = flexgen.kernel_source(*long, score_mod=mod)
    assert "q_idx_clamped" not in checked and "sbuf0_size1, s_" in checked     # the wrap
    for _ in range(2):
        run_and_check(*short, score_mod=mod, kernel_options=TILES)
        run_and_check(*long, score_mod=mod, kernel_options=TILES)
    assert flexgen.api.plan(*short, score_mod=mod).spec.key == p_short.spec.key


def test_proven_loads_read_without_checks_at_clamped_positions():
    q, k, v = make_qkv(H=2, L=67, Lkv=131)
    table = torch.randn(2, 67 + 131 - 1)
    doc = (torch.arange(131) // 40)[None].int()
    bm = create_block_mask(doc_mask(doc), 1, None, 67, 131, device="cpu", BLOCK_SIZE=32)
    src = flexgen.kernel_source(q, k, v, score_mod=rel_bias(table, 130), block_mask=bm,
                                kernel_options=TILES)
    assert "q_idx_clamped = tl.minimum(offs_m, Q_LEN - 1)[:, None]" in src
    # A kv tile's positions are clamped unless the keys are a multiple of the sparse blocks
    # (EVEN_KV: no tile holds a padded key), where a load of consecutive keys stays contiguous.
    assert ("        if EVEN_KV:\n            kv_idx_clamped = offs_n[None, :]\n        else:\n"
            "            kv_idx_clamped = tl.minimum(offs_n, KV_LEN - 1)[None, :]") in src
    loads = [line.strip() for line in src.splitlines() if "tl.load(sbuf" in line or "tl.load(mbuf" in line]
    assert loads and all("mask=" not in line and "_clamped" in line for line in loads), loads
    assert "sbuf0_ptr + (h.to(tl.int64) * sbuf0_stride0) + ((130 + q_idx_clamped - kv_idx_clamped)" in src


# ------------------------------------------------------------------------- the kernels

# name -> (B, Hq, Hkv, Lq, Lkv, table kind, mask); every table exactly the size the call needs.
CASES = {
    "rel2d_odd_gqa": (2, 4, 2, 67, 131, "2d", None),
    "rel2d_causal_odd": (1, 2, 2, 131, 67, "2d", "causal"),
    "rel1d_document": (2, 2, 1, 100, 100, "1d", "doc"),
    "rel2d_short": (1, 2, 2, 1, 37, "2d", None),
    # lengths that are multiples of the blocks (on the CPU's): positions read unclamped
    "rel1d_document_even": (2, 2, 1, 128, 96, "1d", "doc"),
}


def case(name, device, requires_grad=False, dtype=torch.float32):
    B, Hq, Hkv, Lq, Lkv, kind, mask = CASES[name]
    q, k, v = make_qkv(B=B, H=Hq, Hkv=Hkv, L=Lq, Lkv=Lkv, D=32, dtype=dtype, device=device)
    shape = (Hq, Lq + Lkv - 1) if kind == "2d" else (Lq + Lkv - 1,)
    table = (torch.randn(shape, device=device) * 0.5).requires_grad_(requires_grad)
    score = (rel_bias if kind == "2d" else rel_bias_1d)(table, Lkv - 1)
    mask_mod = None
    if mask == "causal":
        mask_mod = causal
    elif mask == "doc":
        doc = (torch.arange(max(Lq, Lkv), device=device) // 29)[None].expand(B, -1).int()
        mask_mod = doc_mask(doc)
    bm = None if mask_mod is None else create_block_mask(mask_mod, B, None, Lq, Lkv, device=device,
                                                         BLOCK_SIZE=32 if device == "cpu" else 128)
    return q, k, v, table, score, bm


def options(device):
    return TILES if device == "cpu" else None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_matches_the_oracle(name, device):
    q, k, v, table, score, bm = case(name, device)
    assert flexgen.api.plan(q, k, v, score_mod=score, block_mask=bm, enable_gqa=True).proven[0]
    run_and_check(q, k, v, score_mod=score, block_mask=bm, enable_gqa=True,
                  kernel_options=options(device))


def check_training_step(attention, reference, name, device):
    """``attention`` forward and backward on case ``name`` against autograd through the float64
    ``reference``: the output, dQ, dK, dV and the table's gradient (scattered by the dQ kernel,
    whose reads are proven)."""
    q, k, v, table, score, bm = case(name, device, requires_grad=True)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = attention(q, k, v, score_mod=score, block_mask=bm, enable_gqa=True,
                    kernel_options=options(device))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, table), grad)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, table)]
    ref_score = (rel_bias if table.dim() == 2 else rel_bias_1d)(leaves[3], k.shape[2] - 1)
    ref = reference(*leaves[:3], ref_score, None if bm is None else bm.mask_mod, enable_gqa=True)
    want = torch.autograd.grad(ref, leaves, grad.double())
    torch.testing.assert_close(out.detach().double(), ref.detach(), atol=2e-5, rtol=2e-5)
    for what, g, w in zip(("dq", "dk", "dv", "dtable"), got, want):
        torch.testing.assert_close(g.double(), w, atol=1e-4, rtol=1e-4, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_backward_matches_the_oracle(name, device):
    check_training_step(flex_attention, flex_attention_reference, name, device)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_reads_stay_checked_and_match_the_oracle(device):
    """The decode kernel keeps the checked form (its positions follow each step's lengths)."""
    q, k, v = make_qkv(B=2, H=4, Hkv=2, L=3, Lkv=77, device=device)
    table = torch.randn(4, 3 + 77 - 1, device=device)
    score = rel_bias(table, 76)
    plan = flexgen.api.plan(q, k, v, score_mod=score, enable_gqa=True)
    assert plan.kernel == "decode" and "_clamped" not in "\n".join(plan.decode.spec.score.lines)
    run_and_check(q, k, v, score_mod=score, enable_gqa=True)
    # decode_attention: one query per sequence at its last position n - 1 (q - kv in [0, 76]).
    lengths = [77, 40]
    out = flexgen.decode_attention(q[:, :, :1], k, v, score_mod=rel_bias(table, 0), enable_gqa=True,
                                   kv_lengths=torch.tensor(lengths, device=device, dtype=torch.int32))
    for b, n in enumerate(lengths):
        def at_last(score, b_, h, q_idx, kv_idx, n=n):
            return score + table[h, q_idx + n - 1 - kv_idx]
        ref = flex_attention_reference(q[b:b + 1, :, :1], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                                       at_last, enable_gqa=True, dtype=torch.float64)
        torch.testing.assert_close(out[b:b + 1].double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_sigmoid_attention_matches_the_oracle(device):
    check_training_step(sigmoid_attention, sigmoid_attention_reference, "rel2d_causal_odd", device)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_proves_over_its_sequences(device):
    """Varlen's mods see b = the sequence and positions inside it, each below the longer of
    the packed totals (the host reads no offsets): a table over those is proven; one that only
    passes the host's check (positions below each side's total) keeps the checked reads.
    Both match the oracle."""
    q_lens, k_lens = [33, 1, 0, 18, 20], [40, 1, 3, 18, 25]      # totals 72 and 87
    q, k, v = (t.to(device) for t in (pack(q_lens, 4, 16), pack(k_lens, 2, 16), pack(k_lens, 2, 16)))
    for size, proven_here in ((87 + 87 - 1, True), (72 + 87 - 1, False)):
        _varlen_case(q, k, v, q_lens, k_lens, size, proven_here, device)


def _varlen_case(q, k, v, q_lens, k_lens, size, proven_here, device):
    Lq, Lk = max(q_lens), max(k_lens)
    table = (torch.randn(4, size, device=device) * 0.5).requires_grad_(True)
    per_seq = (torch.randn(len(q_lens), device=device) * 0.5).requires_grad_(True)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))

    def biased(table, per_seq):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + sum(k_lens) - 1] + per_seq[b]
        return score_mod

    def biased_padded(table, per_seq):
        # The oracle runs the mod on a padded batch, at padded positions too (masked out):
        # clamp its index there, where the kernels never go.
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + table[h, torch.clamp(q_idx - kv_idx + sum(k_lens) - 1, 0, table.shape[1] - 1)] + per_seq[b]
        return score_mod

    cu_q, cu_k = offsets(q_lens).to(device), offsets(k_lens).to(device)
    traced = trace(biased(table, per_seq), "score_mod")
    plan = flexgen.runtime.plan.plan_varlen(q, k, v, cu_q, cu_k, traced.graph, traced.buffers,
                                            "", (), 0.25, True, "")
    assert len(plan.base.proven[0]) == (2 if proven_here else 1)       # per_seq[b] always
    # A cut tile's keys run on past its sequence (past the last one's end of the packed tensor):
    # varlen's proven reads are always clamped, EVEN_KV or not.
    source = cache.source(plan.spec)
    assert ("kv_idx_clamped = tl.minimum(offs_n, KV_LEN - 1)[None, :]" in source) == proven_here
    assert "if EVEN_KV:\n            kv_idx_clamped" not in source
    out = flexgen.varlen_attention(q, k, v, cu_q, cu_k, Lq, Lk, score_mod=biased(table, per_seq),
                                   mask_mod=causal, enable_gqa=True,
                                   kernel_options={"BLOCK_M": 16, "BLOCK_N": 16} if device == "cpu" else None)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, table, per_seq), grad)
    leaves = [t.detach().cpu().double().requires_grad_(True) for t in (q, k, v, table, per_seq)]
    ref, _ = padded_reference(*leaves[:3], q_lens, k_lens, biased_padded(*leaves[3:]), causal,
                              enable_gqa=True)
    want = torch.autograd.grad(ref, leaves, grad.cpu().double())
    torch.testing.assert_close(out.detach().cpu().double(), ref.detach(), atol=2e-5, rtol=2e-5)
    for what, g, w in zip(("dq", "dk", "dv", "dtable", "dper_seq"), got, want):
        torch.testing.assert_close(g.cpu().double(), w, atol=1e-4, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def test_varlen_plan_proves_over_sequences_not_the_packed_view():
    """The packed view has b = 0 and positions up to the totals; the mods see b = the sequence
    (checked exactly on the host, as torch's padded call would) and positions inside it."""
    from flexgen.runtime.plan import plan_varlen
    from flexgen.frontend.trace import trace_cached
    q_lens, k_lens = [33, 1, 18], [40, 1, 18]
    q, k, v = pack(q_lens, 2, 16), pack(k_lens, 2, 16), pack(k_lens, 2, 16)

    def planned(mod):
        traced = trace_cached(mod, "score_mod")
        return plan_varlen(q, k, v, offsets(q_lens), offsets(k_lens), traced.graph, traced.buffers,
                           "", (), 0.25, False, "")

    one_row = torch.zeros(1)

    def first_row(score, b, h, q_idx, kv_idx):
        return score + one_row[b]

    with pytest.raises(IndexBoundsError, match="from 0 to 2"):
        planned(first_row)
    three = torch.zeros(3)

    def per_sequence(score, b, h, q_idx, kv_idx):
        return score + three[b]

    # q_idx below the longer total (59), kv_idx below the keys' (59): provably in bounds.
    table = torch.zeros(2, 59 + 59 - 1)

    def rel(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 58]

    for mod, want in ((per_sequence, ("sbuf0(b)",)), (rel, ("sbuf0(h, -kv_idx + q_idx + 58)",))):
        plan = planned(mod)
        assert plan.base.proven[0] == want
        assert ("mask=" in "\n".join(plan.spec.score.lines)) == (not want)
