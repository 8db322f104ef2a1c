"""flexgen.varlen_attention: packed sequences against the float64 oracle on the same sequences
padded, forward and backward (mods reading b and positions, GQA, chunked prefill's
bottom-right alignment, empty and length-1 sequences), the custom op under torch.compile,
and the input errors."""
from __future__ import annotations

import pytest
import torch

import flexgen
from flexgen import InputError
from flexgen.reference import flex_attention_reference


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def pack(lengths, H, D, dtype=torch.float32):
    return torch.randn(sum(lengths), H, D, dtype=dtype)


def padded_reference(q, k, v, q_lens, k_lens, score_mod=None, mask_mod=None, scale=None,
                     enable_gqa=False):
    """(out [total_q, Hq, Dv], lse [Hq, total_q]) in float64 from flexgen's oracle over a padded
    [B, H, L, D] batch: query i of sequence b at row i, its mods called at position
    i + max(0, Lk - Lq), padded keys masked out. Differentiable in q, k, v."""
    B = len(q_lens)
    Lq, Lk = max(max(q_lens), 1), max(max(k_lens), 1)
    shift = torch.tensor([max(0, lk - lq) for lq, lk in zip(q_lens, k_lens)])
    k_len = torch.tensor(k_lens)

    def scatter(x, lens, L):
        rows = [(b, i) for b, n in enumerate(lens) for i in range(n)]
        padded = x.new_zeros(B, L, *x.shape[1:])
        if rows:
            bi, ii = (torch.tensor(c) for c in zip(*rows))
            padded = padded.index_put((bi, ii), x)
        return padded.transpose(1, 2), rows

    qp, q_rows = scatter(q.double(), q_lens, Lq)
    kp, _ = scatter(k.double(), k_lens, Lk)
    vp, _ = scatter(v.double(), k_lens, Lk)

    def padded_mask(b, h, q_idx, kv_idx):
        keep = kv_idx < k_len[b]
        if mask_mod is not None:
            keep = keep & mask_mod(b, h, q_idx + shift[b], kv_idx)
        return keep

    padded_score = None
    if score_mod is not None:
        def padded_score(score, b, h, q_idx, kv_idx):
            return score_mod(score, b, h, q_idx + shift[b], kv_idx)

    out, lse = flex_attention_reference(qp, kp, vp, padded_score, padded_mask, scale=scale,
                                        enable_gqa=enable_gqa, return_lse=True)
    if not q_rows:
        return out.new_zeros(0, q.shape[1], v.shape[2]), lse.new_zeros(q.shape[1], 0)
    bi, ii = (torch.tensor(c) for c in zip(*q_rows))
    return out.transpose(1, 2)[bi, ii], lse[bi, :, ii].transpose(0, 1)


# Several tiles per sequence, so the band's skipped, cut and full tiles all occur.
SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 16}


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 5)


def test_forward_plain_gqa_empty_and_single():
    q_lens = k_lens = [5, 0, 1, 37, 20]
    q, k, v = pack(q_lens, 4, 16), pack(k_lens, 2, 16), pack(k_lens, 2, 16)
    out, lse = flexgen.varlen_attention(q, k, v, offsets(q_lens), offsets(k_lens), 37, 37,
                                        enable_gqa=True, return_lse=True)
    ref, ref_lse = padded_reference(q, k, v, q_lens, k_lens, enable_gqa=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)


def test_chunked_prefill_mods_see_sequence_and_positions():
    # Fewer queries than keys (a prefill chunk after a cached prefix): bottom-right aligned.
    # A sequence with keys and no queries, one with queries and no keys (rows fully masked).
    q_lens, k_lens = [3, 0, 1, 20, 4], [10, 4, 1, 45, 0]
    q, k, v = pack(q_lens, 2, 16), pack(k_lens, 2, 16), pack(k_lens, 2, 32)
    per_seq = torch.randn(len(q_lens))

    def softcap_bias(score, b, h, q_idx, kv_idx):
        return 8.0 * torch.tanh(score / 8.0) + per_seq[b] + 0.01 * (q_idx - kv_idx)

    out, lse = flexgen.varlen_attention(q, k, v, offsets(q_lens), offsets(k_lens), 20, 45,
                                        score_mod=softcap_bias, mask_mod=causal, return_lse=True,
                                        kernel_options=SMALL_TILES)
    ref, ref_lse = padded_reference(q, k, v, q_lens, k_lens, softcap_bias, causal)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    assert torch.isneginf(lse[:, -4:]).all() and (out[-4:] == 0).all()


