"""The forward kernel against the float64 oracle (``flexgen.reference``), on CPU.

Every test runs the generated kernel through the Triton interpreter with
poisoned outputs and compares output and LSE with
``flex_attention_reference`` (see ``conftest.check``). Sizes are small and
mostly not multiples of the block size (67, 130, 200) so ragged tails and
padding are always exercised. The conftest also compiles each launched
kernel for sm_90.
"""
from __future__ import annotations

import math

import pytest
import torch

import flexgen
from flexgen import create_block_mask, flex_attention, kernel_source
from flexgen import mods as M
from conftest import kernel_count, make_qkv, run_and_check


def block_mask(mask_mod, B, H, Lq, Lkv=None, BLOCK_SIZE=128):
    return create_block_mask(mask_mod, B, H, Lq, Lq if Lkv is None else Lkv, device="cpu",
                             BLOCK_SIZE=BLOCK_SIZE)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def causal_flipped(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


# --- no mod, plain masks ---------------------------------------------------------------

@pytest.mark.parametrize("L", [67, 200])
def test_no_mod(L):
    q, k, v = make_qkv(B=2, H=2, L=L)
    run_and_check(q, k, v)


def test_no_mod_without_lse_and_explicit_scale():
    q, k, v = make_qkv(B=1, H=2, L=67)
    out = flex_attention(q, k, v, scale=0.37)
    assert isinstance(out, torch.Tensor)
    run_and_check(q, k, v, scale=0.37, return_lse=False)


@pytest.mark.parametrize("scale", [0.0, -0.37])
def test_zero_and_negative_scale(scale):
    """The kernel scales row maxima instead of scores only for a positive scale
    (max(c·x) = c·max(x) needs c > 0; with c = 0 a masked score would give 0·-inf)."""
    q, k, v = make_qkv(B=1, H=2, L=67)
    first_rows_dead = M.and_masks(M.causal_mask, lambda b, h, q_idx, kv_idx: q_idx >= 3)
    run_and_check(q, k, v, scale=scale, block_mask=block_mask(first_rows_dead, None, None, 67))
    run_and_check(q, k, v, scale=scale)


def test_noncontiguous_inputs():
    """[B, L, H, D] storage seen as [B, H, L, D]: only the last dim is contiguous."""
    B, H, L, D = 2, 2, 67, 32
    q, k, v = (torch.randn(B, L, H, D).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    run_and_check(q, k, v, block_mask=block_mask(causal, None, None, L))


MASKS = {
    "causal": lambda L: M.causal_mask,
    "sliding_window": lambda L: M.sliding_window(37),
    "two_sided_window": lambda L: M.sliding_window(21, causal=False),
    "prefix_lm": lambda L: M.prefix_lm(45),
    "document": lambda L: M.document_mask(M.doc_ids_from_lengths([50, 13, 60, 1], total_length=L)),
    "causal_document": lambda L: M.and_masks(
        M.causal_mask, M.document_mask(M.doc_ids_from_lengths([29, 80], total_length=L))),
    "or_masks": lambda L: M.or_masks(M.sliding_window(10), lambda b, h, q_idx, kv_idx: kv_idx < 4),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_masks(name):
    L = 130
    mask_mod = MASKS[name](L)
    q, k, v = make_qkv(B=1, H=2, L=L)
    run_and_check(q, k, v, block_mask=block_mask(mask_mod, None, None, L))


def test_inline_document_mask_captured_ids():
    """Document ids captured per batch ([B, L]), written inline."""
    B, L = 2, 130
    docs = torch.stack([torch.sort(torch.randint(0, 5, (L,))).values,
                        torch.sort(torch.randint(0, 3, (L,))).values]).to(torch.int32)

    def doc_mask(b, h, q_idx, kv_idx):
        return docs[b, q_idx] == docs[b, kv_idx]

    q, k, v = make_qkv(B=B, H=2, L=L)
    run_and_check(q, k, v, block_mask=block_mask(doc_mask, B, None, L))


# --- score mods ---------------------------------------------------------------------------

def test_alibi_captured_slopes():
    H, L = 4, 130
    slopes = torch.rand(H) * 0.2

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    q, k, v = make_qkv(B=1, H=H, L=L)
    run_and_check(q, k, v, score_mod=alibi, block_mask=block_mask(causal, None, None, L))


def test_alibi_computed_slopes_non_power_of_two_heads():
    H, L = 3, 67
    q, k, v = make_qkv(B=1, H=H, L=L)
    run_and_check(q, k, v, score_mod=M.alibi(num_heads=H))


def test_tanh_softcap():
    q, k, v = make_qkv(B=2, H=2, L=67)
    q = q * 4   # large scores, so the cap bites

    def softcap(score, b, h, q_idx, kv_idx):
        return 2.0 * torch.tanh(score / 2.0)

    run_and_check(q, k, v, score_mod=softcap)


def test_relative_bias_offset_index():
    """bias[h, q_idx - kv_idx + L - 1]: a table with one column per distance."""
    H, L = 2, 130
    table = torch.randn(H, 2 * L - 1)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + L - 1]

    q, k, v = make_qkv(B=1, H=H, L=L)
    run_and_check(q, k, v, score_mod=rel_bias)


def test_relative_bias_negative_wrapping_index():
    """bias[h, q_idx - kv_idx]: negative distances count from the end, as in torch."""
    H, L = 2, 130
    table = torch.randn(H, 2 * L - 1)

    def rel_bias_wrapping(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx]

    q, k, v = make_qkv(B=1, H=H, L=L)
    run_and_check(q, k, v, score_mod=rel_bias_wrapping, block_mask=block_mask(
        M.sliding_window(50, causal=False), None, None, L))


def test_library_relative_position_bias():
    H, L = 2, 67
    mod = M.relative_position_bias(torch.randn(H, 2 * L - 1), L)
    q, k, v = make_qkv(B=1, H=H, L=L)
    run_and_check(q, k, v, score_mod=mod)


def test_score_mod_with_mask_mod():
    L = 200
    q, k, v = make_qkv(B=2, H=2, L=L)
    run_and_check(q, k, v, score_mod=M.tanh_softcap(1.5),
                  block_mask=block_mask(M.sliding_window(70), None, None, L))


def test_score_mod_and_mask_mod_both_capture():
    """Two captured tensors in one kernel (score_mod's and mask_mod's buffers)."""
    B, H, L = 2, 2, 130
    bias = torch.randn(B, H, L)
    doc = torch.randint(0, 3, (L,)).sort().values

    def kv_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, kv_idx]

    def same_doc(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    q, k, v = make_qkv(B=B, H=H, L=L)
    run_and_check(q, k, v, score_mod=kv_bias, block_mask=block_mask(same_doc, None, None, L))


def _distance(q_idx, kv_idx):
    return q_idx - kv_idx


def _penalty(d, strength):
    return strength * torch.abs(d).to(torch.float32)


def test_helper_functions_in_mod():
    def with_helpers(score, b, h, q_idx, kv_idx):
        return score - _penalty(_distance(q_idx, kv_idx), 0.25)

    q, k, v = make_qkv(B=1, H=2, L=67)
    run_and_check(q, k, v, score_mod=with_helpers)


@pytest.mark.parametrize("slope", [0.25, 0.05, 1 / 3])
def test_float_constant_times_integer_index(slope):
    """A Python float times an index (ALiBi with a fixed slope), the most common bias.

    0.05 is not a short binary fraction: its exact Rational has a 52-bit
    numerator, which must not be printed as an int32 multiplier of the index.
    """
    def fixed_alibi(score, b, h, q_idx, kv_idx):
        return score - slope * (q_idx - kv_idx) + slope * h

    q, k, v = make_qkv(B=1, H=2, L=67)
    run_and_check(q, k, v, score_mod=fixed_alibi)


def test_int_valued_score_mod():
    """A score_mod returning integers: the kernel converts them to float like torch."""
    def int_score(score, b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) // 7 + h

    q, k, v = make_qkv(B=1, H=2, L=67)
    run_and_check(q, k, v, score_mod=int_score)


def test_where_and_mixed_promotion():
    def piecewise(score, b, h, q_idx, kv_idx):
        far = (q_idx - kv_idx) > 20
        return torch.where(far, score * 0.5, score + (kv_idx % 3) / 2)

    q, k, v = make_qkv(B=1, H=2, L=67)
    run_and_check(q, k, v, score_mod=piecewise)


ELEMENTWISE = {
    "exp_log_sigmoid": lambda s, b, h, q, kv: torch.log(torch.exp(s) + 1) - torch.sigmoid(s) * 2,
    "trig_pow_sqrt": lambda s, b, h, q, kv: torch.cos(s) + torch.sin(s) * s ** 2 / 4
    + torch.sqrt(torch.abs(s)) - torch.exp2(s) * torch.rsqrt(q + 1.0),
    "rounding": lambda s, b, h, q, kv: torch.floor(s * 3) / 3 + (s * 3).to(torch.int32) / 5
    + torch.sign(s) + s % 0.5 + torch.ceil(s),
    "int_and_minmax": lambda s, b, h, q, kv: torch.maximum(s, torch.minimum(q * 0.01, kv * 0.02))
    + ((q & 3) == (kv & 3)) * 0.5 + ((q > 10) ^ (kv > 10)) - torch.clamp(s, min=-0.5, max=0.7)
    + ((q * 100000) % 7) * 0.1,
    "constant": lambda s, b, h, q, kv: 1.0,
    "kv_only": lambda s, b, h, q, kv: kv * 0.1,
    "masked_fill": lambda s, b, h, q, kv: s.masked_fill(q < kv, -1e9),
}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_functions(name):
    q, k, v = make_qkv(B=1, H=2, L=67)
    run_and_check(q, k, v, score_mod=ELEMENTWISE[name])


# --- GQA, lengths, head dims, dtypes --------------------------------------------------------

@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (8, 1)])
def test_gqa(Hq, Hkv):
    L = 67
    slopes = torch.rand(Hq) * 0.1

    def alibi(score, b, h, q_idx, kv_idx):   # h is the query head
        return score + slopes[h] * (kv_idx - q_idx)

    q, k, v = make_qkv(B=1, H=Hq, Hkv=Hkv, L=L)
    run_and_check(q, k, v, score_mod=alibi, block_mask=block_mask(causal, None, Hq, L),
                  enable_gqa=True)