def test_backward_window_learned_bias_gqa():
    q_lens, k_lens = [33, 1, 0, 18], [40, 1, 3, 18]
    q, k, v = pack(q_lens, 4, 16), pack(k_lens, 2, 16), pack(k_lens, 2, 16)
    bias = torch.randn(4) * 0.5
    for t in (q, k, v, bias):
        t.requires_grad_(True)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    out = flexgen.varlen_attention(q, k, v, offsets(q_lens), offsets(k_lens), 33, 40,
                                   score_mod=head_bias, mask_mod=window, enable_gqa=True,
                                   kernel_options=SMALL_TILES)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, bias), grad)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, bias)]

    def head_bias64(score, b, h, q_idx, kv_idx):
        return score + leaves[3][h]

    ref, _ = padded_reference(*leaves[:3], q_lens, k_lens, head_bias64, window, enable_gqa=True)
    want = torch.autograd.grad(ref, leaves, grad.double())
    torch.testing.assert_close(out.detach().double(), ref.detach(), atol=2e-5, rtol=2e-5)
    for name, g, w in zip("q k v bias".split(), got, want):
        torch.testing.assert_close(g.double(), w, atol=1e-4, rtol=1e-4, msg=lambda m: f"d{name}: {m}")


def test_compiled_op_forward_and_backward():
    q_lens = k_lens = [7, 0, 12]
    q, k, v = (pack(k_lens, 2, 16).requires_grad_(True) for _ in range(3))
    cu = offsets(q_lens)

    def step(q, k, v):
        return flexgen.varlen_attention(q, k, v, cu, cu, 12, 12, mask_mod=causal).sum()

    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
    loss.backward()
    ref, _ = padded_reference(q.detach(), k.detach(), v.detach(), q_lens, k_lens, mask_mod=causal)
    torch.testing.assert_close(loss.double(), ref.sum(), atol=1e-4, rtol=1e-4)
    assert q.grad is not None and k.grad is not None


def test_errors_name_the_argument():
    q = pack([4], 2, 16)
    with pytest.raises(InputError, match="cu_seqlens_q.*int32"):
        flexgen.varlen_attention(q, q, q, torch.tensor([0, 4]), offsets([4]), 4, 4)
    with pytest.raises(InputError, match="cu_seqlens_k.*offsets like cu_seqlens_q"):
        flexgen.varlen_attention(q, q, q, offsets([4]), offsets([2, 2]), 4, 4)
    with pytest.raises(InputError, match=r"query.*\[total_tokens, H, D\]"):
        flexgen.varlen_attention(q[None], q, q, offsets([4]), offsets([4]), 4, 4)
    with pytest.raises(InputError, match="max_seqlen_q"):
        flexgen.varlen_attention(q, q, q, offsets([4]), offsets([4]), torch.tensor(4), 4)


# ------------------------------------------------------------------------- the Gluon kernel (sm_90)
#
# Where flex_attention would take the Gluon forward (AUTO from gluon_min_scores() scores of the
# packed views, or BACKEND "gluon"), varlen takes its varlen form: TMA loads through the packed
# [1, H, total, D] views, pointer stores of each sequence's rows. Gluon does not run in the
# interpreter: on CPU the variants compile for sm_90; the oracle comparisons need the GPU.

import conftest  # noqa: E402
from flexgen.codegen import cache  # noqa: E402
from flexgen.runtime import aot  # noqa: E402
from flexgen.runtime import plan as plan_module  # noqa: E402

GLUON = {"BACKEND": "gluon"}
ON_HOPPER = (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
             and plan_module.gluon_refusal("cuda", (9, 0), torch.bfloat16, 64, 64) is None)


def chunked_softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0) + 0.01 * (q_idx - kv_idx)


# (Hq, Hkv, D, q_lens, k_lens, score_mod, mask_mod): empty and one-token sequences, a ragged
# last tile, chunked prefill (fewer queries than keys), GQA, no mask and the window's band.
GLUON_CASES = {
    "causal_d128": (4, 4, 128, [5, 0, 1, 300, 130, 128, 77], None, None, causal),
    "plain_gqa_d64": (4, 2, 64, [129, 0, 64, 257], None, None, None),
    "window_chunked_d128": (2, 1, 128, [40, 3, 200, 0], [300, 3, 450, 9], chunked_softcap, window),
    # A relative-position table over the packed totals: proven loads (bounds_check.proven_loads).
    "relbias_window_d64": (2, 1, 64, [40, 3, 200, 0], [300, 3, 450, 9], "relbias", window),
    # Head dim 256: 64-key slots, two deep.
    "causal_gqa_d256": (4, 2, 256, [5, 0, 1, 300, 130, 128, 77], None, None, causal),
    # A padded head dim (80 in 128 columns): the pointer store masks the padding's columns.
    "window_chunked_d80": (2, 1, 80, [40, 3, 200, 0], [300, 3, 450, 9], chunked_softcap, window),
}