@pytest.mark.parametrize("Lq,Lkv", [(67, 200), (200, 67)])
def test_lq_ne_lkv(Lq, Lkv):
    q, k, v = make_qkv(B=1, H=2, L=Lq, Lkv=Lkv)
    run_and_check(q, k, v)
    # bottom-right aligned causal; with Lq > Lkv the first rows see nothing
    mask = block_mask(M.causal_lower_right(Lq, Lkv), None, None, Lq, Lkv)
    run_and_check(q, k, v, block_mask=mask)


@pytest.mark.parametrize("D,Dv,dtype", [
    (64, 64, torch.float32),
    (80, 80, torch.float32),
    (128, 128, torch.bfloat16),
    (80, 80, torch.bfloat16),
    (64, 32, torch.float32),
    (32, 64, torch.bfloat16),
])
def test_head_dims(D, Dv, dtype):
    L = 130
    q, k, v = make_qkv(B=1, H=2, L=L, D=D, Dv=Dv, dtype=dtype)
    out, _ = run_and_check(q, k, v, block_mask=block_mask(causal, None, None, L))
    assert out.shape == (1, 2, L, Dv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_dtypes(dtype):
    L = 130
    q, k, v = make_qkv(B=2, H=2, L=L, dtype=dtype)
    out, lse = run_and_check(q, k, v, score_mod=M.tanh_softcap(5.0),
                             block_mask=block_mask(M.sliding_window(40), None, None, L))
    assert out.dtype == dtype and lse.dtype == torch.float32


# --- LSE and fully masked rows ----------------------------------------------------------------

@pytest.mark.parametrize("Hq,Hkv", [(0, 0), (0, 2), (2, 0)])
def test_zero_heads_is_an_input_error(Hq, Hkv):
    """The kernels divided by the head counts (the dK/dV kernel by 0 // 0 inside the kernel, the
    host by zero elsewhere); torch's flex_attention raises ZeroDivisionError on 0 heads."""
    q, k = torch.randn(1, Hq, 40, 16), torch.randn(1, Hkv, 40, 16)
    for L in (40, 3):          # the forward and the decode kernel
        with pytest.raises(flexgen.InputError, match="at least 1 head"):
            flex_attention(q[:, :, :L], k, k, enable_gqa=True)


@pytest.mark.parametrize("shape", [(0, 2, 40), (1, 2, 0), (0, 2, 3)])
def test_empty_batch_or_queries_give_empty_outputs(shape):
    """As torch's flex_attention does for an empty batch: empty outputs, and empty gradients."""
    q = torch.randn(*shape, 16, requires_grad=True)
    k, v = (torch.randn(shape[0], 2, 40, 16, requires_grad=True) for _ in range(2))
    out, lse = flex_attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    out.sum().backward()
    assert q.grad.shape == q.shape and (k.grad == 0).all() and (v.grad == 0).all()


def test_lse_is_natural_log():
    q, k, v = make_qkv(B=1, H=1, L=67)
    _, lse = flex_attention(q, k, v, return_lse=True)
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), atol=1e-4, rtol=1e-5)