def relative_bias(H, positions, device):
    """score + table[h, q_idx - kv_idx + positions - 1], the table covering positions below
    ``positions`` (the packed totals, what the host can prove the reads against)."""
    table = torch.linspace(-1.0, 1.0, H * (2 * positions - 1), device=device).reshape(H, -1).sin()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + positions - 1]
    return score_mod


def gluon_case(name, device):
    Hq, Hkv, D, q_lens, k_lens, score, mask = GLUON_CASES[name]
    k_lens = k_lens or q_lens
    if score == "relbias":
        score = relative_bias(Hq, max(sum(q_lens), sum(k_lens)), device)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(sum(n), h, D, generator=gen).to(device, torch.bfloat16)
               for n, h in ((q_lens, Hq), (k_lens, Hkv), (k_lens, Hkv)))
    return q, k, v, offsets(q_lens).to(device), offsets(k_lens).to(device), q_lens, k_lens, score, mask


@pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
@pytest.mark.parametrize("name", sorted(GLUON_CASES))
def test_gluon_varlen_compiles_for_sm90(monkeypatch, name):
    monkeypatch.setattr(plan_module, "gluon_unavailable", lambda query, D, Dv: None)
    plan_module.clear_memos()
    try:
        q, k, v, cu_q, cu_k, _, _, score, mask = gluon_case(name, "cpu")
        from flexgen.frontend.trace import trace_cached
        from flexgen.runtime.options import parse_options
        s = None if score is None else trace_cached(score, "score_mod")
        m = None if mask is None else trace_cached(mask, "mask_mod")
        plan = plan_module.plan_varlen(q, k, v, cu_q, cu_k, s.graph if s else "", s.buffers if s else (),
                                       m.graph if m else "", m.buffers if m else (), 0.125, True,
                                       parse_options(GLUON).text)
        assert plan.spec.template == "forward_gluon" and plan.spec.varlen
        assert plan.tl_spec.template == "forward"
        conftest.skip_outside_aot_sample(plan.spec)
        module = cache.load(plan.spec, interpret=False)
        out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
        lse = torch.empty(q.shape[1], q.shape[0])
        grid, args, constexprs = module.arguments(
            q=q, k=k, v=v, out=out, lse=lse, cu_q=cu_q, cu_k=cu_k, score_buffers=s.buffers if s else (),
            mask_buffers=m.buffers if m else (), scale=0.125, max_scores=None)
        ptx = aot.compile_launch(plan.spec, args, constexprs).asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    finally:
        plan_module.clear_memos()


@pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU and Triton's Gluon")
@pytest.mark.parametrize("name", sorted(GLUON_CASES))
def test_gluon_varlen_matches_the_oracle_and_the_tl_kernel(name):
    q, k, v, cu_q, cu_k, q_lens, k_lens, score, mask = gluon_case(name, "cuda")
    outs = {}
    for backend in ("gluon", "tl"):
        outs[backend] = flexgen.varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens),
                                                 score_mod=score, mask_mod=mask, enable_gqa=True,
                                                 return_lse=True, kernel_options={"BACKEND": backend})
    # The reference runs on CPU, with the mods' captured tensors there too.
    ref_score = gluon_case(name, "cpu")[7]
    ref, ref_lse = padded_reference(q.cpu().float(), k.cpu().float(), v.cpu().float(), q_lens, k_lens,
                                    ref_score, mask, enable_gqa=True)
    (out, lse), (out_tl, lse_tl) = outs["gluon"], outs["tl"]
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-2, rtol=2e-2)
    live = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.cpu().double()[live], ref_lse[live], atol=2e-3, rtol=2e-3)
    assert torch.isneginf(lse.cpu()[~live]).all() and torch.equal(torch.isneginf(lse), torch.isneginf(lse_tl))
    torch.testing.assert_close(out.float(), out_tl.float(), atol=2e-2, rtol=2e-2)