def test_fully_masked_rows_inside_partial_blocks():
    """Every third query row sees nothing: zeros and lse = -inf, never NaN."""
    def some_rows_dead(b, h, q_idx, kv_idx):
        return (q_idx % 3 != 0) & (kv_idx <= q_idx)

    L = 130
    q, k, v = make_qkv(B=1, H=2, L=L)
    out, lse = run_and_check(q, k, v, score_mod=M.tanh_softcap(20.0),
                             block_mask=block_mask(some_rows_dead, None, None, L))
    assert torch.isneginf(lse[:, :, ::3]).all()
    assert (out[:, :, ::3] == 0).all()


def test_fully_masked_query_blocks():
    """Whole query blocks with no kv block at all: the kernel still writes them."""
    def late_rows_only(b, h, q_idx, kv_idx):
        return (q_idx >= 150) & (kv_idx < 40)

    L = 200
    mask = block_mask(late_rows_only, None, None, L, BLOCK_SIZE=64)
    assert int(mask.kv_num_blocks[0, 0, 0] + mask.full_kv_num_blocks[0, 0, 0]) == 0
    q, k, v = make_qkv(B=1, H=2, L=L)
    out, lse = run_and_check(q, k, v, block_mask=mask)
    assert torch.isneginf(lse[:, :, :150]).all() and (out[:, :, :150] == 0).all()
    assert torch.isfinite(lse[:, :, 150:]).all()


def test_fully_masked_everything():
    def nothing(b, h, q_idx, kv_idx):
        return q_idx < 0

    L = 67
    q, k, v = make_qkv(B=1, H=2, L=L)
    out, lse = run_and_check(q, k, v, block_mask=block_mask(nothing, None, None, L))
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_score_mod_minus_inf_masks():
    """A score_mod writing -inf masks like a mask_mod (rows fully -inf give zeros)."""
    def inf_mask(score, b, h, q_idx, kv_idx):
        return torch.where((kv_idx <= q_idx) & (q_idx >= 10), score, -float("inf"))

    q, k, v = make_qkv(B=1, H=2, L=67)
    out, lse = run_and_check(q, k, v, score_mod=inf_mask)
    assert torch.isneginf(lse[:, :, :10]).all()


# --- block mask layouts ----------------------------------------------------------------------

@pytest.mark.parametrize("BLOCK_SIZE", [64, 128, (64, 128)])
def test_block_sizes(BLOCK_SIZE):
    L = 200
    q, k, v = make_qkv(B=1, H=2, L=L)
    run_and_check(q, k, v, block_mask=block_mask(M.sliding_window(90), None, None, L,
                                                 BLOCK_SIZE=BLOCK_SIZE))


def _shift_b(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx - 30 * b + 5


def _shift_h(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx + 20 * h - 10


def _shift_bh(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx - 30 * b + 20 * h) | (kv_idx == h + 3 * b)


@pytest.mark.parametrize("mod,mB,mH", [
    (causal, None, None),   # one mask for every batch and head
    (_shift_b, 2, None),    # per batch, broadcast over heads
    (_shift_h, None, 2),    # per head, broadcast over the batch
    (_shift_bh, 2, 2),      # per batch and head
])
def test_per_batch_and_head_masks(mod, mB, mH):
    """Broadcast dims (None) are for mods that do not depend on b / h."""
    L = 130
    q, k, v = make_qkv(B=2, H=2, L=L)
    mask = block_mask(mod, mB, mH, L)
    assert mask.kv_num_blocks.shape[:2] == (mB or 1, mH or 1)
    run_and_check(q, k, v, block_mask=mask)


def test_per_batch_document_ids_with_gqa():
    B, Hq, Hkv, L = 2, 4, 2, 130
    docs = torch.stack([M.doc_ids_from_lengths([60, 70]), M.doc_ids_from_lengths([10, 100, 20])])
    mask = block_mask(M.and_masks(M.causal_mask, M.document_mask(docs)), B, Hq, L)
    q, k, v = make_qkv(B=B, H=Hq, Hkv=Hkv, L=L, dtype=torch.bfloat16)
    run_and_check(q, k, v, block_mask=mask, enable_gqa=True)


def test_kernel_options_tiles():
    L = 130
    q, k, v = make_qkv(B=1, H=2, L=L)
    run_and_check(q, k, v, block_mask=block_mask(causal, None, None, L),
                  kernel_options={"BLOCK_M": 32, "BLOCK_N": 32, "PRESCALE_QK": False})


# --- kernel reuse ---------------------------------------------------------------------------------

def test_captured_0d_tensor_is_a_runtime_scalar():
    temperature = torch.tensor(0.5)

    def scaled(score, b, h, q_idx, kv_idx):
        return score * temperature

    q, k, v = make_qkv(B=1, H=2, L=67)
    out1, _ = run_and_check(q, k, v, score_mod=scaled)
    n = kernel_count()
    src = kernel_source(q, k, v, score_mod=scaled)
    temperature.fill_(3.0)
    out2, _ = run_and_check(q, k, v, score_mod=scaled)
    assert not torch.allclose(out1, out2), "changing the captured scalar must change the output"
    assert kernel_count() == n, "a new value of a captured 0-d tensor must not create a kernel"
    assert kernel_source(q, k, v, score_mod=scaled) == src
    # a different 0-d tensor of the same dtype reuses the kernel as well
    other = torch.tensor(-1.0)

    def scaled_other(score, b, h, q_idx, kv_idx):
        return score * other

    run_and_check(q, k, v, score_mod=scaled_other)
    assert kernel_count() == n


def test_captured_0d_tensor_in_mask_mod():
    L = 130
    offset = torch.tensor(-20, dtype=torch.int32)
    mod = M.causal(offset)
    q, k, v = make_qkv(B=1, H=2, L=L)
    run_and_check(q, k, v, block_mask=block_mask(mod, None, None, L))
    n = kernel_count()
    offset.fill_(35)
    run_and_check(q, k, v, block_mask=block_mask(mod, None, None, L))
    assert kernel_count() == n


def test_captured_python_number_is_a_constant():
    q, k, v = make_qkv(B=1, H=2, L=67)
    assert kernel_source(q, k, v, score_mod=M.tanh_softcap(20.0)) != \
        kernel_source(q, k, v, score_mod=M.tanh_softcap(30.0))


def test_new_length_reuses_the_kernel():
    def softcap(score, b, h, q_idx, kv_idx):
        return 10.0 * torch.tanh(score / 10.0)

    sources = []
    for L in (67, 130, 200):
        q, k, v = make_qkv(B=1, H=2, L=L)
        mask = block_mask(causal, None, None, L)
        sources.append(kernel_source(q, k, v, score_mod=softcap, block_mask=mask))
        if L == 67:
            run_and_check(q, k, v, score_mod=softcap, block_mask=mask)
            n = kernel_count()
    assert sources[0] == sources[1] == sources[2]
    q, k, v = make_qkv(B=2, H=3, L=200)     # new batch, heads and length
    run_and_check(q, k, v, score_mod=softcap, block_mask=block_mask(causal, None, None, 200))
    assert kernel_count() == n


def test_equivalent_spellings_share_one_kernel():
    L = 130
    q, k, v = make_qkv(B=1, H=2, L=L)
    m1, m2 = block_mask(causal, None, None, L), block_mask(causal_flipped, None, None, L)
    assert torch.equal(m1.kv_indices, m2.kv_indices)
    assert kernel_source(q, k, v, block_mask=m1) == kernel_source(q, k, v, block_mask=m2)

    def identity(score, b, h, q_idx, kv_idx):
        return score

    def noisy_identity(score, b, h, q_idx, kv_idx):
        return score * 1.0 + 0

    def reordered(score, b, h, q_idx, kv_idx):
        return (kv_idx - q_idx) * 0.5 + score

    def reordered2(score, b, h, q_idx, kv_idx):
        return score + 0.5 * kv_idx - q_idx / 2

    assert kernel_source(q, k, v, score_mod=identity) == kernel_source(q, k, v, score_mod=noisy_identity)
    assert kernel_source(q, k, v, score_mod=reordered) == kernel_source(q, k, v, score_mod=reordered2)
    run_and_check(q, k, v, score_mod=noisy_identity, block_mask=m2)
    n = kernel_count()
    run_and_check(q, k, v, score_mod=identity, block_mask=m1)
    assert kernel_count() == n


def test_kernel_source_is_what_runs():
    q, k, v = make_qkv(B=1, H=2, L=67)
    src = kernel_source(q, k, v, score_mod=M.tanh_softcap(7.0))
    assert "@triton.jit" in src and "_tanh(" in src
    flex_attention(q, k, v, score_mod=M.tanh_softcap(7.0))
    loaded = [m for m in flexgen.codegen.cache._MODULES.values() if m.__file__ and
              open(m.__file__).read() == src]
    assert loaded, "the loaded kernel module's file must hold kernel_source's text"
